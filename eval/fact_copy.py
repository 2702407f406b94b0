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

import pandas as pd
import tyro
from common import write_table

from summarize_from_feedback_details.gold_judge import FACT_SWAP_SLOTS
from summarize_from_feedback_details.evaluation import fact_copy_row, fact_swap_pairs
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
