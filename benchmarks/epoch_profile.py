"""Where a PPO epoch's seconds go: one micro-batch step of ppo_left_padding.py's policy + critic
(training forwards, losses, backward, optimizer step) with the padded, packed and compiled forwards.

    python benchmarks/epoch_profile.py --shape 10m          # this CPU, fp32, the trl side by side's batch

The models and queries of benchmarks/ppo_speed.py (random-init checkpoints of `--shape`, queries of
query_length / 2 to query_length real tokens left-padded to query_length) with random responses of
`--response_length` tokens; the stage's own PolicyAndValueWrapper pieces (`response_logits`,
`response_values`), `scaled_logits`, `gather_logprobs`, `policy_loss`, `value_loss` and
`infra.launch.make_optimizer` (AdamW; fused under --compile_train). Per forwards setting, `--warmup`
untimed steps (the compile happens there), then the median seconds of `--repeats` steps per part.
A step is what the PPO epochs do per micro-batch, so at micro-batch = batch (the side by side's
setting) the epochs phase is about `noptepochs` steps.
"""

import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import tyro
from rich.console import Console
from rich.table import Table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import ppo_speed  # noqa: E402

from summarize_from_feedback_details import packing  # noqa: E402
from summarize_from_feedback_details.infra import launch, loading  # noqa: E402
from summarize_from_feedback_details import ppo_left_padding as ppo  # noqa: E402

PARTS = ["policy forward", "critic forward", "losses", "backward", "optimizer step"]


@dataclass
class Args:
    shape: str = "10m"
    batch_size: int = 16
    query_length: int = 128
    response_length: int = 53
    forwards: list[Literal["padded", "packed", "compiled"]] = field(
        default_factory=lambda: ["padded", "packed", "compiled"])
    warmup: int = 2
    repeats: int = 5
    seed: int = 1
    cache_dir: str = ppo_speed.Args().cache_dir


def training_models(args: Args, forwards: str) -> tuple:
    """The stage's trained pair as its loader (loading.load_policy_reference_reward) leaves them, and the stage's
    optimizer over both."""
    sft_path, rm_path = ppo_speed.build_checkpoints(args.shape, args.cache_dir, args.seed)
    tokenizer = loading.load_tokenizer(sft_path)
    policy, critic = loading.load_policy(sft_path, tokenizer), loading.load_reward_model(rm_path, tokenizer)
    packing.enable(forwards != "padded", policy, critic)
    packing.compile_for_training(forwards == "compiled", lambda message: None, policy, critic)
    model = ppo.PolicyAndValueWrapper(policy, critic, ppo_speed.PAD_ID).train()
    return model, launch.make_optimizer(ppo.Args(compile_train=forwards == "compiled"), model)


def batch(args: Args) -> tuple:
    generator = np.random.default_rng(args.seed)
    vocab = ppo_speed.model_config(args.shape).vocab_size
    queries = torch.tensor(ppo_speed.left_padded_queries(args.batch_size, args.query_length, vocab, generator))
    responses = torch.tensor(generator.integers(2, vocab, (args.batch_size, args.response_length)))
    return torch.cat([queries, responses], 1), responses


def timed_step(model, optimizer, query_responses: torch.Tensor, responses: torch.Tensor) -> dict:
    """One micro-batch of the PPO epochs with made-up old logprobs, values, advantages and returns."""
    seconds, start = {}, time.perf_counter()

    def lap(part):
        nonlocal start
        seconds[part] = time.perf_counter() - start
        start = time.perf_counter()

    length, pad_id = responses.shape[1], ppo_speed.PAD_ID
    logits = ppo.response_logits(model.policy, query_responses, pad_id, length)
    lap("policy forward")
    values = ppo.response_values(model.critic, query_responses, pad_id, length)
    lap("critic forward")
    # (ppo_speed's made-up vocabulary: every row of the embedding is a token)
    new_logprobs = ppo.gather_logprobs(ppo.scaled_logits(logits, 0.7, pad_id, logits.shape[-1]), responses)
    pg_losses, *_ = ppo.policy_loss(new_logprobs, new_logprobs.detach() - 0.01, torch.ones_like(new_logprobs), 0.2)
    vf_losses, _ = ppo.value_loss(values, values.detach() + 0.1, values.detach(), 0.2)
    loss = pg_losses.mean() + 0.1 * vf_losses.mean()
    lap("losses")
    loss.backward()
    lap("backward")
    optimizer.step()
    optimizer.zero_grad()
    lap("optimizer step")
    return seconds


def main(args: Args) -> dict:
    launch.quiet_libraries()
    query_responses, responses = batch(args)
    medians = {}
    for forwards in args.forwards:
        model, optimizer = training_models(args, forwards)
        for _ in range(args.warmup):
            timed_step(model, optimizer, query_responses, responses)
        steps = [timed_step(model, optimizer, query_responses, responses) for _ in range(args.repeats)]
        medians[forwards] = {part: statistics.median(s[part] for s in steps) for part in PARTS}
        medians[forwards]["step"] = statistics.median(sum(s.values()) for s in steps)
    table = Table(title=f"{args.shape}: median seconds of one micro-batch step ({args.batch_size} rows x "
                        f"{args.query_length} + {args.response_length}, {torch.get_num_threads()} threads)")
    table.add_column("part")
    for forwards in args.forwards:
        table.add_column(forwards, justify="right")
    for part in [*PARTS, "step"]:
        table.add_row(part, *[f"{medians[f][part]:.3f}" for f in args.forwards])
    Console(width=120).print(table)
    return medians


if __name__ == "__main__":
    main(tyro.cli(Args))
