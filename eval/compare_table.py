"""The methods side by side at equal episodes (make compare): SFT, PPO, DPO, RLOO, GRPO, online DPO and
the control (PPO against a reward model that knows nothing).

    python eval/compare_table.py --run_glob 'scaling_m_*' --out eval/images/compare

Reads the local runs of every policy (--sft_exp_name, --ppo_exp_name, --dpo_exp_name and --methods,
as eval/rlhf_scaling_plot.py; one run per (exp_name, base_model, seed), chosen as eval/ chooses)
that saved a validation table, and per run measures:
- gold_minus_sft, the headline: the run's mean gold score minus that of the SFT run of the same
  (base_model, seed), the policy it started from, paired per prompt (the same validation prompt's
  two summaries), with its 95% bootstrap interval over prompts; and head_to_head_sft, how often its
  summary beats that SFT's on the same prompt (ties half), with its Wilson interval
  (rlhf_scaling_plot.paired_sft_columns, win_rates.paired_with_sft);
- gold: the mean gold score of its validation summaries (the synthetic task's exact judge, so the
  embedded default only);
- win_rate: the gold judge's win rate of its validation summaries against the references (ties
  count half), with its 95% Wilson interval over prompts;
- rm_score: the mean score of its summaries under the reward model of its (base_model, seed), the
  `reward_model_path` of that seed's PPO run (else of its other online runs; SFT and DPO train
  without one, the control against a reward model that knows nothing), every policy's summaries
  through the same path (evaluation.reward_scores);
- length: mean response length in tokens (EOS not counted); length_minus_sft and
  win_rate_minus_sft: the run's minus its seed's SFT run's;
- kl: the online methods' KL to the SFT policy, `objective/kl` averaged over the last 5 updates
  (nats per response; SFT and DPO log none);
- seconds_per_update: the online methods' median `time/update` (each update the same episodes).
Per method (compare_table): per measure the mean over seeds with its 95% t-interval (t with n - 1
degrees of freedom; no interval from one seed) and the per-seed values; for gold_minus_sft that is
the mean of the per-seed paired differences, and its interval gives the verdict (gold_vs_sft:
`beats SFT` where it lies above 0, `below SFT` where it lies below, `not resolved` otherwise); the
win rate minus SFT's paired by seed with its interval and its own verdict (win_rate_vs_sft); the
length minus SFT's; and the seconds per update relative to PPO's.

Writes to --out: compare_runs.{csv,md}, compare_table.{csv,md} (readable, led by the paired gold
difference and its verdict; compare_table_full: every number), compare_summary.csv (one row per
method but SFT: exactly method, seeds, gold_minus_sft, gold_minus_sft_low, gold_minus_sft_high,
win_rate_minus_sft, length_minus_sft, kl; a leading base_model column when the runs hold more than
one base model), compare_phases.{csv,md} (the online methods' median seconds per update by phase,
mean over seeds), compare_facts.{csv,md} (per method and slot of the post, the share of summaries that
state it right / wrong, mean over seeds), compare.{png,pdf} (one panel per measure: each seed a dot, the mean a bar with its
95% interval), runs_used_compare_table.{csv,md}.
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
from rlhf_scaling_plot import PAIRED_COLUMNS, paired_sft_columns, response_lengths, run_tokenizer

from summarize_from_feedback_details.gold_judge import SCORE_WEIGHTS, gold_score, stated_facts
from summarize_from_feedback_details.win_rates import score_outcomes, scores_by_query, t_interval, wilson_interval


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


# one panel each in compare.png, in this order: the headline first
MEASURES = {"gold_minus_sft": "mean gold minus SFT (paired per prompt)", "gold": "mean gold score",
            "win_rate": "gold-judge win rate vs reference", "rm_score": "reward-model score",
            "kl": "KL to SFT (nats, last updates)", "length": "response length (tokens)",
            "seconds_per_update": "seconds per update"}
# the columns of compare_summary.csv, one row per method but SFT
SUMMARY_COLUMNS = ["method", "seeds", "gold_minus_sft", "gold_minus_sft_low", "gold_minus_sft_high",
                   "win_rate_minus_sft", "length_minus_sft", "kl"]


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


def reward_model_of(runs: list, ppo_exp_name: str) -> dict:
    """{(base_model, seed): reward_model_path} from the runs that name one (the online methods'): the
    PPO run's, else the path most of that seed's runs name (ties: the first in name order). Not simply
    the first found: the control names a reward model that knows nothing, and scoring every summary
    with it would make the RM score column noise."""
    named = {}
    for run in sorted(runs, key=lambda r: r.name):
        path = run.config.get("reward_model_path")
        if path and os.path.isdir(path):
            named.setdefault((run.config["base_model"], run.config["seed"]), []).append((run.config["exp_name"], path))
    found = {}
    for key, paths in named.items():
        ppo = [path for exp_name, path in paths if exp_name == ppo_exp_name]
        counts = pd.Series([path for _, path in paths]).value_counts(sort=False)
        found[key] = ppo[0] if ppo else counts.index[counts.argmax()]
    return found


def score_table(table: pd.DataFrame, reward_model_path: Optional[str], loaded: dict) -> float:
    """Mean reward-model score of a validation table's summaries (nan without a reward model)."""
    if reward_model_path is None:
        return float("nan")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from summarize_from_feedback_details.evaluation import table_reward_scores

    if reward_model_path not in loaded:
        loaded[reward_model_path] = (AutoModelForSequenceClassification.from_pretrained(reward_model_path).eval(),
                                     AutoTokenizer.from_pretrained(reward_model_path))
    model, tokenizer = loaded[reward_model_path]
    return float(table_reward_scores(model, tokenizer, table).mean())


def run_row(run, logged: list, label: str, reward_model_path: Optional[str], last_updates: int, loaded: dict,
            tokenizers: dict) -> tuple:
    """The run's measures (the paired ones are added by paired_sft_columns), and {query: gold score} of
    its summaries for that pairing (or why there is none: a repeated query)."""
    table = pd.read_csv(os.path.join(run.folder, "validation_table.csv"), keep_default_na=False)
    queries = list(table["query"].astype(str))
    # each summary and reference scored once: the win rate is gold_preference's (ties half) from them
    gold = np.array([gold_score(q, r) for q, r in zip(queries, table["postprocessed_response"].astype(str))])
    reference = np.array([gold_score(q, r) for q, r in zip(queries, table["reference_responses"].astype(str))])
    win_rate = float(np.mean(score_outcomes(gold, reference)))
    ci_low, ci_high = wilson_interval(win_rate, len(queries))
    kl = metric_values(logged, "objective/kl")[-last_updates:]
    seconds = metric_values(logged, "time/update") if kl else []  # online methods only
    tokenizer = run_tokenizer(run, None, tokenizers)
    facts = fact_shares(queries, list(table["postprocessed_response"].astype(str)))
    try:
        by_query = scores_by_query(queries, gold, run.name)
    except ValueError as error:
        by_query = str(error)
    return {"policy": label, "base_model": run.config["base_model"], "seed": run.config["seed"], "run_name": run.name,
            "rows": len(queries), "gold": float(gold.mean()), "win_rate": win_rate, "win_rate_ci_low": ci_low,
            "win_rate_ci_high": ci_high, "rm_score": score_table(table, reward_model_path, loaded),
            "kl": float(np.mean(kl)) if kl else np.nan,
            "length": float(np.mean(response_lengths(list(table["postprocessed_response"].astype(str)), tokenizer))),
            "seconds_per_update": float(np.median(seconds)) if seconds else np.nan, "updates": len(seconds),
            **facts}, by_query


def fact_shares(queries: list, summaries: list) -> dict:
    """{<slot>_right, <slot>_wrong}: the share of the summaries that state the slot right / wrong
    (gold_judge.stated_facts): what a method learned, slot by slot."""
    said = [stated_facts(q, r) for q, r in zip(queries, summaries)]
    return {f"{slot}_{kind}": float(np.mean([facts[slot] == kind for facts in said]))
            for slot in SCORE_WEIGHTS for kind in ("right", "wrong")}


def facts_table(per_run: pd.DataFrame) -> pd.DataFrame:
    """compare_facts: per (base_model, policy) in per_run's order, per slot the share of summaries that state it
    right / wrong, mean over seeds ("0.99 / 0.01"): where two methods gain alike, which facts each learned."""
    rows = []
    for (base_model, policy), frame in per_run.groupby(["base_model", "policy"], sort=False):
        rows.append({"base model": base_model.rstrip("/").split("/")[-1], "method": policy,
                     "seeds": " ".join(map(str, frame["seed"])),
                     **{f"{slot} right / wrong": f"{frame[f'{slot}_right'].mean():.2f} / {frame[f'{slot}_wrong'].mean():.2f}"
                        for slot in SCORE_WEIGHTS}})
    return pd.DataFrame(rows)


def minus_sft(per_run: pd.DataFrame, measures: tuple = ("win_rate", "length")) -> pd.DataFrame:
    """`per_run` with <measure>_minus_sft: each run's value minus that of the SFT run of the same
    (base_model, seed) (NaN for SFT runs and runs without one)."""
    sft = per_run[per_run["policy"] == "SFT"].set_index(["base_model", "seed"])
    keys = pd.MultiIndex.from_frame(per_run[["base_model", "seed"]])
    columns = {}
    for measure in measures:
        baseline = sft[measure].reindex(keys).to_numpy(dtype=float)
        columns[f"{measure}_minus_sft"] = np.where(per_run["policy"] == "SFT", np.nan,
                                                   per_run[measure].to_numpy(dtype=float) - baseline)
    return per_run.assign(**columns)


def verdict(low: float, high: float) -> str:
    """Where a 95% interval of a difference to SFT lies: above 0, below 0, or across it (also: none)."""
    return "beats SFT" if low > 0 else "below SFT" if high < 0 else "not resolved"


def summarize(per_run: pd.DataFrame, order: list) -> pd.DataFrame:
    """One row per (base_model, policy): per measure the mean over seeds, its 95% t-interval and the
    per-seed values (for gold_minus_sft: the per-seed paired gold differences, and their verdict
    gold_vs_sft); the win rate and the length minus SFT's of the same seed (the win rate's with its
    interval and verdict); seconds per update relative to PPO's."""
    rows = []
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
        paired = frame["win_rate_minus_sft"].dropna().to_numpy(dtype=float)
        low, high = t_interval(paired)
        lengths = frame["length_minus_sft"].dropna()
        row.update({"gold_vs_sft": "" if policy == "SFT" or np.isnan(row["gold_minus_sft"]) else
                    verdict(row["gold_minus_sft_ci_low"], row["gold_minus_sft_ci_high"]),
                    "win_rate_minus_sft": paired.mean() if len(paired) else np.nan,
                    "win_rate_minus_sft_ci_low": low, "win_rate_minus_sft_ci_high": high,
                    "win_rate_vs_sft": "" if not len(paired) else verdict(low, high),
                    "length_minus_sft": lengths.mean() if len(lengths) else np.nan,
                    "seconds_vs_ppo": row["seconds_per_update"] / ppo_seconds.get(base_model, np.nan)})
        rows.append(row)
    frame = pd.DataFrame(rows)
    rank = frame["policy"].map(order.index)
    return frame.assign(_rank=rank).sort_values(["base_model", "_rank"], kind="stable").drop(columns="_rank") \
        .reset_index(drop=True)


def summary_csv(summary: pd.DataFrame) -> pd.DataFrame:
    """compare_summary.csv: per method but SFT the seeds, the paired gold difference to SFT (mean over
    seeds of the per-seed ones) with its 95% t-interval, the win rate and the length minus SFT's, and
    the KL (empty for DPO); a base_model column leads only when the runs hold several base models."""
    methods = summary[summary["policy"] != "SFT"]
    frame = pd.DataFrame({"base_model": methods["base_model"], "method": methods["policy"],
                          "seeds": methods["n_seeds"], "gold_minus_sft": methods["gold_minus_sft"],
                          "gold_minus_sft_low": methods["gold_minus_sft_ci_low"],
                          "gold_minus_sft_high": methods["gold_minus_sft_ci_high"],
                          "win_rate_minus_sft": methods["win_rate_minus_sft"],
                          "length_minus_sft": methods["length_minus_sft"], "kl": methods["kl"]})
    several = summary["base_model"].nunique() > 1
    return frame[(["base_model"] if several else []) + SUMMARY_COLUMNS].reset_index(drop=True)


def readable(summary: pd.DataFrame) -> pd.DataFrame:
    """The table a reader wants, led by the headline: the paired gold difference to SFT, 'mean [low,
    high]' over seeds, and its verdict; then the mean gold score, the win rate against the reference
    (the paper's number) and the other measures, the per-seed values of the two differences beside them."""
    def cell(row, measure, digits=3, sign=""):
        if np.isnan(row[measure]):
            return ""
        if np.isnan(row[f"{measure}_ci_low"]):
            return f"{row[measure]:{sign}.{digits}f}"
        return (f"{row[measure]:{sign}.{digits}f} [{row[f'{measure}_ci_low']:.{digits}f}, "
                f"{row[f'{measure}_ci_high']:.{digits}f}]")

    return pd.DataFrame([{
        "base model": row["base_model"].rstrip("/").split("/")[-1], "method": row["policy"], "seeds": row["seeds"],
        "gold minus SFT, paired [95% CI]": cell(row, "gold_minus_sft", sign="+"), "vs SFT": row["gold_vs_sft"],
        "per seed": row["gold_minus_sft_per_seed"], "mean gold": cell(row, "gold"),
        "gold win rate vs reference [95% CI]": cell(row, "win_rate"), "win rate per seed": row["win_rate_per_seed"],
        "win rate minus SFT [95% CI]": cell(row, "win_rate_minus_sft", sign="+"),
        "RM score": cell(row, "rm_score"), "KL": cell(row, "kl", 2), "length": cell(row, "length", 1),
        "length minus SFT": "" if np.isnan(row["length_minus_sft"]) else f"{row['length_minus_sft']:+.1f}",
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
        if measure == "gold_minus_sft":  # SFT's level: a bar whose interval crosses it is not resolved
            ax.axhline(0.0, color="gray", linestyle="--", linewidth=1)
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
    reward_models, loaded, tokenizers = reward_model_of(runs, args.ppo_exp_name), {}, {}
    logged = {run.name: read_logged(run.folder) for run in runs}
    measured = [run_row(run, logged[run.name], labels[run.config["exp_name"]],
                        reward_models.get((run.config["base_model"], run.config["seed"])), args.last_updates, loaded,
                        tokenizers) for run in runs]
    per_run = pd.DataFrame([row for row, _ in measured])
    gold = {row["run_name"]: by_query for row, by_query in measured}
    order = [label for label in labels.values() if label in set(per_run["policy"])]
    per_run = per_run.assign(_rank=per_run["policy"].map(order.index)).sort_values(
        ["base_model", "_rank", "seed"], kind="stable").drop(columns="_rank").reset_index(drop=True)
    per_run = minus_sft(paired_sft_columns(per_run, gold))
    # the headline columns after the run's name, as in the tables below
    first = ["policy", "base_model", "seed", "run_name", "rows", *PAIRED_COLUMNS, "gold"]
    per_run = per_run[first + [c for c in per_run.columns if c not in first]]
    write_table(per_run, args.out, "compare_runs")
    summary = summarize(per_run, order)
    write_table(summary, args.out, "compare_table_full")
    write_table(readable(summary), args.out, "compare_table")
    write_table(facts_table(per_run), args.out, "compare_facts")
    summary_csv(summary).to_csv(os.path.join(args.out, "compare_summary.csv"), index=False)
    phases = {name: phase_seconds(lines) for name, lines in logged.items()
              if metric_values(lines, "objective/kl")}  # the online methods
    write_table(phase_table(per_run, phases), args.out, "compare_phases")
    plot(per_run, summary, policy_colors(order), args.out)


if __name__ == "__main__":
    main(tyro.cli(Args))
