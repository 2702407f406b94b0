"""dpo.py's peak GPU memory for one micro-batch (forward and backward of the policy's pair log-probs),
before and after the LM head ran at the response positions only, and with packing.

    python benchmarks/dpo_memory.py                       # a GPU: Pythia-1B's shape, the DPO sbatch's micro-batch
    python benchmarks/dpo_memory.py --shape tiny-s --pairs 2 --query_length 16 --response_length 8   # CPU plumbing

A random-init policy of `--shape` (benchmarks/ppo_speed.py's names) in bf16 on a GPU (the sbatch's
DeepSpeed bf16 weights; fp32 on the CPU), `--pairs` chosen/rejected pairs laid out as the data stage
writes them: a query of up to `--query_length` tokens, a response of up to `--response_length`, then
padding, with their response-label columns. Per setting, `dpo.pair_logprobs`'s work: one forward over
chosen + rejected, the summed log-probs, their sum's backward.
- `padded, all logits`: the code before issue 27 (`--no_packing`, the LM head at every position);
- `padded, response logits`: `response_window`'s columns of the left-aligned rows only;
- `packed, response logits`: dpo.py's default now.
Written to <out>/dpo_memory.csv. Peak memory is torch.cuda.max_memory_allocated above what was allocated before the step (the model's
weights and gradients of an earlier step excluded: zeroed with set_to_none); on the CPU it is not
measured ("n/a") and only the seconds are.
"""

import csv
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import tyro
from rich.console import Console
from rich.table import Table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import ppo_speed  # noqa: E402

from summarize_from_feedback_details import dpo, packing  # noqa: E402
from summarize_from_feedback_details.infra import loading  # noqa: E402

SETTINGS = {"padded, all logits": (False, False), "padded, response logits": (False, True),
            "packed, response logits": (True, True)}


@dataclass
class Args:
    shape: str = "pythia-1b"
    pairs: int = 8
    """pairs per micro-batch (the DPO sbatch's Pythia-1B micro-batch: 8)"""
    query_length: int = 512
    response_length: int = 53
    seed: int = 1
    cache_dir: str = ppo_speed.Args().cache_dir
    out: str = "runs/dpo_memory"
    """dpo_memory.csv"""


def pair_batch(args: Args, vocab: int) -> tuple:
    """(chosen, rejected, chosen labels, rejected labels) laid out as the data stage writes pair rows (the
    paper's): a query of varied length (ppo_speed's queries without their left padding), then a response
    of response_length / 2 to response_length tokens, then padding to query_length + response_length;
    labels pad outside the response."""
    generator = np.random.default_rng(args.seed)
    rows, labels = [], []
    width = args.query_length + args.response_length
    for _ in range(2 * args.pairs):
        query = [t for t in ppo_speed.left_padded_queries(1, args.query_length, vocab, generator)[0]
                 if t != ppo_speed.PAD_ID]
        length = int(generator.integers(max(1, args.response_length // 2), args.response_length + 1))
        response = generator.integers(2, vocab, length).tolist()
        padding = [ppo_speed.PAD_ID] * (width - len(query) - length)
        rows.append(query + response + padding)
        labels.append([ppo_speed.PAD_ID] * len(query) + response + padding)
    rows, labels = torch.tensor(rows), torch.tensor(labels)
    return rows[:args.pairs], rows[args.pairs:], labels[:args.pairs], labels[args.pairs:]


def step(model, batch: tuple, response_logits: bool) -> None:
    chosen, rejected, chosen_labels, rejected_labels = batch
    if response_logits:
        chosen_logps, rejected_logps = dpo.pair_logprobs(model, *batch, ppo_speed.PAD_ID)
    else:  # the code before: logits at every position
        labels = torch.cat([chosen_labels, rejected_labels])
        logits = dpo.forward(model, torch.cat([chosen, rejected]), ppo_speed.PAD_ID)
        logps = dpo.sequence_logprobs(logits, labels, ppo_speed.PAD_ID)
        chosen_logps, rejected_logps = logps[:len(chosen)], logps[len(chosen):]
    (chosen_logps - rejected_logps).sum().backward()


def main(args: Args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sft_path, _ = ppo_speed.build_checkpoints(args.shape, args.cache_dir, args.seed)
    tokenizer = loading.load_tokenizer(sft_path)
    model = loading.load_policy(sft_path, tokenizer, torch.bfloat16 if device == "cuda" else torch.float32)
    model.to(device).train()
    batch = tuple(t.to(device) for t in pair_batch(args, model.config.vocab_size))
    results = {}
    for name, (packed, response_logits) in SETTINGS.items():
        packing.enable(packed, model)
        step(model, batch, response_logits)  # warm-up (allocator, kernels)
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        step(model, batch, response_logits)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 30 if device == "cuda" else float("nan")
        model.zero_grad(set_to_none=True)
        results[name] = {"seconds": seconds, "peak_gib": peak}
    table = Table(title=f"dpo.py, one micro-batch of {args.pairs} pairs ({2 * args.pairs} rows x {args.query_length} "
                        f"+ {args.response_length}) at {args.shape}, {device}")
    for column in ("setting", "peak GiB above the weights", "seconds"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for name, result in results.items():
        peak = result["peak_gib"]
        table.add_row(name, "n/a" if peak != peak else f"{peak:.2f}", f"{result['seconds']:.3f}")
    Console(width=120).print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dpo_memory.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["shape", "device", "pairs", "setting", "peak_gib", "seconds"])
        writer.writerows([args.shape, device, args.pairs, name, r["peak_gib"], r["seconds"]] for name, r in results.items())
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
