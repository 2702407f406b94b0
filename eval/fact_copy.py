"""Which of the post's facts a causal LM (a base model, an SFT policy, a trained policy) can copy: the
reward model's fact-swap check of hello_world's table, read on the policy's likelihood.

    python eval/fact_copy.py --table runs/hello_world_sft/validation_table.csv \\
        --models models/tiny/pythia-tiny-m models/hello_world/sft --out eval/images/fact_copy

For the first --references validation references of --table (a stage's validation table: `query`,
`reference_responses`), each reference is set against itself with one fact swapped for a wrong one
(evaluation.fact_swap_pairs: the same pairs as the reward model's rows of hello_world's table), and a model
"checks" that slot where log p(reference | post) > log p(swap | post), summed over the response's
tokens. A model that cannot copy a slot from the post sits near 0.5 on it (margin near 0): a policy
from it that learns to state that fact states a random value, which the gold judge charges 2.5 or
more, unless the reward model checks the slot (docs/real_pipeline.md: the feeling).

Writes --out/fact_copy.{csv,md}: one row per model, per slot the accuracy and the mean margin (nats).
"""

import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import tyro
from common import write_table

from summarize_from_feedback_details.gold_judge import FACT_SWAP_SLOTS
from summarize_from_feedback_details.evaluation import fact_swap_pairs, swap_preferences
from summarize_from_feedback_details.infra.loading import load_policy, load_tokenizer


@dataclass
class Args:
    table: str = "runs/hello_world_sft/validation_table.csv"
    """a stage's validation table (query, reference_responses): whose references are swapped"""
    models: list[str] = field(default_factory=lambda: ["models/hello_world/sft"])
    """causal LMs (model folders) to read, each with its own tokenizer"""
    references: int = 1000
    """how many validation references (the first ones) are swapped"""
    out: str = "eval/images/fact_copy"
    """folder for fact_copy.{csv,md}"""


@torch.no_grad()
def response_logprobs(model, tokenizer, queries: list, responses: list) -> np.ndarray:
    """log p(response | query) per pair, summed over the response's tokens, one pair per forward (no
    padding): the query encoded as the datasets encode it (a BOS where the tokenizer prepends one), the
    response without special tokens."""
    sums = []
    for query, response in zip(queries, responses):
        query_ids = tokenizer(query)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        logits = model(torch.tensor([query_ids + response_ids])).logits[0, len(query_ids) - 1:-1].float()
        sums.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(response_ids)[:, None]).sum().item())
    return np.array(sums)


def fact_copy_row(model, tokenizer, queries: list, texts: list, pairs: dict) -> dict:
    """{<slot>: accuracy, <slot>_margin: mean log-likelihood margin} of one model over fact_swap_pairs."""
    accuracy = swap_preferences(lambda qs, ts: response_logprobs(model, tokenizer, qs, ts), queries, texts, pairs)
    row = {}
    for slot in FACT_SWAP_SLOTS:
        entry = accuracy.get(slot, {"accuracy": float("nan"), "margin": float("nan")})
        row[slot], row[f"{slot}_margin"] = entry["accuracy"], entry["margin"]
    return row


def main(args: Args) -> pd.DataFrame:
    queries, texts, pairs = fact_swap_pairs(pd.read_csv(args.table), args.references)
    rows = []
    for path in args.models:
        tokenizer = load_tokenizer(path)
        model = load_policy(path, tokenizer).eval()
        rows.append({"model": path, **fact_copy_row(model, tokenizer, queries, texts, pairs)})
        print(path, " ".join(f"{slot} {rows[-1][slot]:.3f}" for slot in FACT_SWAP_SLOTS), flush=True)
    table = pd.DataFrame(rows).round(3)
    write_table(table, args.out, "fact_copy")
    counts = ", ".join(f"{slot} {len(pairs[slot])}" for slot in FACT_SWAP_SLOTS)
    print(f"pairs: {counts}; wrote {args.out}/fact_copy.{{csv,md}}")
    return table


if __name__ == "__main__":
    main(tyro.cli(Args))
