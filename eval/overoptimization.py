"""Over-optimisation: the reward model's score (proxy) and the gold judge's (truth) against the KL to the
SFT policy, update by update (Gao et al. 2022), and how early the usual warning signals fire.

    python eval/overoptimization.py --run_glob 'overopt_*' --out eval/images/overoptimization \
        --warn kl=3 entropy=3 length_change=0.3

Reads the local runs of the online stages (ppo_left_padding.py, rloo.py, online_dpo.py) that logged the
gold judge per update (`eval/gold/score`: synthetic data only) beside `objective/validation_score` (the
reward model on the same validation responses, sampled at the eval temperature), `objective/scores` (the
reward model on the update's rollouts, the proxy the method optimises: sampled at the training
temperature, after any missing-EOS penalty) and `objective/kl`. Per-update validation batches are
small, so both curves are smoothed by a centred moving average (--smooth updates) before the gold peak
is read; the raw points are drawn too.

Writes to --out:
- overoptimization.{png,pdf}: per run, both proxies and the gold score against KL (two y axes), the
  gold peak and its KL marked;
- overoptimization.{csv,md}: per run the update and KL of the gold peak, gold and both proxies there
  and at the end (smoothed);
- warnings.{csv,md}: per run and --warn signal (infra.tracking.WARNING_SIGNALS, the stages' own rule), the
  update at which it would have fired and how many updates before the gold peak (negative: after).
"""

import fnmatch
import json
import os
from dataclasses import dataclass, field
from typing import Optional

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import tyro

from common import save_figure, write_table

from summarize_from_feedback_details.infra.tracking import WARNING_SIGNALS, first_warning, parse_warnings

CURVES = ("objective/kl", "objective/validation_score", "objective/scores", "eval/gold/score")


@dataclass
class Args:
    runs_dir: str = "runs"
    """local run folders (runs/<run_name>/ with args.json and metrics.jsonl)"""
    run_glob: Optional[str] = None
    """only runs whose name matches this shell pattern"""
    smooth: int = 9
    """updates in the centred moving average of the curves (1: none)"""
    warn: list[str] = field(default_factory=lambda: ["kl=3", "entropy=3", "length_change=0.3"])
    """the signals to time against the gold peak, NAME=THRESHOLD as the stages' --warn"""
    out: str = "eval/images/overoptimization"
    """folder for the plot (PNG, PDF) and the tables (CSV, markdown)"""


def read_history(folder: str) -> pd.DataFrame:
    """One row per update that logged the gold judge: step and every metric this script reads."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [m for m in map(json.loads, f) if m.get("eval/gold/score") is not None]
    keys = CURVES + tuple(metric for metric, _ in WARNING_SIGNALS.values())
    return pd.DataFrame([{"step": m["step"], **{k: m.get(k) for k in keys}} for m in rows]).astype(float)


def smoothed(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average; the ends average over the part of the window that exists."""
    if window <= 1:
        return values
    kernel = np.ones(window)
    return np.convolve(values, kernel, "same") / np.convolve(np.ones_like(values), kernel, "same")


def peak_summary(history: pd.DataFrame, window: int) -> dict:
    """The gold peak of the smoothed gold curve: its update, the KL there (smoothed), gold and both
    proxies (proxy: the validation responses'; rollout_proxy: the rollouts') there and at the last update."""
    gold, proxy, rollout_proxy, kl = (smoothed(history[key].to_numpy(), window) for key in (
        "eval/gold/score", "objective/validation_score", "objective/scores", "objective/kl"))
    peak = int(np.argmax(gold))
    return {"updates": len(history), "peak_update": int(history["step"].iloc[peak]), "kl_at_peak": kl[peak],
            "gold_at_peak": gold[peak], "proxy_at_peak": proxy[peak], "rollout_proxy_at_peak": rollout_proxy[peak],
            "kl_at_end": kl[-1], "gold_at_end": gold[-1], "proxy_at_end": proxy[-1],
            "rollout_proxy_at_end": rollout_proxy[-1], "gold_drop": gold[peak] - gold[-1],
            "proxy_rise_after_peak": proxy[-1] - proxy[peak],
            "rollout_proxy_rise_after_peak": rollout_proxy[-1] - rollout_proxy[peak]}


def warning_rows(name: str, history: pd.DataFrame, thresholds: dict, peak_update: int) -> list:
    rows = []
    for signal, threshold in thresholds.items():
        metric = WARNING_SIGNALS[signal][0]
        values = history[metric].dropna()
        fired = first_warning(list(values), signal, threshold)
        update = None if fired is None else int(history.loc[values.index[fired], "step"])
        rows.append({"run": name, "signal": f"{signal}={threshold:g}", "metric": metric, "fired_at_update": update,
                     "gold_peak_update": peak_update,
                     "updates_before_peak": None if update is None else peak_update - update})
    return rows


def main(args: Args) -> None:
    thresholds = parse_warnings(args.warn)
    runs = {}  # every run (in name order) whose metrics.jsonl has the gold judge per update
    for name in sorted(os.listdir(args.runs_dir)):
        folder = os.path.join(args.runs_dir, name)
        if (args.run_glob is None or fnmatch.fnmatch(name, args.run_glob)) and os.path.isfile(
                os.path.join(folder, "metrics.jsonl")):
            history = read_history(folder)
            if len(history):
                runs[name] = history
    if not runs:
        raise SystemExit(f"no online run with eval/gold/score in {args.runs_dir} (the gold judge exists only on the "
                         "synthetic data)")
    summary = pd.DataFrame([{"run": name, **peak_summary(history, args.smooth)} for name, history in runs.items()])
    write_table(summary, args.out, "overoptimization")
    warnings = pd.DataFrame([row for name, history in runs.items() for row in warning_rows(
        name, history, thresholds, int(summary.set_index("run").loc[name, "peak_update"]))])
    for column in ("fired_at_update", "updates_before_peak"):  # whole updates; empty: never fired
        warnings[column] = warnings[column].map(lambda v: "" if pd.isna(v) else int(v))
    write_table(warnings, args.out, "warnings")

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4.2), squeeze=False)
    for ax, (name, history) in zip(axes[0], runs.items()):
        kl = smoothed(history["objective/kl"].to_numpy(), args.smooth)
        proxy_ax = ax.twinx()
        ax.scatter(history["objective/kl"], history["eval/gold/score"], s=8, color="tab:green", alpha=0.3)
        ax.plot(kl, smoothed(history["eval/gold/score"].to_numpy(), args.smooth), color="tab:green",
                label="gold judge (truth)")
        proxy_ax.scatter(history["objective/kl"], history["objective/validation_score"], s=8, color="tab:purple",
                         alpha=0.3)
        proxy_ax.plot(kl, smoothed(history["objective/validation_score"].to_numpy(), args.smooth), color="tab:purple",
                      label="reward model (proxy), validation responses")
        proxy_ax.plot(kl, smoothed(history["objective/scores"].to_numpy(), args.smooth), color="tab:purple",
                      linestyle=":", label="reward model (proxy), the rollouts it optimises")
        row = summary.set_index("run").loc[name]
        ax.axvline(row["kl_at_peak"], color="gray", linestyle="--", linewidth=1,
                   label=f"gold peak: update {int(row['peak_update'])}, KL {row['kl_at_peak']:.2f}")
        ax.set_xlabel("KL to the SFT policy (nats per response)")
        ax.set_ylabel("gold score of validation responses", color="tab:green")
        proxy_ax.set_ylabel("reward-model score", color="tab:purple")
        ax.set_title(name, fontsize=9)
        lines = ax.get_legend_handles_labels()[0] + proxy_ax.get_legend_handles_labels()[0]
        ax.legend(lines, [line.get_label() for line in lines], loc="lower center", fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"over-optimisation: proxy and gold against KL (moving average of {args.smooth} updates; dots: "
                 "each update)")
    fig.tight_layout()
    save_figure(fig, args.out, "overoptimization")


if __name__ == "__main__":
    main(tyro.cli(Args))
