"""SFT ROUGE-L, reward-model accuracy and DPO's implicit-reward accuracy against model size, mean +-
std over seeds.

    python eval/sft_rm_scale.py --run_glob 'hello_world_*'                   # local runs/
    python eval/sft_rm_scale.py --wandb_project tldr_summarize --wandb_entity <entity>

Reads the final value of each metric of every SFT, reward and DPO run (--sft_exp_name,
--reward_exp_name, --dpo_exp_name; three different names): the last line that logged it in
`runs/<run_name>/metrics.jsonl`, or the run summary on wandb (same keys). Runs are grouped by
(exp_name, base_model, seed); a key uses its run pinned with --runs, else its newest run that has
the metric its plots need (an SFT run ROUGE-L, a reward or DPO run an eval/rm/<split>/accuracy), so
a newer run without --run_eval does not displace a complete one. Writes to --out:
- runs_used_sft_rm_scale.{csv,md}: every run found, which one each key used and why the others
  were set aside (also printed first);
- rouge_score_plot.{png,pdf,csv,md}: SFT `validation/sft/rouge/rougeL`;
- rm_scale_plot.{png,pdf,csv,md}: `eval/rm/validation/accuracy` (TL;DR) and
  `eval/rm/validation_cnndm/accuracy` (out of distribution: CNN/DM, or its synthetic stand-in);
- rm_scale_plot_confidence.{png,pdf,csv,md}: accuracy by labeller confidence
  (`eval/rm/<split>/accuracy/confidence/<c>`), one line per model size;
- rm_scale_dpo_plot.{png,pdf,csv,md}: one panel per split, the reward model's accuracy next to
  DPO's, whose implicit rewards beta * (log pi - log ref) dpo.py logs under the same metric names.
  Only with DPO runs (a warning otherwise); the other plots do not depend on them.
Each table row is one plotted mean: its seeds, their values, the mean, the std (ddof=1) and the
95% t-interval the error bars draw (ci_low, ci_high; both empty with a single seed).
"""

from dataclasses import dataclass, field
from typing import Optional

import matplotlib.pyplot as plt
import pandas as pd
import tyro

from common import (check_exp_names, console, either, find_runs, finish_scaling_axes, interval_bars, model_label,
                    model_sizes, parse_size_overrides, plot_over_sizes, save_figure, seed_summary, shifts, use_runs,
                    write_table)
from summarize_from_feedback_details.infra.tracking import last_metrics


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
    runs: list[str] = field(default_factory=list)
    """pin runs (names or shell patterns): a pinned run is used for its (exp_name, base_model, seed)
    whatever newer runs exist, and is read even outside --run_glob"""
    sft_exp_name: str = "sft"
    """exp_name of the SFT runs"""
    reward_exp_name: str = "reward"
    """exp_name of the reward-model runs"""
    dpo_exp_name: str = "dpo"
    """exp_name of the DPO runs (implicit-reward accuracy under the reward model's metric names)"""
    model_size: list[str] = field(default_factory=list)
    """BASE_MODEL=PARAMETERS overrides of the x axis, e.g. EleutherAI/pythia-1b-deduped=1e9"""
    out: str = "eval/images"
    """folder for the plots (PNG, PDF) and their tables (CSV, markdown)"""


ROUGE = "validation/sft/rouge/rougeL"
RM_SPLITS = {"validation": "TL;DR validation", "validation_cnndm": "CNN/DM (out of distribution)"}
SPLIT_COLORS = {"validation": "tab:blue", "validation_cnndm": "tab:green"}
# the series of rm_scale_dpo_plot, in table and legend order: their `method` and legend label;
# DPO has the colour it has in eval/rlhf_scaling_plot.py
METHODS = {"reward model": "reward model", "DPO": "DPO implicit reward"}
METHOD_COLORS = {"reward model": "tab:purple", "DPO": "tab:green"}


def final_metrics(run) -> dict:
    """The last logged value of every metric of a run."""
    return last_metrics(run.folder) if run.folder is not None else dict(run.wandb_run.summary_metrics)


def lacks(run, metrics: dict, sft_exp_name: str) -> Optional[str]:
    """What the run misses for its plots (None: nothing): an SFT run its ROUGE-L, a reward or DPO run
    every eval/rm/<split>/accuracy. A run without --run_eval, or stopped before its eval, has none."""
    if run.config["exp_name"] == sft_exp_name:
        return None if ROUGE in metrics else f"no {ROUGE}"
    return None if any(f"eval/rm/{split}/accuracy" in metrics for split in RM_SPLITS) else "no eval/rm/*/accuracy"


def per_seed_values(runs: list, metrics: dict, sizes: dict, key: str) -> pd.DataFrame:
    """One row per run that logged `key`: base_model, model_size, seed, run_name, value. Runs
    without it (a reward run evaluated on one split only) are left out with a warning."""
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


def split_accuracy(runs: list, metrics: dict, sizes: dict) -> pd.DataFrame:
    """Per run and split of RM_SPLITS, `eval/rm/<split>/accuracy` (per_seed_values plus a split column)."""
    return pd.concat([per_seed_values(runs, metrics, sizes, f"eval/rm/{split}/accuracy").assign(split=split)
                      for split in RM_SPLITS])


def rouge_plot(rouge: pd.DataFrame, out: str) -> None:
    summary = seed_summary(rouge, ["base_model", "model_size"])
    write_table(summary, out, "rouge_score_plot")
    fig, ax = plt.subplots(figsize=(6, 4.5))
    plot_over_sizes(ax, rouge, summary, "SFT", "tab:blue")
    ax.set_ylabel("ROUGE-L of validation summaries vs references")
    ax.set_title("SFT ROUGE-L")
    finish_scaling_axes(ax, rouge["model_size"], rouge["value"])
    save_figure(fig, out, "rouge_score_plot")


def rm_plot(accuracy: pd.DataFrame, out: str) -> None:
    """Reward-model accuracy vs model size, in and out of distribution, in one axes."""
    summary = seed_summary(accuracy, ["split", "base_model", "model_size"])
    write_table(summary, out, "rm_scale_plot")
    fig, ax = plt.subplots(figsize=(6, 4.5))
    plotted = [split for split in RM_SPLITS if split in set(accuracy["split"])]
    for split, shift in zip(plotted, shifts(len(plotted))):
        plot_over_sizes(ax, accuracy[accuracy["split"] == split], summary[summary["split"] == split],
                        RM_SPLITS[split], SPLIT_COLORS[split], shift)
    ax.set_ylabel("accuracy on preference labels (validation)")
    ax.set_title("reward model accuracy")
    finish_scaling_axes(ax, accuracy["model_size"], accuracy["value"])
    save_figure(fig, out, "rm_scale_plot")


def confidence_plot(confidence: pd.DataFrame, out: str) -> None:
    """Reward-model accuracy by labeller confidence, one panel per split, one line per model size."""
    summary = seed_summary(confidence, ["split", "base_model", "model_size", "confidence"])
    write_table(summary, out, "rm_scale_plot_confidence")
    splits = [split for split in RM_SPLITS if split in set(confidence["split"])]
    fig, axes = plt.subplots(1, len(splits), figsize=(5.5 * len(splits), 4.5), sharey=True, squeeze=False)
    models = sorted(set(zip(summary["model_size"], summary["base_model"])))
    colors = plt.cm.viridis([0.15 + 0.7 * i / max(1, len(models) - 1) for i in range(len(models))])
    for ax, split in zip(axes[0], splits):
        for (size, base_model), color in zip(models, colors):
            rows = summary[(summary["split"] == split) & (summary["base_model"] == base_model)].sort_values("confidence")
            ax.errorbar(rows["confidence"], rows["mean"], yerr=interval_bars(rows), color=color, marker="o",
                        capsize=3, label=model_label(base_model, size))
        ax.set_title(RM_SPLITS[split])
        ax.set_xlabel("labeller confidence")
        ax.set_xticks(sorted(set(summary["confidence"])))
        ax.grid(alpha=0.3)
        ax.legend(title="model (mean, 95% t-interval over seeds)", loc="best", fontsize=8, title_fontsize=8)
    axes[0][0].set_ylabel("reward model accuracy")
    fig.suptitle("reward model accuracy by labeller confidence")
    save_figure(fig, out, "rm_scale_plot_confidence")


def in_order(summary: pd.DataFrame) -> pd.DataFrame:
    """Rows in plot order: split as in RM_SPLITS, then the reward model before DPO, then size (the
    alphabetical order of seed_summary would put DPO first)."""
    order = summary["split"].map(list(RM_SPLITS).index) * len(METHODS) + summary["method"].map(list(METHODS).index)
    return (summary.assign(_order=order).sort_values(["_order", "model_size", "base_model"]).drop(columns="_order")
            .reset_index(drop=True))


def rm_dpo_plot(rm_accuracy: pd.DataFrame, dpo_accuracy: pd.DataFrame, out: str) -> None:
    """The reward model's accuracy and DPO's implicit-reward accuracy vs model size, one panel per
    split that DPO has (a panel of the reward model alone would repeat rm_scale_plot)."""
    series = [rm_accuracy.assign(method="reward model"), dpo_accuracy.assign(method="DPO")]
    accuracy = pd.concat([frame for frame in series if len(frame)])  # without reward runs: DPO alone
    splits = [split for split in RM_SPLITS if split in set(dpo_accuracy["split"])]
    accuracy = accuracy[accuracy["split"].isin(splits)]
    summary = in_order(seed_summary(accuracy, ["split", "method", "base_model", "model_size"]))
    write_table(summary, out, "rm_scale_dpo_plot")
    fig, axes = plt.subplots(1, len(splits), figsize=(5.5 * len(splits), 4.5), sharey=True, squeeze=False)
    for ax, split in zip(axes[0], splits):
        of_split = accuracy[accuracy["split"] == split]
        plotted = [method for method in METHODS if method in set(of_split["method"])]
        for method, shift in zip(plotted, shifts(len(plotted))):
            plot_over_sizes(ax, of_split[of_split["method"] == method],
                            summary[(summary["split"] == split) & (summary["method"] == method)],
                            METHODS[method], METHOD_COLORS[method], shift)
        ax.set_title(RM_SPLITS[split])
    for ax in axes[0]:  # after all panels are drawn: they share one y range
        finish_scaling_axes(ax, accuracy["model_size"], accuracy["value"])
    axes[0][0].set_ylabel("accuracy on preference labels (validation)")
    fig.suptitle("reward model vs DPO implicit reward: accuracy")
    save_figure(fig, out, "rm_scale_dpo_plot")


def main(args: Args) -> None:
    exp_names = check_exp_names({"--sft_exp_name": args.sft_exp_name, "--reward_exp_name": args.reward_exp_name,
                                 "--dpo_exp_name": args.dpo_exp_name})
    found, where = find_runs(args, exp_names)
    if not found:
        raise SystemExit(f"no {either(exp_names)} run in {where}")
    metrics = {run.name: final_metrics(run) for run in found}  # of every run found: they decide which is used
    runs = use_runs(found, args, where, lambda run: lacks(run, metrics[run.name], args.sft_exp_name), "sft_rm_scale")
    sizes = model_sizes(runs, parse_size_overrides(args.model_size))
    sft_runs, rm_runs, dpo_runs = ([r for r in runs if r.config["exp_name"] == name] for name in exp_names)

    # 1. SFT ROUGE-L vs model size
    rouge = per_seed_values(sft_runs, metrics, sizes, ROUGE)
    if len(rouge):
        rouge_plot(rouge, args.out)
    else:
        console.print(f"[yellow]warning:[/yellow] no {args.sft_exp_name} run with {ROUGE}: no ROUGE plot")

    # 2. RM accuracy vs model size, in and out of distribution; 3. by labeller confidence
    rm_accuracy = split_accuracy(rm_runs, metrics, sizes)
    if len(rm_accuracy):
        rm_plot(rm_accuracy, args.out)
        confidence = pd.concat([confidence_values(rm_runs, metrics, sizes, split) for split in RM_SPLITS])
        if len(confidence):
            confidence_plot(confidence, args.out)
        else:
            console.print("[yellow]warning:[/yellow] no eval/rm/*/accuracy/confidence/* metric: no confidence plot")
    else:
        console.print(f"[yellow]warning:[/yellow] no {args.reward_exp_name} run with eval/rm/*/accuracy: no RM plots")

    # 4. DPO's implicit-reward accuracy next to the reward model's
    dpo_accuracy = split_accuracy(dpo_runs, metrics, sizes)
    if len(dpo_accuracy):
        rm_dpo_plot(rm_accuracy, dpo_accuracy, args.out)
    else:
        console.print(f"[yellow]warning:[/yellow] no {args.dpo_exp_name} run with eval/rm/*/accuracy: no rm_scale_dpo_plot")


if __name__ == "__main__":
    main(tyro.cli(Args))
