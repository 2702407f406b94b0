"""The methods side by side at equal episodes (make compare): SFT, PPO, DPO, RLOO, GRPO and online DPO.

    python eval/compare_table.py --run_glob 'scaling_m_*' --out eval/images/compare

Reads the local runs of every policy (--sft_exp_name, --ppo_exp_name, --dpo_exp_name and --methods,
as eval/rlhf_scaling_plot.py; one run per (exp_name, base_model, seed), chosen as eval/ chooses)
that saved a validation table, and per run measures:
- win_rate: the gold judge's win rate of its validation summaries against the references (ties
  count half; the synthetic task's exact judge, so the embedded default only), with its 95% Wilson
  interval over prompts;
- rm_score: the mean score of its summaries under the reward model of its (base_model, seed), the
  `reward_model_path` of that seed's online runs (SFT and DPO train without one), every policy's
  summaries through the same path (hello_world_report.reward_scores);
- length: mean response length in tokens (EOS not counted);
- kl: the online methods' KL to the SFT policy, `objective/kl` averaged over the last 5 updates
  (nats per response; SFT and DPO log none);
- seconds_per_update: the online methods' median `time/update` (each update the same episodes).
Per method (compare_table): the mean over seeds with its 95% t-interval (t with n - 1 degrees of
freedom; no interval from one seed), the per-seed values, the win rate minus SFT's paired by seed
with its interval and a verdict (`beats SFT` where the interval lies above 0, `below SFT` where it
lies below, `not resolved` otherwise), and the seconds per update relative to PPO's.

Writes to --out: compare_runs.{csv,md}, compare_table.{csv,md} (compare_table_full: every number),
compare_phases.{csv,md} (the online methods' median seconds per update by phase, mean over seeds),
compare.{png,pdf} (one panel per measure: each seed a dot, the mean a bar with its 95% interval),
runs_used_compare_table.{csv,md}.
"""

import json
import os
from dataclasses import dataclass, field
from typing import Optional

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import tyro

from common import OTHER_METHODS, local_runs, policy_colors, policy_labels, save_figure, use_runs, write_table
from judges import gold_verdicts, win_counts
from rlhf_scaling_plot import response_lengths, run_tokenizer

from summarize_from_feedback_details.win_rates import t_interval, wilson_interval


@dataclass
class Args:
    runs_dir: str = "runs"
    """local run folders (runs/<run_name>/ with args.json, metrics.jsonl and validation_table.csv)"""
    run_glob: Optional[str] = None
    """only runs whose name matches this shell pattern, e.g. 'scaling_m_*'"""
    runs: list[str] = field(default_factory=list)
    """pin runs (names or shell patterns), as eval/rlhf_scaling_plot.py"""
    sft_exp_name: str = "sft"
    """exp_name of the SFT runs"""
    ppo_exp_name: str = "ppo_left_padding"
    """exp_name of the PPO runs"""
    dpo_exp_name: str = "dpo"
    """exp_name of the DPO runs"""
    methods: list[str] = field(default_factory=lambda: list(OTHER_METHODS))
    """the policies beside SFT, PPO and DPO, as EXP_NAME=LABEL in table order"""
    last_updates: int = 5
    """the KL column averages `objective/kl` over this many last updates"""
    out: str = "eval/images/compare"
    """folder for the tables (CSV, markdown) and the plot (PNG, PDF)"""


MEASURES = {"win_rate": "gold-judge win rate vs reference", "rm_score": "reward-model score",
            "kl": "KL to SFT (nats, last updates)", "length": "response length (tokens)",
            "seconds_per_update": "seconds per update"}


def read_logged(folder: str) -> list:
    """A run's metrics.jsonl: one dict per log call, in order (read once per run)."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def metric_values(logged: list, key: str) -> list:
    """Every logged value of one metric, in order (null ones, non-finite when logged, left out)."""
    return [m[key] for m in logged if m.get(key) is not None]


def phase_seconds(logged: list) -> dict:
    """{phase: median seconds per update} of every `time/<phase>` an online run logs (the PhaseTimer's
    phases: generation, the reference, reward and value forwards, the training epochs, ...)."""
    phases = sorted({k for m in logged for k in m if k.startswith("time/") and k != "time/update"})
    return {p.removeprefix("time/"): float(np.median([m[p] for m in logged if m.get(p) is not None])) for p in phases}


def phase_table(per_run: pd.DataFrame, phases: dict) -> pd.DataFrame:
    """Per online method (base_model, policy): the mean over its seeds of each run's median seconds per
    phase, and of the whole update; where the time of a critic-free update goes, next to PPO's."""
    rows = []
    for (base_model, policy), frame in per_run.groupby(["base_model", "policy"], sort=False):
        runs = [phases[name] for name in frame["run_name"] if phases.get(name)]
        if not runs:
            continue
        names = sorted({p for run in runs for p in run})
        rows.append({"base_model": base_model, "policy": policy,
                     **{p: float(np.mean([run.get(p, 0.0) for run in runs])) for p in names},
                     "update": float(frame["seconds_per_update"].mean())})
    return pd.DataFrame(rows).fillna(0.0)


def reward_model_of(runs: list) -> dict:
    """{(base_model, seed): reward_model_path} from the runs that name one (the online methods')."""
    found = {}
    for run in runs:
        path = run.config.get("reward_model_path")
        if path and os.path.isdir(path):
            found.setdefault((run.config["base_model"], run.config["seed"]), path)
    return found


def score_table(table: pd.DataFrame, reward_model_path: Optional[str], loaded: dict) -> float:
    """Mean reward-model score of a validation table's summaries (nan without a reward model)."""
    if reward_model_path is None:
        return float("nan")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from summarize_from_feedback_details.hello_world_report import reward_scores

    if reward_model_path not in loaded:
        loaded[reward_model_path] = (AutoModelForSequenceClassification.from_pretrained(reward_model_path).eval(),
                                     AutoTokenizer.from_pretrained(reward_model_path))
    model, tokenizer = loaded[reward_model_path]
    return float(reward_scores(model, tokenizer, list(table["query"]), list(table["postprocessed_response"])).mean())


def run_row(run, logged: list, label: str, reward_model_path: Optional[str], last_updates: int, loaded: dict,
            tokenizers: dict) -> dict:
    table = pd.read_csv(os.path.join(run.folder, "validation_table.csv"), keep_default_na=False)
    rows = list(zip(table["query"].astype(str), table["postprocessed_response"].astype(str),
                    table["reference_responses"].astype(str)))
    kl = metric_values(logged, "objective/kl")[-last_updates:]
    seconds = metric_values(logged, "time/update") if kl else []  # online methods only
    tokenizer = run_tokenizer(run, None, tokenizers)
    win_rate = win_counts(gold_verdicts(rows))["win_rate"]
    ci_low, ci_high = wilson_interval(win_rate, len(rows))
    return {"policy": label, "base_model": run.config["base_model"], "seed": run.config["seed"], "run_name": run.name,
            "rows": len(rows), "win_rate": win_rate, "win_rate_ci_low": ci_low, "win_rate_ci_high": ci_high,
            "rm_score": score_table(table, reward_model_path, loaded),
            "kl": float(np.mean(kl)) if kl else np.nan,
            "length": float(np.mean(response_lengths(list(table["postprocessed_response"].astype(str)), tokenizer))),
            "seconds_per_update": float(np.median(seconds)) if seconds else np.nan, "updates": len(seconds)}


def summarize(per_run: pd.DataFrame, order: list) -> pd.DataFrame:
    """One row per (base_model, policy): per measure the mean over seeds, its 95% t-interval and the
    per-seed values; the win rate minus SFT's of the same seed; seconds per update relative to PPO's."""
    rows = []
    sft = per_run[per_run["policy"] == "SFT"].set_index(["base_model", "seed"])["win_rate"]
    ppo_seconds = per_run[per_run["policy"] == "PPO"].groupby("base_model")["seconds_per_update"].mean()
    for (base_model, policy), frame in per_run.groupby(["base_model", "policy"], sort=False):
        frame = frame.sort_values("seed")
        row = {"base_model": base_model, "policy": policy, "n_seeds": len(frame),
               "seeds": " ".join(map(str, frame["seed"]))}
        for measure in MEASURES:
            values = frame[measure].dropna().to_numpy(dtype=float)
            low, high = t_interval(values)
            row.update({measure: values.mean() if len(values) else np.nan, f"{measure}_ci_low": low,
                        f"{measure}_ci_high": high, f"{measure}_per_seed": " ".join(f"{v:.4g}" for v in values)})
        paired = [w - sft[(base_model, s)] for s, w in zip(frame["seed"], frame["win_rate"]) if (base_model, s) in sft]
        low, high = t_interval(paired)
        row.update({"minus_sft": np.mean(paired) if paired and policy != "SFT" else np.nan,
                    "minus_sft_ci_low": low, "minus_sft_ci_high": high,
                    "vs_sft": "" if policy == "SFT" or not paired else
                    "beats SFT" if low > 0 else "below SFT" if high < 0 else "not resolved",
                    "seconds_vs_ppo": row["seconds_per_update"] / ppo_seconds.get(base_model, np.nan)})
        rows.append(row)
    frame = pd.DataFrame(rows)
    rank = frame["policy"].map(order.index)
    return frame.assign(_rank=rank).sort_values(["base_model", "_rank"], kind="stable").drop(columns="_rank") \
        .reset_index(drop=True)


def readable(summary: pd.DataFrame) -> pd.DataFrame:
    """The table a reader wants: 'mean [low, high]' per measure, the per-seed values, the verdict."""
    def cell(row, measure, digits=3):
        if np.isnan(row[measure]):
            return ""
        if np.isnan(row[f"{measure}_ci_low"]):
            return f"{row[measure]:.{digits}f}"
        return f"{row[measure]:.{digits}f} [{row[f'{measure}_ci_low']:.{digits}f}, {row[f'{measure}_ci_high']:.{digits}f}]"

    return pd.DataFrame([{
        "base model": row["base_model"].rstrip("/").split("/")[-1], "method": row["policy"], "seeds": row["seeds"],
        "gold win rate, mean [95% CI]": cell(row, "win_rate"), "per seed": row["win_rate_per_seed"],
        "minus SFT, paired [95% CI]": cell(row, "minus_sft"), "vs SFT": row["vs_sft"],
        "RM score": cell(row, "rm_score"), "KL": cell(row, "kl", 2), "length": cell(row, "length", 1),
        "s / update": cell(row, "seconds_per_update", 2),
        "x PPO": "" if np.isnan(row["seconds_vs_ppo"]) else f"{row['seconds_vs_ppo']:.2f}",
    } for _, row in summary.iterrows()])


def plot(per_run: pd.DataFrame, summary: pd.DataFrame, colors: dict, out: str) -> None:
    fig, axes = plt.subplots(1, len(MEASURES), figsize=(4 * len(MEASURES), 4.2))
    for ax, (measure, title) in zip(axes, MEASURES.items()):
        shown = summary[summary[measure].notna()]
        for x, (_, row) in enumerate(shown.iterrows()):
            color = colors[row["policy"]]
            low, high = row[f"{measure}_ci_low"], row[f"{measure}_ci_high"]
            yerr = None if np.isnan(low) else [[row[measure] - low], [high - row[measure]]]
            ax.bar(x, row[measure], color=color, alpha=0.35, yerr=yerr, capsize=4)
            seeds = per_run[(per_run["policy"] == row["policy"]) & (per_run["base_model"] == row["base_model"])]
            ax.scatter([x] * len(seeds), seeds[measure], color=color, s=16, zorder=3)
        ax.set_xticks(range(len(shown)), shown["policy"], rotation=45, ha="right")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        if measure == "win_rate":
            ax.axhline(0.5, color="gray", linestyle="--", linewidth=1)
    fig.suptitle("TL;DR validation, embedded default: mean over seeds (bar) with its 95% t-interval, each seed a dot")
    fig.tight_layout()
    save_figure(fig, out, "compare")


def main(args: Args) -> None:
    labels = policy_labels(args)
    found = local_runs(args.runs_dir, list(labels), args.run_glob, args.runs)
    where = args.runs_dir + (f" matching {args.run_glob!r}" if args.run_glob else "")
    runs = use_runs(found, args, where, lambda run: None if run.folder and os.path.isfile(
        os.path.join(run.folder, "validation_table.csv")) else "no validation_table", "compare_table")
    if not runs:
        raise SystemExit(f"no run with a validation table in {where}")
    reward_models, loaded, tokenizers = reward_model_of(runs), {}, {}
    logged = {run.name: read_logged(run.folder) for run in runs}
    per_run = pd.DataFrame([
        run_row(run, logged[run.name], labels[run.config["exp_name"]],
                reward_models.get((run.config["base_model"], run.config["seed"])), args.last_updates, loaded,
                tokenizers) for run in runs])
    order = [label for label in labels.values() if label in set(per_run["policy"])]
    per_run = per_run.assign(_rank=per_run["policy"].map(order.index)).sort_values(
        ["base_model", "_rank", "seed"], kind="stable").drop(columns="_rank").reset_index(drop=True)
    write_table(per_run, args.out, "compare_runs")
    summary = summarize(per_run, order)
    write_table(summary, args.out, "compare_table_full")
    write_table(readable(summary), args.out, "compare_table")
    phases = {name: phase_seconds(lines) for name, lines in logged.items()
              if metric_values(lines, "objective/kl")}  # the online methods
    write_table(phase_table(per_run, phases), args.out, "compare_phases")
    plot(per_run, summary, policy_colors(order), args.out)


if __name__ == "__main__":
    main(tyro.cli(Args))
