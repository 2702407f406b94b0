"""SFT ROUGE-L and reward-model accuracy against model size, mean +- std over seeds.

    python eval/sft_rm_scale.py --run_glob 'hello_world_*'                   # local runs/
    python eval/sft_rm_scale.py --wandb_project tldr_summarize --wandb_entity <entity>

Reads the final value of each metric of every SFT and reward run: the last line that logged it in
`runs/<run_name>/metrics.jsonl`, or the run summary on wandb (same keys). Runs are grouped by
(exp_name, base_model, seed); the newest run of a key is kept. Writes to --out:
- rouge_score_plot.{png,pdf,csv,md}: SFT `validation/sft/rouge/rougeL`;
- rm_scale_plot.{png,pdf,csv,md}: `eval/rm/validation/accuracy` (TL;DR) and
  `eval/rm/validation_cnndm/accuracy` (out of distribution: CNN/DM, or its synthetic stand-in);
- rm_scale_plot_confidence.{png,pdf,csv,md}: accuracy by labeller confidence
  (`eval/rm/<split>/accuracy/confidence/<c>`), one line per model size.
Each table row is one plotted mean: its seeds, their values, the mean and the std (ddof=1, empty
with a single seed).
"""

import os
from dataclasses import dataclass, field
from typing import Optional

import matplotlib.pyplot as plt
import pandas as pd
import tyro

from common import (console, find_runs, finish_scaling_axes, model_label, model_sizes, parse_size_overrides,
                    plot_over_sizes, save_figure, seed_summary, shifts, write_table)
from summarize_from_feedback_details.hello_world_report import last_metrics


@dataclass
class Args:
    runs_dir: str = "runs"
    """local run folders (runs/<run_name>/ with args.json and metrics.jsonl)"""
    wandb_project: Optional[str] = None
    """read the runs from this wandb project instead of --runs_dir"""
    wandb_entity: Optional[str] = None
    """wandb entity (user or team) of --wandb_project; default your default entity"""
    wandb_tags: list[str] = field(default_factory=list)
    """only wandb runs with one of these tags (all when empty)"""
    run_glob: Optional[str] = None
    """only runs whose name matches this shell pattern, e.g. 'hello_world_*'"""
    sft_exp_name: str = "sft"
    """exp_name of the SFT runs"""
    reward_exp_name: str = "reward"
    """exp_name of the reward-model runs"""
    model_size: list[str] = field(default_factory=list)
    """BASE_MODEL=PARAMETERS overrides of the x axis, e.g. EleutherAI/pythia-1b-deduped=1e9"""
    out: str = "eval/images"
    """folder for the plots (PNG, PDF) and their tables (CSV, markdown)"""


ROUGE = "validation/sft/rouge/rougeL"
RM_SPLITS = {"validation": "TL;DR validation", "validation_cnndm": "CNN/DM (out of distribution)"}
SPLIT_COLORS = {"validation": "tab:blue", "validation_cnndm": "tab:green"}


def final_metrics(run) -> dict:
    """The last logged value of every metric of a run."""
    return last_metrics(run.folder) if run.folder is not None else dict(run.wandb_run.summary_metrics)


def per_seed_values(runs: list, metrics: dict, sizes: dict, key: str) -> pd.DataFrame:
    """One row per run that logged `key`: base_model, model_size, seed, run_name, value. Runs
    without it (no --run_eval, crashed) are left out with a warning."""
    rows = []
    for run in runs:
        if key in metrics[run.name]:
            rows.append({"base_model": run.config["base_model"], "model_size": sizes[run.config["base_model"]],
                         "seed": run.config["seed"], "run_name": run.name, "value": float(metrics[run.name][key])})
        else:
            console.print(f"[yellow]warning:[/yellow] run {run.name} has no {key}; left out")
    return pd.DataFrame(rows, columns=["base_model", "model_size", "seed", "run_name", "value"])


def confidence_values(runs: list, metrics: dict, sizes: dict, split: str) -> pd.DataFrame:
    """Per run and labeller confidence (1-9), the accuracy on pairs of that confidence. Pairs
    without a confidence (logged as `.../confidence/None`) have no place on the x axis."""
    prefix = f"eval/rm/{split}/accuracy/confidence/"
    rows = []
    for run in runs:
        for key, value in metrics[run.name].items():
            if key.startswith(prefix) and key[len(prefix):].isdigit():
                rows.append({"split": split, "base_model": run.config["base_model"],
                             "model_size": sizes[run.config["base_model"]], "confidence": int(key[len(prefix):]),
                             "seed": run.config["seed"], "run_name": run.name, "value": float(value)})
    return pd.DataFrame(rows, columns=["split", "base_model", "model_size", "confidence", "seed", "run_name", "value"])


def main(args: Args) -> None:
    exp_names = [args.sft_exp_name, args.reward_exp_name]
    runs, where = find_runs(args, exp_names)
    if not runs:
        raise SystemExit(f"no {' or '.join(exp_names)} run in {where}")
    sizes = model_sizes(runs, parse_size_overrides(args.model_size))
    metrics = {run.name: final_metrics(run) for run in runs}
    sft_runs = [r for r in runs if r.config["exp_name"] == args.sft_exp_name]
    rm_runs = [r for r in runs if r.config["exp_name"] == args.reward_exp_name]
    os.makedirs(args.out, exist_ok=True)

    # 1. SFT ROUGE-L vs model size
    rouge = per_seed_values(sft_runs, metrics, sizes, ROUGE)
    if len(rouge):
        summary = seed_summary(rouge, ["base_model", "model_size"])
        write_table(summary, args.out, "rouge_score_plot")
        fig, ax = plt.subplots(figsize=(6, 4.5))
        plot_over_sizes(ax, rouge, summary, "SFT", "tab:blue")
        ax.set_ylabel("ROUGE-L of validation summaries vs references")
        ax.set_title("SFT ROUGE-L")
        finish_scaling_axes(ax, rouge["model_size"], rouge["value"])
        save_figure(fig, args.out, "rouge_score_plot")
    else:
        console.print(f"[yellow]warning:[/yellow] no {args.sft_exp_name} run with {ROUGE}: no ROUGE plot")

    # 2. RM accuracy vs model size, in and out of distribution
    accuracy = pd.concat([per_seed_values(rm_runs, metrics, sizes, f"eval/rm/{split}/accuracy").assign(split=split)
                          for split in RM_SPLITS])
    if len(accuracy):
        summary = seed_summary(accuracy, ["split", "base_model", "model_size"])
        write_table(summary, args.out, "rm_scale_plot")
        fig, ax = plt.subplots(figsize=(6, 4.5))
        plotted = [split for split in RM_SPLITS if split in set(accuracy["split"])]
        for split, shift in zip(plotted, shifts(len(plotted))):
            plot_over_sizes(ax, accuracy[accuracy["split"] == split], summary[summary["split"] == split],
                            RM_SPLITS[split], SPLIT_COLORS[split], shift)
        ax.set_ylabel("accuracy on preference labels (validation)")
        ax.set_title("reward model accuracy")
        finish_scaling_axes(ax, accuracy["model_size"], accuracy["value"])
        save_figure(fig, args.out, "rm_scale_plot")
    else:
        console.print(f"[yellow]warning:[/yellow] no {args.reward_exp_name} run with eval/rm/*/accuracy: no RM plots")
        return

    # 3. RM accuracy by labeller confidence, one line per model size
    confidence = pd.concat([confidence_values(rm_runs, metrics, sizes, split) for split in RM_SPLITS])
    if not len(confidence):
        console.print("[yellow]warning:[/yellow] no eval/rm/*/accuracy/confidence/* metric: no confidence plot")
        return
    summary = seed_summary(confidence, ["split", "base_model", "model_size", "confidence"])
    write_table(summary, args.out, "rm_scale_plot_confidence")
    splits = [split for split in RM_SPLITS if split in set(confidence["split"])]
    fig, axes = plt.subplots(1, len(splits), figsize=(5.5 * len(splits), 4.5), sharey=True, squeeze=False)
    models = sorted(set(zip(summary["model_size"], summary["base_model"])))
    colors = plt.cm.viridis([0.15 + 0.7 * i / max(1, len(models) - 1) for i in range(len(models))])
    for ax, split in zip(axes[0], splits):
        for (size, base_model), color in zip(models, colors):
            rows = summary[(summary["split"] == split) & (summary["base_model"] == base_model)].sort_values("confidence")
            ax.errorbar(rows["confidence"], rows["mean"], yerr=rows["std"].fillna(0), color=color, marker="o",
                        capsize=3, label=model_label(base_model, size))
        ax.set_title(RM_SPLITS[split])
        ax.set_xlabel("labeller confidence")
        ax.set_xticks(sorted(set(summary["confidence"])))
        ax.grid(alpha=0.3)
        ax.legend(title="model (mean ± std over seeds)", loc="best", fontsize=8, title_fontsize=8)
    axes[0][0].set_ylabel("reward model accuracy")
    fig.suptitle("reward model accuracy by labeller confidence")
    save_figure(fig, args.out, "rm_scale_plot_confidence")


if __name__ == "__main__":
    main(tyro.cli(Args))
