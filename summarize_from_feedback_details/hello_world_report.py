"""The summary table that ends `./hello_world.sh`: what each stage reached, and where things are.

    python -m summarize_from_feedback_details.hello_world_report --runs_dir runs

Reads the run folders the stages wrote (`runs/hello_world_<stage>/`), judges the reward model's
eval tables and the policies' validation tables with the synthetic task's gold judge (embedded
default only; real data needs the chat judge of eval/rlhf_scaling_plot.py), and scores the SFT,
PPO and DPO summaries (and those of RLOO, GRPO, online DPO and the PPO control with ALGOS=all) with
the same reward model. On the embedded default it also probes which facts the reward model checks:
per slot (relation, problem, ask, duration, feeling, and the duration's unit beside its number), how
often it prefers a validation reference to the same reference with that one fact swapped for a wrong one
(`fact_swap_accuracy`). Per policy, in this order:
- the headline (DESIGN.md section 6), every policy but SFT: its mean gold score minus SFT's, paired
  per prompt (the same validation prompt's two summaries; win_rates.paired_comparison), with its 95%
  bootstrap interval over prompts, and its head-to-head rate against SFT (gold judge, ties half) with
  its Wilson interval;
- its mean gold score; its gold-judge win rate against the reference summaries (the paper's number)
  and the length-controlled one; its mean reward-model score and response length; its KL to SFT.
A stage that has not run yet is left out, and so are the gold rows with --no_gold_judge (real data).
The same numbers, with their intervals, the RM and DPO accuracies and the number of prompts, are
written as JSON beside the plots: <plots_dir>/hello_world_report.json.
"""

import json
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
import tyro
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as transformers_logging

from summarize_from_feedback_details import win_rates
from summarize_from_feedback_details.evaluation import (fact_probe_pairs, reward_scorer, swap_preferences,
                                                        table_reward_scores)
from summarize_from_feedback_details.infra.tracking import last_metrics, metric_history
from summarize_from_feedback_details.methods import METHODS
from summarize_from_feedback_details.gold_judge import gold_preference, gold_score, reward_gold_agreement


# (label, run folder suffix) of the policies after SFT, as hello_world.sh names their runs (ALGOS): the registry's
# rows (methods.tsv); the control is PPO against a reward model that knows nothing: it must not beat SFT
DPO_AND_ONLINE_METHODS = tuple((method.label, method.run) for method in METHODS)
JSON_NAME = "hello_world_report.json"
# the fact-swap rows' names where the slot's key does not say it
SLOT_NAMES = {"duration": "duration number", "duration_unit": "duration unit"}


@dataclass
class Args:
    runs_dir: str = "runs"
    prefix: str = "hello_world_"
    """run folders are `<runs_dir>/<prefix><stage>`"""
    models_dir: str = "models/hello_world"
    """holds the stages' models; its `reward_model` scores the SFT, PPO and DPO summaries (the same
    model for all)"""
    plots_dir: str = "eval/images/hello_world"
    """where hello_world.sh had eval/ write its plots"""
    gold_judge: bool = True
    """judge with the synthetic task's gold judge (only meaningful on the embedded default)"""


def fact_swap_accuracy(reward_model, tokenizer, table: pd.DataFrame, references: int = 1000) -> dict:
    """Per slot of the synthetic task: how often the reward model prefers a validation reference (the
    first `references` of SFT's validation table) to the same reference with that one fact made wrong
    (fact_probe_pairs: the duration's number moved, and apart from it its unit swapped), with the mean score
    margin (swap_preferences). A reward model blind to a slot sits near 0.5 on it, and a policy trained
    against it is free to get that fact wrong (docs/real_pipeline.md, "The duration's unit")."""
    return swap_preferences(reward_scorer(reward_model, tokenizer), *fact_probe_pairs(table, references))


def policy_summary(table: pd.DataFrame, reward_model, tokenizer) -> dict:
    """Gold-judge win rate against the reference summaries (ties count half) with its 95% Wilson
    interval over prompts, the length-controlled win rate (win_rates.py: at zero length difference to
    the reference) with its 95% bootstrap interval, mean reward-model score, and mean response length
    in tokens (EOS not counted) of a policy's validation table."""
    queries, responses = list(table["query"]), list(table["postprocessed_response"])
    wins = [gold_preference(q, r, ref) for q, r, ref in zip(queries, responses, table["reference_responses"])]
    lengths = np.array([len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in responses], dtype=float)
    difference = lengths - [len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in table["reference_responses"]]
    return {
        "win_rate": float(np.mean(wins)),
        "ci": win_rates.wilson_interval(float(np.mean(wins)), len(wins)),
        "lc_win_rate": win_rates.length_controlled_win_rate(wins, difference),
        "lc_ci": win_rates.length_controlled_interval(wins, difference),
        "rm_score": float(table_reward_scores(reward_model, tokenizer, table).mean()),
        "length": float(lengths.mean()),
        "rows": len(table),
    }


def with_interval(value: float, interval: tuple, sign: str = "") -> str:
    """'0.178 [0.140, 0.221]': a rate (or mean) and its 95% interval; sign='+' for a difference."""
    return f"{value:{sign}.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"


def estimate(value: float, interval: tuple, **more) -> dict:
    """A number with its interval, as the JSON holds it (NaN as null: JSON has no NaN)."""
    finite = lambda x: float(x) if np.isfinite(x) else None  # noqa: E731
    return {"value": finite(value), "low": finite(interval[0]), "high": finite(interval[1]), **more}


def gold_numbers(table: pd.DataFrame, name: str) -> tuple:
    """The gold judge on a validation table, scoring each summary once: ({"gold_score": mean with its
    bootstrap interval over prompts, "win_rate": against the reference summaries (ties half) with its
    Wilson interval}, {query: gold score} for the pairing with SFT, or why there is none: a query that
    repeats)."""
    queries = list(table["query"])
    scores = np.array([gold_score(q, r) for q, r in zip(queries, table["postprocessed_response"])])
    references = np.array([gold_score(q, r) for q, r in zip(queries, table["reference_responses"])])
    wins = win_rates.score_outcomes(scores, references)  # = gold_preference
    numbers = {"gold_score": estimate(scores.mean(), win_rates.bootstrap_interval(scores)),
               "win_rate": estimate(wins.mean(), win_rates.wilson_interval(float(wins.mean()), len(wins)))}
    try:
        return numbers, win_rates.scores_by_query(queries, scores, f"{name}'s validation table")
    except ValueError as error:  # reported on the paired row; the policy's own numbers stand
        return numbers, str(error)


def headline_vs_sft(scores, sft_scores) -> dict:
    """The headline numbers of a policy against SFT (win_rates.paired_with_sft of their gold_numbers'
    {query: score}), or why there are none (the tables' prompts differ, or one repeats a query)."""
    try:
        paired = win_rates.paired_with_sft(scores, sft_scores)
    except ValueError as error:
        return {"not_paired": str(error)}
    return {"gold_minus_sft": estimate(paired["difference"], paired["difference_ci"], prompts=paired["prompts"]),
            "head_to_head_vs_sft": estimate(paired["head_to_head"], paired["head_to_head_ci"])}


def gather(args: Args) -> dict:
    """Every number of the report, for the table (sections) and the JSON file: the SFT ROUGE-L, the
    reward model's and DPO's pair accuracies, and per policy that has run (SFT first) its numbers with
    their intervals (see the module docstring); keys are absent where a stage has not run."""
    numbers = {"accuracy": {}, "policies": {}}
    sft = os.path.join(args.runs_dir, f"{args.prefix}sft")
    if os.path.isdir(sft):
        numbers["sft_rouge_l"] = last_metrics(sft)["validation/sft/rouge/rougeL"]
    # the reward model's accuracy, and DPO's with its implicit reward (same tables, same judge)
    for what, stage in (("reward_model", "reward"), ("dpo_implicit_reward", "dpo")):
        folder = os.path.join(args.runs_dir, f"{args.prefix}{stage}")
        if not os.path.isfile(os.path.join(folder, "eval_validation_table.csv")):
            continue
        metrics = last_metrics(folder)
        for split in ("validation", "validation_cnndm"):
            table = pd.read_csv(os.path.join(folder, f"eval_{split}_table.csv"), keep_default_na=False)
            entry = {"accuracy": metrics[f"eval/rm/{split}/accuracy"], "pairs": len(table)}
            if args.gold_judge:
                entry["gold_agreement"] = reward_gold_agreement(table["query"], table["chosen"], table["rejected"],
                                                                table["chosen_rewards"], table["rejected_rewards"])
            numbers["accuracy"].setdefault(what, {})[split] = entry
    tables = {name: os.path.join(args.runs_dir, f"{args.prefix}{stage}", "validation_table.csv")
              for name, stage in (("SFT", "sft"), *DPO_AND_ONLINE_METHODS)}
    tables = {name: pd.read_csv(path, keep_default_na=False) for name, path in tables.items() if os.path.exists(path)}
    reward_model_dir = os.path.join(args.models_dir, "reward_model")
    reward_model = tokenizer = None
    if tables and os.path.isdir(reward_model_dir):
        reward_model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
        tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    if args.gold_judge and reward_model is not None and "SFT" in tables:
        numbers["fact_swaps"] = fact_swap_accuracy(reward_model, tokenizer, tables["SFT"])
    sft_scores = None
    for name, table in tables.items():
        policy = numbers["policies"][name] = {"prompts": len(table)}
        if args.gold_judge:
            gold, scores = gold_numbers(table, name)
            if name == "SFT":
                sft_scores = scores
            elif sft_scores is not None:  # the headline first: its keys lead the policy's dict
                policy.update(headline_vs_sft(scores, sft_scores))
            policy.update(gold)
        if reward_model is not None:
            summary = policy_summary(table, reward_model, tokenizer)
            if args.gold_judge:
                policy["lc_win_rate"] = estimate(summary["lc_win_rate"], summary["lc_ci"])
            policy.update(rm_score=summary["rm_score"], length=summary["length"])
    for name, stage in DPO_AND_ONLINE_METHODS:
        folder = os.path.join(args.runs_dir, f"{args.prefix}{stage}")
        if not os.path.isfile(os.path.join(folder, "metrics.jsonl")):
            continue
        kl = metric_history(folder, "objective/kl")[-5:]
        if kl:
            numbers["policies"].setdefault(name, {})["kl"] = float(np.mean(kl))
        explained = metric_history(folder, "ppo/val/explained_variance")  # PPO's critic
        if explained:
            numbers["policies"].setdefault(name, {})["critic_explained_variance"] = [explained[0], explained[-1]]
    if os.path.isdir(args.models_dir):
        numbers["models"] = sorted(name for name in os.listdir(args.models_dir)
                                   if os.path.isdir(os.path.join(args.models_dir, name)))
    if os.path.isdir(args.plots_dir):
        numbers["plots"] = len([name for name in os.listdir(args.plots_dir) if name.endswith(".png")])
    return numbers


ACCURACY_ROWS = (("reward_model", "RM"), ("dpo_implicit_reward", "DPO implicit-reward"))
SPLIT_NAMES = {"validation": "TL;DR validation", "validation_cnndm": "OOD (CNN/DM role)"}


def shown(entry: dict, sign: str = "") -> str:
    """An estimate (see `estimate`) as the table shows it: '0.178 [0.140, 0.221]'."""
    value, low, high = (np.nan if entry[key] is None else entry[key] for key in ("value", "low", "high"))
    return with_interval(value, (low, high), sign)


def policy_rows(name: str, policy: dict) -> list:
    """A policy's rows, the paired difference to SFT first (the headline), then what the paper reports."""
    rows = []
    if "gold_minus_sft" in policy:
        rows.append((f"{name} minus SFT, mean gold (paired, {policy['gold_minus_sft']['prompts']} prompts)",
                     shown(policy["gold_minus_sft"], sign="+")))
        rows.append((f"{name} head-to-head vs SFT", shown(policy["head_to_head_vs_sft"])))
    if "not_paired" in policy:
        rows.append((f"{name} minus SFT, mean gold (paired)", f"not paired: {policy['not_paired']}"))
    if "gold_score" in policy:
        rows.append((f"{name} mean gold score", shown(policy["gold_score"])))
        rows.append((f"{name} gold-judge win rate vs reference ({policy['prompts']} prompts)", shown(policy["win_rate"])))
    if "lc_win_rate" in policy:
        rows.append((f"{name} length-controlled gold win rate", shown(policy["lc_win_rate"])))
    if "rm_score" in policy:
        rows.append((f"{name} mean reward-model score", f"{policy['rm_score']:.3f}"))
        rows.append((f"{name} mean response length (tokens)", f"{policy['length']:.1f}"))
    if "kl" in policy:
        rows.append((f"{name} KL to the SFT policy (nats per response, last 5 updates)", f"{policy['kl']:.2f}"))
    if "critic_explained_variance" in policy:
        first, last = policy["critic_explained_variance"]
        rows.append((f"{name} critic explained variance, first / last update", f"{first:+.2f} / {last:+.2f}"))
    return rows


def sections(numbers: dict, args: Args) -> list:
    """The table's rows in sections (a rule between them): the stages' own numbers, one section per
    policy, then where things are."""
    stages = []
    if "sft_rouge_l" in numbers:
        stages.append(("SFT ROUGE-L (validation)", f"{numbers['sft_rouge_l']:.3f}"))
    for key, what in ACCURACY_ROWS:
        for split, entry in numbers["accuracy"].get(key, {}).items():
            stages.append((f"{what} accuracy, {SPLIT_NAMES[split]}", f"{entry['accuracy']:.3f} ({entry['pairs']} pairs)"))
            if "gold_agreement" in entry:
                stages.append((f"{what} agreement with the gold judge, {SPLIT_NAMES[split]}",
                               f"{entry['gold_agreement']:.3f}"))
    for slot, entry in numbers.get("fact_swaps", {}).items():
        stages.append((f"RM fact-swap accuracy, {SLOT_NAMES.get(slot, slot)} ({entry['pairs']} references)",
                       f"{entry['accuracy']:.3f} (margin {entry['margin']:+.3f})"))
    where = []
    if "models" in numbers:
        where.append(("models", f"{args.models_dir}/{{{','.join(numbers['models'])}}}"))
    if "plots" in numbers:
        where.append(("plots", f"{args.plots_dir} ({numbers['plots']} plots: PNG, PDF, CSV, markdown)"))
    policies = [policy_rows(name, policy) for name, policy in numbers["policies"].items()]
    return [rows for rows in (stages, *policies, where) if rows]


def collect(args: Args) -> list:
    """(what, value) rows for every stage that has a run folder."""
    return [row for section in sections(gather(args), args) for row in section]


def write_json(numbers: dict, args: Args) -> str:
    """The report's numbers as <plots_dir>/hello_world_report.json, for scripts that compare runs."""
    os.makedirs(args.plots_dir, exist_ok=True)
    path = os.path.join(args.plots_dir, JSON_NAME)
    with open(path, "w") as f:
        json.dump({"runs_dir": args.runs_dir, "prefix": args.prefix, "models_dir": args.models_dir,
                   "plots_dir": args.plots_dir, "gold_judge": args.gold_judge, **numbers}, f, indent=2)
    return path


def main(args: Args) -> None:
    transformers_logging.disable_progress_bar()  # (a load bar in the middle of the summary)
    numbers = gather(args)
    table = Table(title="embedded default: results")
    table.add_column("metric")
    table.add_column("value", justify="right", overflow="fold")
    for section in sections(numbers, args):
        for what, value in section:
            table.add_row(what, value)
        table.add_section()
    console = Console()
    if not console.is_terminal:  # a log file: rich would assume 80 columns and wrap every label
        console.width = 120
    console.print(table)
    console.print("[x, y]: 95% intervals over the validation prompts (paired gold difference to SFT and mean gold "
                  "score: bootstrap; win rates and head-to-head: Wilson; length-controlled: bootstrap); ties count "
                  "half", markup=False, highlight=False)
    console.print(f"the same numbers: {write_json(numbers, args)}", markup=False, highlight=False)


if __name__ == "__main__":
    main(tyro.cli(Args))
