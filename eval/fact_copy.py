"""Which of the post's facts a causal LM (a base model, an SFT policy, a trained policy) can copy: the
reward model's fact-swap check of hello_world's table, read on the policy's likelihood; and the same
pairs read by reward models.

    python eval/fact_copy.py --table runs/hello_world_sft/validation_table.csv \\
        --models models/tiny/pythia-tiny-m models/hello_world/sft --reward_models models/hello_world/reward_model \\
        --out eval/images/fact_copy

For the first --references validation references of --table (a stage's validation table: `query`,
`reference_responses`), each reference is set against itself with one fact swapped for a wrong one
(evaluation.fact_swap_pairs: the same pairs as the reward model's rows of hello_world's table), and a model
"checks" that slot where log p(reference | post) > log p(swap | post), summed over the response's
tokens. A model that cannot copy a slot from the post sits near 0.5 on it (margin near 0): a policy
from it that learns to state that fact states a random value, which the gold judge charges 2.5 or
more, unless the reward model checks the slot (docs/real_pipeline.md: the feeling).
`duration_unit`: the duration with its unit swapped and its number kept (evaluation.fact_probe_pairs),
which the fact-swap pairs' duration (its number moved) never checks (docs/real_pipeline.md, "The
duration's unit"). A reward model (--reward_models) checks a slot where it scores the reference above
its swap, as in hello_world's table.

Writes --out/fact_copy.{csv,md}: one row per model, per slot the accuracy and the mean margin (nats for
a causal LM, reward for a reward model).
"""

from dataclasses import dataclass, field

import pandas as pd
import tyro
from common import write_table
from transformers import AutoModelForSequenceClassification

from summarize_from_feedback_details.evaluation import PROBE_SLOTS, fact_copy_row, fact_probe_pairs, reward_swap_row
from summarize_from_feedback_details.infra.loading import load_policy, load_tokenizer


@dataclass
class Args:
    table: str = "runs/hello_world_sft/validation_table.csv"
    """a stage's validation table (query, reference_responses): whose references are swapped"""
    models: list[str] = field(default_factory=lambda: ["models/hello_world/sft"])
    """causal LMs (model folders) to read, each with its own tokenizer"""
    reward_models: list[str] = field(default_factory=list)
    """reward models (reward.py's folders) to read on the same pairs"""
    references: int = 1000
    """how many validation references (the first ones) are swapped"""
    out: str = "eval/images/fact_copy"
    """folder for fact_copy.{csv,md}"""


def main(args: Args) -> pd.DataFrame:
    queries, texts, pairs = fact_probe_pairs(pd.read_csv(args.table), args.references)
    rows = []
    for kind, paths in (("causal LM", args.models), ("reward model", args.reward_models)):
        for path in paths:
            tokenizer = load_tokenizer(path)
            if kind == "causal LM":
                row = fact_copy_row(load_policy(path, tokenizer).eval(), tokenizer, queries, texts, pairs, PROBE_SLOTS)
            else:
                model = AutoModelForSequenceClassification.from_pretrained(path).eval()
                row = reward_swap_row(model, tokenizer, queries, texts, pairs, PROBE_SLOTS)
            rows.append({"model": path, "kind": kind, **row})
            print(path, " ".join(f"{slot} {rows[-1][slot]:.3f}" for slot in PROBE_SLOTS), flush=True)
    table = pd.DataFrame(rows).round(3)
    write_table(table, args.out, "fact_copy")
    counts = ", ".join(f"{slot} {len(pairs[slot])}" for slot in PROBE_SLOTS)
    print(f"pairs: {counts}; wrote {args.out}/fact_copy.{{csv,md}}")
    return table


if __name__ == "__main__":
    main(tyro.cli(Args))
