"""The results table of a sizes x seeds sweep (scaling.sh, `make scaling`): each metric by model size,
mean over seeds with its 95% t-interval and every seed's value, and whether the mean rises with size.

    python eval/scaling_table.py --plots_dir eval/images/scaling

Reads the tables that eval/sft_rm_scale.py and eval/rlhf_scaling_plot.py wrote into --plots_dir
(rouge_score_plot, rm_scale_plot, rlhf_scale_plot and its per-run rlhf_scale_plot_runs), so its
numbers are the plotted ones. The last two rows pair PPO with the SFT of the same size and seed (PPO
starts from that seed's SFT): its mean gold score minus SFT's, paired per prompt (the embedded
default's headline), and its win rate minus SFT's. Writes scaling_table.{csv,md} there and
prints the table.
"""

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
import tyro
from rich.console import Console
from rich.table import Table

from common import format_size, seed_summary, write_table

# (row label, table that eval/ wrote, column that selects the rows, its value)
METRICS = (
    ("SFT ROUGE-L (validation)", "rouge_score_plot", None, None),
    ("RM accuracy, TL;DR validation", "rm_scale_plot", "split", "validation"),
    ("RM accuracy, OOD (CNN/DM role)", "rm_scale_plot", "split", "validation_cnndm"),
    ("SFT gold-judge win rate", "rlhf_scale_plot", "policy", "SFT"),
    ("PPO gold-judge win rate", "rlhf_scale_plot", "policy", "PPO"),
)
PPO_GAIN = "PPO minus SFT win rate (same seed)"
PPO_GOLD_GAIN = "PPO minus SFT, mean gold (paired per prompt, same seed)"
GAINS = (PPO_GOLD_GAIN, PPO_GAIN)


@dataclass
class Args:
    plots_dir: str = "eval/images/scaling"
    """where eval/sft_rm_scale.py and eval/rlhf_scaling_plot.py wrote their tables; receives
    scaling_table.{csv,md}"""


def read_table(plots_dir: str, name: str) -> pd.DataFrame:
    path = os.path.join(plots_dir, f"{name}.csv")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: run eval/sft_rm_scale.py and eval/rlhf_scaling_plot.py "
                                f"with --out {plots_dir} first")
    return pd.read_csv(path, keep_default_na=False, na_values=[""], dtype={"seeds": str, "values": str})


def ppo_gain(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (base_model, seed) with both policies: PPO's win rate minus SFT's, summarised over seeds."""
    wide = runs.pivot_table(index=["base_model", "model_size", "seed"], columns="policy", values="win_rate")
    if not {"SFT", "PPO"} <= set(wide.columns):
        return pd.DataFrame()
    per_seed = (wide["PPO"] - wide["SFT"]).dropna().rename("value").reset_index()
    return seed_summary(per_seed, ["base_model", "model_size"]) if len(per_seed) else pd.DataFrame()


def ppo_gold_gain(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (base_model, seed): PPO's mean gold score minus that of the SFT it started from, paired per
    prompt (rlhf_scaling_plot's gold_minus_sft; the embedded default's headline), summarised over seeds."""
    if "gold_minus_sft" not in runs.columns:
        return pd.DataFrame()
    per_seed = runs[runs["policy"] == "PPO"].dropna(subset=["gold_minus_sft"])
    per_seed = per_seed[["base_model", "model_size", "seed", "gold_minus_sft"]].rename(columns={"gold_minus_sft": "value"})
    return seed_summary(per_seed, ["base_model", "model_size"]) if len(per_seed) else pd.DataFrame()


def long_table(plots_dir: str) -> pd.DataFrame:
    """One row per (metric, model size): seeds, their values, mean and std."""
    frames = []
    for label, name, column, value in METRICS:
        table = read_table(plots_dir, name)
        if column is not None:
            table = table[table[column] == value]
        frames.append(table.assign(metric=label))
    runs = read_table(plots_dir, "rlhf_scale_plot_runs")
    for metric, gain in ((PPO_GOLD_GAIN, ppo_gold_gain(runs)), (PPO_GAIN, ppo_gain(runs))):
        if len(gain):
            frames.append(gain.assign(metric=metric))
    columns = ["metric", "base_model", "model_size", "n_seeds", "seeds", "values", "mean", "std", "ci_low", "ci_high"]
    return pd.concat([f[columns] for f in frames], ignore_index=True)


def rises(means: list) -> bool:
    """Strictly increasing from the smallest size to the largest (at least two sizes)."""
    return len(means) > 1 and all(b > a for a, b in zip(means, means[1:]))


def cell(row) -> str:
    """'mean [95% t-interval] (each seed's value)'; a single seed has no interval."""
    values = ", ".join(f"{float(v):.3f}" for v in str(row["values"]).split())
    spread = "" if np.isnan(row["ci_low"]) else f" [{row['ci_low']:.3f}, {row['ci_high']:.3f}]"
    return f"{row['mean']:.3f}{spread} ({values})"


def results_table(long: pd.DataFrame) -> pd.DataFrame:
    """Metrics as rows, sizes as columns (smallest first), and whether each metric's mean rises with
    size (the gain row: the sizes where PPO's mean beats SFT's)."""
    sizes = long.drop_duplicates("base_model").sort_values("model_size")
    header = {b: f"{format_size(s)} ({os.path.basename(b.rstrip('/'))})"
              for b, s in zip(sizes["base_model"], sizes["model_size"])}
    rows = []
    for metric in [m[0] for m in METRICS] + list(GAINS):
        frame = long[long["metric"] == metric].sort_values("model_size")
        if not len(frame):
            continue
        row = {"metric": metric, **{header[b]: "" for b in header}}
        row.update({header[b]: cell(r) for b, (_, r) in zip(frame["base_model"], frame.iterrows())})
        if metric in GAINS:
            ahead = [os.path.basename(b.rstrip("/")) for b, m in zip(frame["base_model"], frame["mean"]) if m > 0]
            row["check"] = f"PPO ahead at {', '.join(ahead)}" if ahead else "PPO ahead at no size"
            if metric == PPO_GOLD_GAIN and len(frame) == len(header) and rises(list(frame["mean"])):
                row["check"] += "; the gain grows with size"
        else:
            complete = len(frame) == len(header)
            row["check"] = "rises with size" if complete and rises(list(frame["mean"])) else "does not rise"
        rows.append(row)
    return pd.DataFrame(rows)


def main(args: Args) -> None:
    table = results_table(long_table(args.plots_dir))
    write_table(table, args.plots_dir, "scaling_table")
    shown = Table(title=f"scaling sweep: mean [95% t-interval] over seeds (each seed) - {args.plots_dir}/scaling_table.md")
    for column in table.columns:
        shown.add_column(column, overflow="fold")
    for row in table.itertuples(index=False):
        shown.add_row(*map(str, row))
    Console(width=200).print(shown)


if __name__ == "__main__":
    main(tyro.cli(Args))
