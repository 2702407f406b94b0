"""Train/rollout consistency: how far the log-probabilities of the same sampled tokens move with the batch
shape and the dtype (DESIGN.md section 20).

    python benchmarks/logprob_drift.py --model models/hello_world/sft --queries data/tldr/sft
    python benchmarks/logprob_drift.py --model pythia-410m          # a random-init policy of that shape
    make gpu-report                                                # includes it on a GPU

Responses are sampled (T 0.7) once, by the fp32 policy, for N left-padded queries. The same tokens are
then scored at batch 1 (each row alone, its padding removed) and at batch N (the padded batch, as the
rollout and the training forward score them), in fp32, bf16 and fp16 where the device runs them. Each
configuration is compared with fp32 at batch 1 (the reference): per response token the ratio
exp(logprob - reference logprob), which is PPO's importance ratio when rollout and training disagree
by exactly this much before any update. Printed and written to <out>/logprob_drift.{csv,md}: the
share of ratios outside [0.9, 1.1] (verl#6280 measured 37-60% in bf16 for Pythia-160m/410m on GPUs),
the max and mean |log ratio|. Random-init shapes (benchmarks/ppo_speed.py's names) need no data; a
checkpoint directory uses --queries (a tldr_dataset.py SFT dataset, its validation split).
"""

import csv
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import tyro

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from summarize_from_feedback_details import ppo_left_padding as ppo  # noqa: E402
from summarize_from_feedback_details import rollout  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLUMNS = ["model", "device", "dtype", "batch", "tokens", "share_outside_0.9_1.1", "max_abs_log_ratio",
           "mean_abs_log_ratio"]


@dataclass
class Args:
    model: str = "pythia-160m"
    """a causal-LM checkpoint directory (e.g. models/hello_world/sft), or a benchmarks/ppo_speed.py shape
    name for a random-init policy of that shape"""
    queries: Optional[str] = None
    """with a checkpoint: its tokenized SFT dataset (tldr_dataset.py output); the validation split's queries"""
    rows: int = 16
    """N: the queries scored together at batch N"""
    query_length: int = 512
    """random-init shapes: query tokens (left-padded by varied amounts)"""
    response_length: int = 53
    """sampled tokens per query"""
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    """the dtypes to score in (one the device cannot run is reported and skipped)"""
    device: Optional[str] = None
    """default: cuda when there is one, else cpu"""
    out: str = "runs/logprob_drift"
    """folder for logprob_drift.{csv,md}"""


def load(args: Args, device: str) -> tuple:
    """(fp32 policy, left-padded queries, pad id, vocab_end: len(tokenizer), the first id no token has)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if os.path.isdir(args.model):
        from datasets import load_from_disk

        from summarize_from_feedback_details.infra.launch import quiet_libraries
        from summarize_from_feedback_details.infra.loading import load_tokenizer

        quiet_libraries()
        if args.queries is None:
            raise SystemExit("--model is a checkpoint: give --queries, its tokenized SFT dataset (e.g. data/tldr/sft)")
        policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
        tokenizer = load_tokenizer(args.model)
        queries = load_from_disk(args.queries)["validation"].with_format("torch")["query_token"][: args.rows]
        return policy.to(device).eval(), queries.to(device), tokenizer.pad_token_id, len(tokenizer)
    import ppo_speed

    policy = AutoModelForCausalLM.from_config(ppo_speed.model_config(args.model)).to(device).eval()
    queries = torch.randint(2, policy.config.vocab_size, (args.rows, args.query_length),
                            generator=torch.Generator().manual_seed(0))
    for i in range(args.rows):
        queries[i, : i * args.query_length // (2 * args.rows)] = ppo_speed.PAD_ID  # varied left padding
    return policy, queries.to(device), ppo_speed.PAD_ID, policy.config.vocab_size  # (every id decodes: ppo_speed)


def response_logprobs(policy, query_responses: torch.Tensor, responses: torch.Tensor, pad_id: int,
                      vocab_end: int) -> torch.Tensor:
    """The log-probabilities of `responses` at T 0.7 under `policy`, as the stages score them."""
    logits = ppo.response_logits(policy, query_responses, pad_id, responses.shape[1])
    return ppo.gather_logprobs(ppo.scaled_logits(logits.float(), 0.7, pad_id, vocab_end), responses)


@torch.no_grad()
def drift_table(args: Args) -> list:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    policy, queries, pad_id, vocab_end = load(args, device)
    ((responses, _),) = rollout.decode(policy, [rollout.SamplingGroup(queries, 0.7, 0)], pad_id, vocab_end,
                                       args.response_length)
    query_responses = torch.cat([queries, responses], 1)
    scored = {}
    for name in args.dtypes:
        model = policy.to(DTYPES[name])
        try:
            batch_n = response_logprobs(model, query_responses, responses, pad_id, vocab_end)
            batch_1 = torch.cat([  # each row alone, without its left padding
                response_logprobs(model, row[(row[: queries.shape[1]] != pad_id).nonzero()[0, 0]:][None], response[None],
                                  pad_id, vocab_end) for row, response in zip(query_responses, responses)])
        except RuntimeError as error:  # e.g. a dtype this device's kernels do not run
            print(f"{name}: not run on {device} ({str(error).splitlines()[0]})")
            continue
        scored[(name, 1)], scored[(name, args.rows)] = batch_1, batch_n
    policy.to(torch.float32)
    reference = scored[("fp32", 1)]
    real = responses != pad_id  # the sampled tokens (the decode pads after EOS)
    rows = []
    for (name, batch), logprobs in scored.items():
        log_ratio = (logprobs - reference)[real].abs()
        ratio = torch.exp((logprobs - reference)[real])
        rows.append({"model": args.model, "device": device, "dtype": name, "batch": batch, "tokens": log_ratio.numel(),
                     "share_outside_0.9_1.1": ((ratio < 0.9) | (ratio > 1.1)).float().mean().item(),
                     "max_abs_log_ratio": log_ratio.max().item(), "mean_abs_log_ratio": log_ratio.mean().item()})
    return rows


def write(rows: list, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "logprob_drift.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS) + " |"
              for r in rows]
    with open(os.path.join(out, "logprob_drift.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    arguments = tyro.cli(Args)
    write(drift_table(arguments), arguments.out)
