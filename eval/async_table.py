"""The staleness study of asynchronous RLHF (make async, async.sh): how much gold each online method
keeps when its rollouts are N updates old.

    python eval/async_table.py --run_glob 'async_n*' --sft_run hello_world_sft --out eval/images/async

Reads every local run matching --run_glob of PPO, RLOO (k=2), GRPO (k=4) and online DPO (by exp_name)
that saved a validation table, all started from one SFT policy (--sft_run, the run whose validation
table they are paired with), and per run measures (compare_table.run_row): the mean gold score of
its validation summaries minus the SFT run's, paired per prompt (win_rates.paired_with_sft); the
KL to SFT (`objective/kl`, mean of the last --last_updates updates); the response length minus SFT's;
and wall_s, the seconds its updates took (the sum of `time/update`). Per (method, async_steps): the
mean over seeds of each, with the 95% t-interval over seeds of the gold difference.

Writes to --out: async_runs.{csv,md} (one row per run), async_summary.{csv,md} (method, async_steps,
seeds, gold_minus_sft, gold_minus_sft_low, gold_minus_sft_high, kl, length_minus_sft, wall_s),
async_gold_vs_staleness.{png,pdf} (gold minus SFT against N, a line per method, each seed a dot)
and async_gold_vs_kl.{png,pdf} (gold minus SFT against the KL, a colour per N, a marker per method).
"""

import fnmatch
import json
import os
from dataclasses import dataclass
from typing import Optional

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import tyro

from common import Run, save_figure, write_table
from compare_table import metric_values, read_logged, run_row

from summarize_from_feedback_details.methods import METHODS as REGISTRY
from summarize_from_feedback_details.win_rates import paired_with_sft, t_interval


@dataclass
class Args:
    runs_dir: str = "runs"
    """local run folders (runs/<run_name>/ with args.json, metrics.jsonl and validation_table.csv)"""
    run_glob: str = "async_n*"
    """the study's runs: those whose name matches this shell pattern"""
    sft_run: str = "hello_world_sft"
    """the SFT run every policy of the study started from: its validation table is the baseline"""
    last_updates: int = 5
    """the KL column averages `objective/kl` over this many last updates"""
    out: str = "eval/images/async"
    """folder for the tables (CSV, markdown) and the plots (PNG, PDF)"""


# the study's methods by exp_name, in table order
METHODS = {m.exp_name: m.label for m in REGISTRY if m.name in ("ppo", "rloo", "grpo", "online_dpo")}  # (async.sh's)
SUMMARY_COLUMNS = ["method", "async_steps", "seeds", "gold_minus_sft", "gold_minus_sft_low", "gold_minus_sft_high",
                   "kl", "length_minus_sft", "wall_s"]


def local_run(folder: str) -> Optional[Run]:
    """The run of a folder with args.json and validation_table.csv, else None."""
    if not all(os.path.isfile(os.path.join(folder, f)) for f in ("args.json", "validation_table.csv")):
        return None
    with open(os.path.join(folder, "args.json")) as f:
        config = json.load(f)
    return Run(os.path.basename(folder), config, os.path.getmtime(folder), folder=folder)


def study_runs(args: Args) -> list:
    """The runs of the study's methods among those --run_glob matches, by name."""
    names = sorted(n for n in os.listdir(args.runs_dir) if fnmatch.fnmatch(n, args.run_glob))
    runs = [local_run(os.path.join(args.runs_dir, n)) for n in names]
    return [r for r in runs if r is not None and r.config.get("exp_name") in METHODS]


def per_run_table(args: Args) -> pd.DataFrame:
    """One row per run: method, async_steps, seed, run_name, gold, gold_minus_sft (paired per prompt
    with the SFT run's table), kl, length, length_minus_sft, wall_s."""
    sft = local_run(os.path.join(args.runs_dir, args.sft_run))
    if sft is None:
        raise FileNotFoundError(f"{args.runs_dir}/{args.sft_run}: no SFT run with args.json and validation_table.csv")
    loaded, tokenizers = {}, {}
    sft_row, sft_scores = run_row(sft, [], "SFT", None, args.last_updates, loaded, tokenizers)
    rows = []
    for run in study_runs(args):
        logged = read_logged(run.folder)
        row, scores = run_row(run, logged, METHODS[run.config["exp_name"]], None, args.last_updates, loaded,
                              tokenizers)
        paired = paired_with_sft(scores, sft_scores)
        rows.append({"method": row["policy"], "async_steps": int(run.config.get("async_steps", 0)),
                     "seed": row["seed"], "run_name": run.name, "gold": row["gold"],
                     "gold_minus_sft": paired["difference"], "kl": row["kl"], "length": row["length"],
                     "length_minus_sft": row["length"] - sft_row["length"],
                     "wall_s": float(np.sum(metric_values(logged, "time/update")))})
    if not rows:
        raise FileNotFoundError(f"no run of {', '.join(METHODS)} matches {args.run_glob!r} in {args.runs_dir}")
    return pd.DataFrame(rows)


def by_method_and_steps(per_run: pd.DataFrame) -> list:
    """((method, async_steps), rows) of `per_run`, methods in METHODS' order and N rising."""
    order = list(METHODS.values())
    return sorted(per_run.groupby(["method", "async_steps"]), key=lambda item: (order.index(item[0][0]), item[0][1]))


def summarize(per_run: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, async_steps), methods in METHODS' order and N rising: the mean over seeds
    of each measure, the 95% t-interval over seeds of the gold difference (nan from one seed)."""
    rows = []
    for (method, steps), frame in by_method_and_steps(per_run):
        low, high = t_interval(frame["gold_minus_sft"])
        rows.append({"method": method, "async_steps": steps, "seeds": len(frame),
                     "gold_minus_sft": frame["gold_minus_sft"].mean(), "gold_minus_sft_low": low,
                     "gold_minus_sft_high": high, "kl": frame["kl"].mean(),
                     "length_minus_sft": frame["length_minus_sft"].mean(), "wall_s": frame["wall_s"].mean()})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def plot(per_run: pd.DataFrame, summary: pd.DataFrame, out: str) -> None:
    steps = sorted(summary["async_steps"].unique())
    position = {n: i for i, n in enumerate(steps)}  # N on an even axis (0 1 2 4 8)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    methods = summary["method"].nunique()
    for i, (method, frame) in enumerate(summary.groupby("method", sort=False)):
        shift = (i - (methods - 1) / 2) * 0.06  # (the methods side by side at each N)
        x = frame["async_steps"].map(position) + shift
        ax.errorbar(x, frame["gold_minus_sft"], yerr=[frame["gold_minus_sft"] - frame["gold_minus_sft_low"],
                                                        frame["gold_minus_sft_high"] - frame["gold_minus_sft"]],
                    marker="o", capsize=3, label=method, color=f"C{i}")
        seeds = per_run[per_run["method"] == method]
        ax.scatter(seeds["async_steps"].map(position) + shift, seeds["gold_minus_sft"], s=8, color=f"C{i}", alpha=0.4)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xticks(range(len(steps)), [str(n) for n in steps])
    ax.set_xlabel("--async_steps N (the rollouts' age in updates)")
    ax.set_ylabel("gold minus SFT (paired per prompt)")
    ax.set_title("gold kept under stale rollouts (mean over seeds, 95% t-interval)")
    ax.legend()
    save_figure(fig, out, "async_gold_vs_staleness")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = dict(zip(METHODS.values(), "osD^"))
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, len(steps)))
    for row in summary.itertuples():
        ax.scatter(row.kl, row.gold_minus_sft, marker=markers[row.method], color=colors[position[row.async_steps]],
                   s=40)
    for method, marker in markers.items():
        ax.scatter([], [], marker=marker, color="gray", label=method)
    for n in steps:
        ax.scatter([], [], marker="s", color=colors[position[n]], label=f"N = {n}")
    ax.set_xlabel("KL to SFT (nats per response, last updates)")
    ax.set_ylabel("gold minus SFT (paired per prompt)")
    ax.set_title("gold against KL, by staleness (means over seeds)")
    ax.legend(fontsize=8, ncol=2)
    save_figure(fig, out, "async_gold_vs_kl")


def main(args: Args) -> None:
    per_run = per_run_table(args)
    summary = summarize(per_run)
    os.makedirs(args.out, exist_ok=True)
    write_table(per_run, args.out, "async_runs")
    write_table(summary, args.out, "async_summary")
    plot(per_run, summary, args.out)
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    main(tyro.cli(Args))
