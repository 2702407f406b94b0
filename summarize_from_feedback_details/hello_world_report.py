"""The summary table that ends `./hello_world.sh`: what each stage of the embedded default reached.

    python -m summarize_from_feedback_details.hello_world_report --runs_dir runs

Reads the run folders the stages wrote (`runs/hello_world_<stage>/`) and judges the reward model's
eval tables with the synthetic task's gold judge. A stage that has not run yet is left out.
"""

import json
import os
from dataclasses import dataclass

import pandas as pd
import tyro
from rich.console import Console
from rich.table import Table

from summarize_from_feedback_details.synthetic_tldr import reward_gold_agreement


@dataclass
class Args:
    runs_dir: str = "runs"
    prefix: str = "hello_world_"
    """run folders are `<runs_dir>/<prefix><stage>`"""


def last_metrics(run_folder: str) -> dict:
    """The last logged value of every metric of a run (metrics.jsonl holds one dict per log call)."""
    metrics = {}
    with open(os.path.join(run_folder, "metrics.jsonl")) as f:
        for line in f:
            metrics.update(json.loads(line))
    metrics.pop("step", None)
    return metrics


def collect(args: Args) -> list:
    """(what, value) rows for every stage that has a run folder."""
    rows = []
    sft = os.path.join(args.runs_dir, f"{args.prefix}sft")
    if os.path.isdir(sft):
        metrics = last_metrics(sft)
        rows.append(("SFT ROUGE-L (validation)", f"{metrics['validation/sft/rouge/rougeL']:.3f}"))
        responses = pd.read_csv(os.path.join(sft, "validation_table.csv"), keep_default_na=False)
        rows.append(("SFT mean response length (words)",
                     f"{responses['postprocessed_response'].str.split().str.len().mean():.1f}"))
    reward = os.path.join(args.runs_dir, f"{args.prefix}reward")
    if os.path.isdir(reward):
        metrics = last_metrics(reward)
        for split, name in (("validation", "TL;DR validation"), ("validation_cnndm", "OOD (CNN/DM role)")):
            table = pd.read_csv(os.path.join(reward, f"eval_{split}_table.csv"), keep_default_na=False)
            agreement = reward_gold_agreement(table["query"], table["chosen"], table["rejected"],
                                              table["chosen_rewards"], table["rejected_rewards"])
            rows.append((f"RM accuracy, {name}", f"{metrics[f'eval/rm/{split}/accuracy']:.3f} ({len(table)} pairs)"))
            rows.append((f"RM agreement with the gold judge, {name}", f"{agreement:.3f}"))
    return rows


def main(args: Args) -> None:
    table = Table(title="embedded default: results")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for what, value in collect(args):
        table.add_row(what, value)
    Console().print(table)


if __name__ == "__main__":
    main(tyro.cli(Args))
