"""How close a policy came to going on where its summaries end: at the step that wrote EOS, log p(EOS) minus
the log-probability of the likeliest other token, read on the policy that wrote them.

    python eval/end_margin.py --table runs/hello_world_sft/validation_table.csv \\
        --model models/hello_world/sft --out eval/images/end_margin

A summary that ends by a small margin is a decision that any drift of the weights flips: PPO with no
information (the null control of make compare) still adds the post's closing question where an SFT policy
ends its summaries at such a near-tie (docs/compare.md, "What PPO learns from when the reward carries
nothing"). Each of the first --prompts rows of --table (a stage's validation table: `query`,
`postprocessed_response`, `contain_eos`) whose summary ended with EOS is read once: the query encoded as the
datasets encode it, the summary after it, the logits after its last token.

Writes --out/end_margin.{csv,md}: one row per summary (the margin in nats, the likeliest other token), and
prints the median, the shares within 0.5 and 1 nat, and the other tokens that come closest most often.
"""

import os
from collections import Counter
from dataclasses import dataclass

import pandas as pd
import torch
import tyro
from common import write_table

from summarize_from_feedback_details.evaluation import pair_ids
from summarize_from_feedback_details.infra.loading import load_policy, load_tokenizer


@dataclass
class Args:
    table: str = "runs/hello_world_sft/validation_table.csv"
    """a stage's validation table (query, postprocessed_response, contain_eos): the summaries read"""
    model: str = "models/hello_world/sft"
    """the causal LM that wrote them (a model folder, with its tokenizer)"""
    prompts: int = 300
    """how many rows (the first ones) are read"""
    out: str = "eval/images/end_margin"
    """folder for end_margin.{csv,md}"""


def end_margin(logits: torch.Tensor, eos_id: int) -> tuple:
    """(log p(EOS) - the largest log p of any other token, that token's id) of one next-token logits vector."""
    logprobs = torch.log_softmax(logits.float(), -1)
    others = logprobs.clone()
    others[eos_id] = float("-inf")
    rival = int(others.argmax())
    return float(logprobs[eos_id] - others[rival]), rival


def end_logits(model, tokenizer, query: str, response: str) -> torch.Tensor:
    """The next-token logits after `response` given `query`, read as evaluation.response_logprobs reads a pair
    (evaluation.pair_ids: no padding)."""
    query_ids, response_ids = pair_ids(tokenizer, query, response)
    with torch.no_grad():
        return model(torch.tensor([query_ids + response_ids])).logits[0, -1]


def main(args: Args) -> pd.DataFrame:
    table = pd.read_csv(args.table, keep_default_na=False).head(args.prompts)
    ended = table[table["contain_eos"].astype(str) == "True"]
    if ended.empty:
        raise ValueError(f"{args.table}: none of its first {args.prompts} summaries ends with EOS")
    tokenizer = load_tokenizer(args.model)
    model = load_policy(args.model, tokenizer).eval()
    rows = []
    for query, response in zip(ended["query"], ended["postprocessed_response"]):
        margin, rival = end_margin(end_logits(model, tokenizer, query, response), tokenizer.eos_token_id)
        rows.append({"margin": round(margin, 4), "rival": tokenizer.decode([rival])})
    frame = pd.DataFrame(rows)
    write_table(frame, args.out, "end_margin")
    margins = frame["margin"]
    rivals = ", ".join(f"{token!r} {count}" for token, count in Counter(frame["rival"]).most_common(5))
    print(f"{args.model}: {len(frame)} of the first {len(table)} summaries end with EOS; margin (nats) median "
          f"{margins.median():.2f}, within 0.5 {(margins < 0.5).mean():.3f}, within 1 {(margins < 1.0).mean():.3f}; "
          f"closest other tokens: {rivals}; wrote {os.path.join(args.out, 'end_margin')}.{{csv,md}}")
    return frame


if __name__ == "__main__":
    main(tyro.cli(Args))
