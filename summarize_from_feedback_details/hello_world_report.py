"""The summary table that ends `./hello_world.sh`: what each stage reached, and where things are.

    python -m summarize_from_feedback_details.hello_world_report --runs_dir runs

Reads the run folders the stages wrote (`runs/hello_world_<stage>/`), judges the reward model's
eval tables and the policies' validation tables with the synthetic task's gold judge (embedded
default only; real data needs the chat judge of eval/rlhf_scaling_plot.py), and scores the SFT,
PPO and DPO summaries (and those of RLOO, GRPO and online DPO with ALGOS=all) with the same reward
model. A stage that has not run yet is left out.
"""

import json
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import tyro
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as transformers_logging

from summarize_from_feedback_details import win_rates
from summarize_from_feedback_details.synthetic_tldr import gold_preference, reward_gold_agreement


# (label, run folder suffix) of the policies after SFT, as hello_world.sh names their runs (ALGOS)
DPO_AND_ONLINE_METHODS = (("PPO", "ppo"), ("DPO", "dpo"), ("RLOO k=2", "rloo"), ("RLOO k=4", "rloo_k4"),
                          ("GRPO k=4", "grpo"), ("online DPO", "online_dpo"))


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


def last_metrics(run_folder: str) -> dict:
    """The last logged value of every metric of a run (metrics.jsonl holds one dict per log call)."""
    metrics = {}
    with open(os.path.join(run_folder, "metrics.jsonl")) as f:
        for line in f:
            metrics.update(json.loads(line))
    metrics.pop("step", None)
    return metrics


@torch.no_grad()
def reward_scores(reward_model, tokenizer, queries: list, responses: list, batch_size: int = 64) -> np.ndarray:
    """The reward model's score of each [query | response + EOS], from the tables' text (both
    policies' summaries go through this same path, so their scores compare fairly)."""
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    scores = []
    for start in range(0, len(queries), batch_size):
        rows = [tokenizer(q)["input_ids"] + tokenizer(r)["input_ids"] + [eos_id]
                for q, r in zip(queries[start: start + batch_size], responses[start: start + batch_size])]
        width = max(map(len, rows))
        ids = torch.tensor([row + [pad_id] * (width - len(row)) for row in rows])  # right padding
        scores.append(reward_model(input_ids=ids, attention_mask=ids != pad_id).logits[:, 0])
    return torch.cat(scores).numpy()


def policy_summary(table: pd.DataFrame, reward_model, tokenizer) -> dict:
    """Gold-judge win rate against the reference summaries (ties count half) with its 95% Wilson
    interval over prompts, the length-controlled win rate (win_rates.py: at zero length difference to
    the reference) with its 95% bootstrap interval, mean reward-model score, and mean response length
    in tokens (EOS not counted) of a policy's validation table."""
    queries, responses = list(table["query"]), list(table["postprocessed_response"])
    wins = [gold_preference(q, r, ref) for q, r, ref in zip(queries, responses, table["reference_responses"])]
    lengths = np.array([len(tokenizer(r)["input_ids"]) for r in responses], dtype=float)
    difference = lengths - [len(tokenizer(r)["input_ids"]) for r in table["reference_responses"]]
    return {
        "win_rate": float(np.mean(wins)),
        "ci": win_rates.wilson_interval(float(np.mean(wins)), len(wins)),
        "lc_win_rate": win_rates.length_controlled_win_rate(wins, difference),
        "lc_ci": win_rates.length_controlled_interval(wins, difference),
        "rm_score": float(reward_scores(reward_model, tokenizer, queries, responses).mean()),
        "length": float(lengths.mean()),
        "rows": len(table),
    }


def with_interval(value: float, interval: tuple) -> str:
    """'0.178 [0.140, 0.221]': a rate and its 95% interval."""
    return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"


def metric_history(run_folder: str, key: str) -> list:
    """Every logged value of one metric, in order."""
    with open(os.path.join(run_folder, "metrics.jsonl")) as f:
        return [m[key] for m in map(json.loads, f) if key in m]


def collect(args: Args) -> list:
    """(what, value) rows for every stage that has a run folder."""
    rows = []
    sft = os.path.join(args.runs_dir, f"{args.prefix}sft")
    if os.path.isdir(sft):
        metrics = last_metrics(sft)
        rows.append(("SFT ROUGE-L (validation)", f"{metrics['validation/sft/rouge/rougeL']:.3f}"))
    # the reward model's accuracy, and DPO's with its implicit reward (same tables, same judge)
    for what, stage in (("RM", "reward"), ("DPO implicit-reward", "dpo")):
        folder = os.path.join(args.runs_dir, f"{args.prefix}{stage}")
        if not os.path.isfile(os.path.join(folder, "eval_validation_table.csv")):
            continue
        metrics = last_metrics(folder)
        for split, name in (("validation", "TL;DR validation"), ("validation_cnndm", "OOD (CNN/DM role)")):
            table = pd.read_csv(os.path.join(folder, f"eval_{split}_table.csv"), keep_default_na=False)
            rows.append((f"{what} accuracy, {name}", f"{metrics[f'eval/rm/{split}/accuracy']:.3f} ({len(table)} pairs)"))
            if args.gold_judge:
                agreement = reward_gold_agreement(table["query"], table["chosen"], table["rejected"],
                                                  table["chosen_rewards"], table["rejected_rewards"])
                rows.append((f"{what} agreement with the gold judge, {name}", f"{agreement:.3f}"))
    policies = {name: os.path.join(args.runs_dir, f"{args.prefix}{stage}", "validation_table.csv")
                for name, stage in (("SFT", "sft"), *DPO_AND_ONLINE_METHODS)}
    policies = {name: path for name, path in policies.items() if os.path.exists(path)}
    reward_model_dir = os.path.join(args.models_dir, "reward_model")
    if policies and os.path.isdir(reward_model_dir):
        reward_model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
        tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
        for name, path in policies.items():
            summary = policy_summary(pd.read_csv(path, keep_default_na=False), reward_model, tokenizer)
            if args.gold_judge:
                rows.append((f"{name} gold-judge win rate vs reference ({summary['rows']} prompts)",
                             with_interval(summary["win_rate"], summary["ci"])))
                rows.append((f"{name} length-controlled gold win rate", with_interval(summary["lc_win_rate"],
                                                                                      summary["lc_ci"])))
            rows.append((f"{name} mean reward-model score", f"{summary['rm_score']:.3f}"))
            rows.append((f"{name} mean response length (tokens)", f"{summary['length']:.1f}"))
    for name, stage in DPO_AND_ONLINE_METHODS:
        folder = os.path.join(args.runs_dir, f"{args.prefix}{stage}")
        kl = metric_history(folder, "objective/kl")[-5:] if os.path.isfile(os.path.join(folder, "metrics.jsonl")) else []
        if kl:
            rows.append((f"{name} KL to the SFT policy (nats per response, last 5 updates)", f"{np.mean(kl):.2f}"))
    if os.path.isdir(args.models_dir):
        models = sorted(name for name in os.listdir(args.models_dir) if os.path.isdir(os.path.join(args.models_dir, name)))
        rows.append(("models", f"{args.models_dir}/{{{','.join(models)}}}"))
    if os.path.isdir(args.plots_dir):
        plots = [name for name in os.listdir(args.plots_dir) if name.endswith(".png")]
        rows.append(("plots", f"{args.plots_dir} ({len(plots)} plots: PNG, PDF, CSV, markdown)"))
    return rows


def main(args: Args) -> None:
    transformers_logging.disable_progress_bar()  # (a load bar in the middle of the summary)
    table = Table(title="embedded default: results")
    table.add_column("metric")
    table.add_column("value", justify="right", overflow="fold")
    for what, value in collect(args):
        table.add_row(what, value)
    console = Console()
    if not console.is_terminal:  # a log file: rich would assume 80 columns and wrap every label
        console.width = 120
    console.print(table)
    console.print("[x, y]: 95% intervals over the validation prompts (win rate: Wilson; length-controlled: "
                  "bootstrap); ties count half", markup=False, highlight=False)


if __name__ == "__main__":
    main(tyro.cli(Args))
