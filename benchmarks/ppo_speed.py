"""Seconds per PPO update of ppo_left_padding.py, its per-phase split, tokens per second and the
utilisation of the device's own measured matmul peak; and a side-by-side run against TRL 1.12's
`trl.experimental.ppo.PPOTrainer` on identical settings.

    python benchmarks/ppo_speed.py --shapes tiny-s 10m --strategies single ddp zero2     # CPU table
    python benchmarks/ppo_speed.py --mode trl --shapes 1m 10m                            # vs TRL, CPU
    python benchmarks/ppo_speed.py --shapes pythia-1b --query_length 512 --batch_size 64 \\
        --micro_batch_sizes 8 16 --strategies single zero2 zero2-offload                 # one GPU, bf16
    python benchmarks/ppo_speed.py --shapes tiny-m 10m --samplers sync sequential overlapped  # async RLHF

Everything is offline: each shape's "SFT" (AutoModelForCausalLM) and "reward model"
(AutoModelForSequenceClassification, num_labels 1) are randomly initialised GPT-NeoX models written
once to `--cache_dir`, with a word-level tokenizer of exactly the shape's vocabulary (id 0 is
`<|endoftext|>`, EOS; id 1 is `[PAD]`). The queries are synthetic: random token ids, real lengths
uniform in [query_length / 2, query_length], left-padded to query_length with `[PAD]`; the train
split holds exactly one global batch, so every update (and the TRL side) rolls out the same queries.
Random weights almost never sample EOS, so every response is the full `--response_length`.

`--mode speed` runs ppo_left_padding.py through its own CLI (`main(args)` in this process for the
one-process strategy, `accelerate launch` for the others) for `--updates` updates over
shapes x strategies x micro-batch sizes. The first update is warm-up and is left out; the others'
seconds (`time/update`) and phases (`time/<phase>`: rank 0's seconds in the validation score,
generation, reference / value / reward forwards, advantages, PPO epochs) come from the run's
runs/<run_name>/metrics.jsonl; `other` is what the phases do not cover (part of the logging, the
loop itself).
Strategies: `single` (one process), `ddp` (`--num_processes` processes, gloo on CPU),
`zero2` (DeepSpeed ZeRO-2 over `--num_processes`: tests/accelerate_configs/deepspeed_zero2_cpu.yaml
on CPU, deepspeed.yaml with bf16 on a GPU) and `zero2-offload` (the same plus the stage's
`--offload`: reference and reward model as ZeRO-3 engines with parameters on the CPU). On a GPU
every strategy runs in bf16 mixed precision (accelerate), on the CPU in fp32.

FLOPs per update (the `TFLOP/update` column and utilisation) count the useful work of the standard
algorithm, the way MFU does, so an implementation that skips work does not lower the count:
    6 x (policy + critic params) x trained tokens x PPO epochs                       (PPO epochs)
  + 2 x (2 x policy + 2 x critic params) x rollout tokens          (generation, reference, value, reward)
  + 2 x (policy + 2 x critic params) x validation tokens      (per-update validation score, 2 RM calls)
where tokens are query + response positions (padding included) of the global batch, params are the
matmul parameters (everything but the input embedding, which is a lookup), generation counts one
forward per position (prefill + decode with a KV cache), and attention's sequence-quadratic FLOPs are
left out (about 6% of a 160m model's at 181 tokens, less for larger models). `epoch util` is the PPO
epochs' term alone over rank 0's `time/ppo_epochs` (the epochs' forwards, backwards and optimizer
steps). Packing computes fewer positions than the count (it skips the padding), so a packed row's
utilisation reads as a padded-equivalent rate. Utilisation is achieved
FLOP/s over the peak measured here: the best of a few square matmuls (fp32 on CPU, bf16 on a GPU)
with the same thread count (CPU: threads x processes, capped at the cores), x processes on GPUs.
`--variants full lora`: each setting with every weight trained and with the stage's LoRA
(`--use_peft`, rank `--lora_r`); `trainable` counts what the optimizer updates in policy + critic, and
`peak GiB` is what the one-process run added at its peak (GPU: tensors; CPU: the resident set's
high-water mark above the resident set before the run; not measured for launched runs). The FLOP count is full training's
for both variants (LoRA skips the frozen weights' gradients, about a third of the training FLOPs),
so a `lora` row's utilisation reads as a full-training-equivalent rate.
Decode: `ms/step` is the generation phase over `response_length` steps (the prefill included);
`floor ms` is the least a step can take at this device's measured copy bandwidth (the best of a few
large buffer copies): it must read the policy's matmul weights (fp32, bf16 under DeepSpeed on a
GPU) and its batch's whole static KV cache (query + response positions, all layers) once.

`--samplers`: who samples the rollouts (docs/async.md). `sync` is today's loop; `sequential` samples
with the weights of `--async_steps` updates ago in the learner's process, before it trains; `overlapped`
samples the same rollouts in a worker process (the stage's --async_worker, on the learner's device)
while the learner trains the update before. On a CPU the worker's `--worker_threads` come out of the
setting's threads, so a sync row and an overlapped row use the same cores. The rows add the worker's
decode seconds per update (`worker_generation_seconds`), the learner's wait for them
(`worker_wait_seconds`) and the fraction of the decode hidden behind the learner's work
(`worker_hidden_fraction`); `time/generation` is then the learner's part (the wait and the validation
decode).

`--mode trl` (side by side) alternates blocks in this one process: round 1 ours then TRL, round 2
TRL then ours, ... (`--rounds`), each a fresh run of `--updates` updates on the same random-init
checkpoints, the same queries, lengths, batch, epochs, dtype and torch threads. Per update:
- ours (ppo_left_padding.main): validation score (generation at T 0.01 of `--eval_batch_size`
  queries plus two reward-model calls; the stage has no switch to turn it off), rollout generation
  at T 0.7 in chunks of `--rollout_batch_size` queries, reference / value / reward forwards per
  chunk, KL rewards, GAE, whitening, then `--noptepochs` epochs over `--nminibatches` minibatches of
  micro-batches (policy + critic forward and backward, one AdamW step per minibatch), then logging;
- TRL (PPOTrainer.train(), its real loop): rollout generation at T 0.7 (stop token EOS, missing-EOS
  penalty 1), the same three forwards per chunk, KL rewards, GAE, whitening, the same PPO epochs and
  micro-batches (AdamW, lr 3e-6, eps 1e-5, weight decay 0.01, linear decay), logging through its
  callbacks; its sample generations are off (num_sample_generations 0), nothing goes to a hub or
  tracker, no checkpoint is saved, gradient checkpointing is off (as in ours). Its progress printer
  is removed. The reference and reward model are loaded in the dtype ours gives them (fp32 on CPU,
  bf16 with bf16 mixed precision).
Seconds per update on both sides are the wall time between consecutive end-of-update points (ours:
its per-update `Logger.log` call; TRL: `on_step_end`), i.e. the whole loop body; the first update of
each run is warm-up and is left out. Update k of a run is paired with update k of the other side's
run in the same round, and the ratio TRL seconds / ours seconds (> 1: ours is faster) is printed with
its min / median / max over the pairs. TRL's phases come from timing its module-level
`batch_generation`, `forward` (under no_grad: the reference) and `get_reward` (value or reward model).

`--forwards padded packed compiled`: each setting with the stage's padded forwards (`--no_packing`),
its default packed ones (real tokens only), and packed with `--compile_train`; in `--mode trl` each of
them runs against the round's TRL run. The side-by-side rows carry `padding_share`: padding's share of
the positions a padded scoring or training forward computes on the benchmark's batch.

Output in `--out`: ppo_speed.csv (+ ppo_speed.png) and trl_side_by_side.csv (+ trl_side_by_side.png).
Timings on a machine shared with other work are noisy; compare numbers from one run.
"""

import contextlib
import csv
import functools
import gc
import importlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402
from datasets import Dataset, DatasetDict, load_from_disk  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,  # noqa: E402
                          GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification,
                          PreTrainedTokenizerFast)

from summarize_from_feedback_details import ppo_left_padding as ppo  # noqa: E402
from summarize_from_feedback_details.infra.launch import quiet_libraries  # noqa: E402
from summarize_from_feedback_details.infra.lora import with_lora  # noqa: E402
from summarize_from_feedback_details.infra.ports import free_port  # noqa: E402
from summarize_from_feedback_details.infra.tracking import Logger  # noqa: E402
from summarize_from_feedback_details.tiny_models import SIZES as TINY_SIZES  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE_SCRIPT = os.path.join(REPO, "summarize_from_feedback_details", "ppo_left_padding.py")


@dataclass
class Args:
    mode: Literal["speed", "trl", "both"] = "speed"
    """speed: the table over shapes x strategies x micro-batches; trl: ours against TRL 1.12 side by
    side (one process, each shape, the first micro-batch size); both: one after the other"""
    shapes: list[str] = field(default_factory=lambda: ["tiny-s"])
    """model shapes (see SHAPES): tiny-s, tiny-m, tiny-l, 1m, 10m, pythia-160m, pythia-410m, pythia-1b,
    pythia-2.8b, pythia-6.9b"""
    strategies: list[Literal["single", "ddp", "zero2", "zero2-offload"]] = field(default_factory=lambda: ["single"])
    micro_batch_sizes: list[int] = field(default_factory=lambda: [16])
    variants: list[Literal["full", "lora"]] = field(default_factory=lambda: ["full"])
    """full: every weight of policy and critic trains; lora: the stage's --use_peft (adapters on every
    linear layer, the critic's head in full, the reference = the policy with its adapter disabled)"""
    lora_r: int = 16
    forwards: list[Literal["padded", "packed", "compiled"]] = field(default_factory=lambda: ["packed"])
    """the stage's scoring and training forwards: padded (--no_packing), packed (the default: real tokens
    only) or compiled (packed and --compile_train); each a setting of its own, in both modes"""
    samplers: list[Literal["sync", "sequential", "overlapped"]] = field(default_factory=lambda: ["sync"])
    """who samples the rollouts (speed mode): sync (today's loop, --async_steps 0), sequential (--async_steps
    ASYNC_STEPS, sampled in the learner's process before it trains) or overlapped (the same rollouts sampled by
    a worker process while the learner trains: --async_worker: on a CPU the learner's, on GPUs the second where
    there are two; one process only)"""
    async_steps: int = 1
    """the rollouts' age in updates of the sequential and overlapped samplers"""
    worker_threads: int = 1
    """overlapped on a CPU: the worker's torch threads, taken from the setting's (the learner keeps the rest,
    at least one), so that sync and overlapped rows use the same cores"""
    """per-process micro-batch sizes, capped at the per-process batch (which each must divide)"""
    num_processes: int = 2
    """processes of the ddp / zero2 strategies (one GPU each on GPUs)"""
    batch_size: int = 16
    """queries per update, over all processes"""
    query_length: int = 128
    response_length: int = 53
    temperature: float = 0.7
    noptepochs: int = 4
    nminibatches: int = 1
    eval_batch_size: int = 2
    """queries per process of ours' per-update validation score (the stage's default)"""
    rollout_batch_size: Optional[int] = None
    """queries per generation / scoring chunk per process (default: the whole per-process batch)"""
    updates: int = 4
    """updates per run; the first is warm-up and not counted"""
    rounds: int = 2
    """side by side: blocks of (ours run, TRL run), the order flipping every round"""
    threads: Optional[int] = None
    """torch threads per process (default: this process's for one process; cores / processes for more)"""
    seed: int = 1
    out: str = "runs/ppo_speed"
    """CSV, PNG and the runs' own folders (work/runs/<run_name>/)"""
    cache_dir: str = os.path.join(tempfile.gettempdir(), "ppo_speed_cache")
    """random-init checkpoints and synthetic datasets, reused across runs"""
    matmul_size: Optional[int] = None
    """side of the square matmul timing the peak (default 2048 on CPU, 8192 on a GPU)"""


# GPT-NeoX shapes as GPTNeoXConfig kwargs (Pythia's architecture: parallel residual, rotary on a
# quarter of each head, untied embeddings). The Pythia ones are EleutherAI's configs; 1m and 10m use
# the tiny tokenizer's vocabulary, since 50304 embeddings alone would be over 1M parameters.
PYTHIA = dict(vocab_size=50304, max_position_embeddings=2048)
SHAPES = {
    **{f"tiny-{size}": dict(vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=4 * hidden) for size, (hidden, layers, heads) in TINY_SIZES.items()},
    "1m": dict(vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512),
    "10m": dict(vocab_size=1024, hidden_size=256, num_hidden_layers=12, num_attention_heads=4, intermediate_size=1024),
    "pythia-160m": dict(**PYTHIA, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072),
    "pythia-410m": dict(**PYTHIA, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096),
    "pythia-1b": dict(**PYTHIA, hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192),
    "pythia-2.8b": dict(**PYTHIA, hidden_size=2560, num_hidden_layers=32, num_attention_heads=32,
                        intermediate_size=10240),
    "pythia-6.9b": dict(**PYTHIA, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                        intermediate_size=16384),
}
EOS_ID, PAD_ID = 0, 1


# ---------------------------------------------------------------------------------------------
# models, tokenizer, queries
# ---------------------------------------------------------------------------------------------


def model_config(shape: str, **overrides) -> GPTNeoXConfig:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    return GPTNeoXConfig(**{"max_position_embeddings": 2048, **SHAPES[shape]}, rotary_pct=0.25,
                         use_parallel_residual=True, attention_dropout=0.0, hidden_dropout=0.0,
                         tie_word_embeddings=False, bos_token_id=EOS_ID, eos_token_id=EOS_ID, **overrides)


@functools.lru_cache
def matmul_params(shape: str) -> tuple:
    """(policy, critic) parameters that take part in matmuls: all but the input embedding (a lookup).
    Counted on the meta device, so even 6.9B costs nothing."""
    config = model_config(shape)
    with torch.device("meta"):
        policy = GPTNeoXForCausalLM(config)
        critic = GPTNeoXForSequenceClassification(model_config(shape, num_labels=1))
    embedding = config.vocab_size * config.hidden_size
    return (sum(p.numel() for p in policy.parameters()) - embedding,
            sum(p.numel() for p in critic.parameters()) - embedding)


def total_params(shape: str) -> int:
    """Parameters of the policy, embeddings included (what "1m" / "pythia-1b" name)."""
    return matmul_params(shape)[0] + model_config(shape).vocab_size * model_config(shape).hidden_size


def trainable_params(shape: str, variant: str, lora_r: int) -> int:
    """Parameters the optimizer updates in policy + critic: all of them, or with LoRA the adapters
    and the critic's head (counted on models built on the meta device: no memory, any size)."""
    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(model_config(shape))
        critic = AutoModelForSequenceClassification.from_config(model_config(shape, num_labels=1))
        if variant == "lora":
            lora = ppo.Args(use_peft=True, lora_r=lora_r)
            policy, critic = with_lora(policy, lora), with_lora(critic, lora, head="score")
    return sum(p.numel() for model in (policy, critic) for p in model.parameters() if p.requires_grad)


def process_memory_kib(field: str) -> int:
    """A memory line of /proc/self/status (Linux): VmRSS (resident now) or VmHWM (its peak)."""
    with open("/proc/self/status") as f:
        (line,) = [line for line in f if line.startswith(f"{field}:")]
    return int(line.split()[1])


def reset_peak_memory(device: str) -> int:
    """Starts a peak-memory measurement: CUDA's allocator peak, or on Linux the resident-set
    high-water mark (writing 5 to /proc/self/clear_refs resets it). Returns the baseline (KiB
    resident now; 0 on a GPU, whose counter starts empty)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return 0
    if not os.path.exists("/proc/self/clear_refs"):
        return -1
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return process_memory_kib("VmRSS")


def peak_memory_gib(device: str, baseline: int) -> float:
    """GiB the run added at its peak: on a GPU the tensors' peak, on a CPU the resident-set peak
    above `baseline` (models, optimizer state, activations, allocator slack; the libraries were
    loaded before); NaN where it cannot be read."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 30
    if baseline < 0:
        return math.nan
    return (process_memory_kib("VmHWM") - baseline) / 2 ** 20


def synthetic_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with exactly `vocab_size` ids, so no embedding gets resized and every
    sampled id decodes: EOS 0, `[PAD]` 1 (a dedicated pad, as the stages require), then t2, t3, ...; text
    of those words separated by spaces reads back to the same ids (what a trainer that reads text needs:
    grpo_vs_trl.py's TRL side)."""
    vocab = {"<|endoftext|>": EOS_ID, "[PAD]": PAD_ID, **{f"t{i}": i for i in range(2, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="[PAD]", model_max_length=2048)


def build_checkpoints(shape: str, cache_dir: str, seed: int) -> tuple:
    """(sft_path, reward_model_path) of randomly initialised models of `shape`, built once. Saved in
    bf16 above 1B parameters (the stages load fp32 master weights anyway): half the disk."""
    folder = os.path.join(cache_dir, f"{shape}_seed{seed}")
    sft_path, rm_path = os.path.join(folder, "sft"), os.path.join(folder, "reward_model")
    if os.path.exists(os.path.join(folder, "done")):
        return sft_path, rm_path
    config = model_config(shape)
    dtype = torch.bfloat16 if total_params(shape) > 1e9 else torch.float32
    tokenizer = synthetic_tokenizer(config.vocab_size)
    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_config(config, dtype=dtype)
    policy.save_pretrained(sft_path)
    tokenizer.save_pretrained(sft_path)
    del policy
    torch.manual_seed(seed + 1)
    # what reward.py saves: the backbone with a scalar head that reads the EOS (the last non-pad token)
    reward = AutoModelForSequenceClassification.from_config(model_config(shape, num_labels=1, pad_token_id=PAD_ID),
                                                            dtype=dtype)
    reward.save_pretrained(rm_path)
    tokenizer.save_pretrained(rm_path)
    open(os.path.join(folder, "done"), "w").close()
    return sft_path, rm_path


def left_padded_queries(n: int, query_length: int, vocab_size: int, generator: np.random.Generator) -> list:
    """`n` rows of random tokens (never EOS or pad), real lengths uniform in [query_length / 2,
    query_length], left-padded with [PAD]."""
    rows = []
    for _ in range(n):
        length = int(generator.integers(max(1, query_length // 2), query_length + 1))
        rows.append([PAD_ID] * (query_length - length) + generator.integers(2, vocab_size, length).tolist())
    return rows


def reference_responses(n: int, response_length: int, vocab_size: int, generator: np.random.Generator) -> list:
    """Right-padded reference summaries ending with EOS, as tldr_dataset.py writes them."""
    rows = []
    for _ in range(n):
        length = int(generator.integers(1, response_length))
        rows.append(generator.integers(2, vocab_size, length).tolist() + [EOS_ID]
                    + [PAD_ID] * (response_length - length - 1))
    return rows


def build_query_dataset(cache_dir: str, batch_size: int, query_length: int, response_length: int, vocab_size: int,
                        seed: int, validation_size: int = 64) -> str:
    """A `save_to_disk` folder with the columns ppo_left_padding.py reads. The train split is one
    global batch: every update of every run rolls out the same queries."""
    folder = os.path.join(cache_dir, f"queries_b{batch_size}_q{query_length}_r{response_length}_v{vocab_size}_s{seed}")
    if os.path.exists(os.path.join(folder, "done")):
        return folder
    generator = np.random.default_rng(seed)
    splits = {}
    for split, n in (("train", batch_size), ("validation", validation_size)):
        splits[split] = Dataset.from_dict({
            "query_token": left_padded_queries(n, query_length, vocab_size, generator),
            "reference_response_token": reference_responses(n, response_length, vocab_size, generator),
        })
    DatasetDict(splits).save_to_disk(folder)
    open(os.path.join(folder, "done"), "w").close()
    return folder


# ---------------------------------------------------------------------------------------------
# the device's peak and the FLOPs of an update
# ---------------------------------------------------------------------------------------------


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def matmul_peak(device: str, threads: int, size: Optional[int] = None, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` square matmuls: fp32 with `threads` threads on the CPU, bf16 on
    a GPU. What this device really sustains on the op that dominates training, not a datasheet."""
    size = size or (8192 if device == "cuda" else 2048)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        best = math.inf
        for _ in range(repeats + 1):  # (the first one warms up)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            a @ b
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved)
    return 2 * size ** 3 / best


def memory_bandwidth(device: str, threads: int, megabytes: Optional[int] = None, repeats: int = 5) -> float:
    """Bytes/s of the best of `repeats` copies of a large buffer (each byte read once and written
    once): what a decode step that streams the weights and the KV cache can hope for here."""
    n = (megabytes or (2048 if device == "cuda" else 256)) * 2 ** 20 // 4
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source, target = torch.ones(n, device=device), torch.empty(n, device=device)
        best = math.inf
        for _ in range(repeats + 1):  # (the first one warms up)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            target.copy_(source)
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved)
    return 2 * 4 * n / best


def decode_step_bytes(shape: str, rows: int, context: int, weight_bytes: int, cache_bytes: int) -> int:
    """What one decode step must read at least: the policy's matmul weights once (the input embedding
    is a lookup of one row per token) and the whole static KV cache of its batch (keys and values of
    every layer for `context` = query + response positions: the step attends over all of it)."""
    config = model_config(shape)
    policy_params, _ = matmul_params(shape)
    cache = 2 * config.num_hidden_layers * config.hidden_size * context * rows
    return policy_params * weight_bytes + cache * cache_bytes


def flops_per_update(policy_params: int, critic_params: int, batch_size: int, eval_queries: int, query_length: int,
                     response_length: int, epochs: int) -> float:
    """The module docstring's estimate: useful FLOPs of one PPO update over the global batch."""
    tokens = batch_size * (query_length + response_length)
    trained = 6 * (policy_params + critic_params) * tokens * epochs
    rollout = 2 * (2 * policy_params + 2 * critic_params) * tokens
    validation = 2 * (policy_params + 2 * critic_params) * eval_queries * (query_length + response_length)
    return trained + rollout + validation


def epoch_flops(policy_params: int, critic_params: int, batch_size: int, query_length: int, response_length: int,
                epochs: int) -> float:
    """The PPO epochs' share of `flops_per_update`: 6 x (policy + critic params) x tokens x epochs."""
    return 6 * (policy_params + critic_params) * batch_size * (query_length + response_length) * epochs


# ---------------------------------------------------------------------------------------------
# ours: ppo_left_padding.py through its CLI
# ---------------------------------------------------------------------------------------------


@dataclass
class Setting:
    """One measured configuration of the PPO stage."""
    shape: str
    strategy: str
    num_processes: int
    micro_batch_size: int
    threads: int
    variant: str = "full"
    forwards: str = "packed"
    sampler: str = "sync"


def stage_args(args: Args, setting: Setting, sft_path: str, rm_path: str, dataset: str, run_name: str) -> ppo.Args:
    local_batch = args.batch_size // setting.num_processes
    stage = ppo.Args(
        base_model=sft_path, sft_model_path=sft_path, reward_model_path=rm_path, query_dataset=dataset,
        run_name=run_name, seed=args.seed, output_dir="", print_sample_output_freq=0,
        response_length=args.response_length, temperature=args.temperature,
        total_episodes=args.updates * args.batch_size, nminibatches=args.nminibatches,
        local_micro_batch_size=setting.micro_batch_size,
        gradient_accumulation_steps=local_batch // (args.nminibatches * setting.micro_batch_size),
        local_rollout_forward_batch_size=args.rollout_batch_size or local_batch,
        local_eval_batch_size=args.eval_batch_size,
        deepspeed=setting.strategy.startswith("zero2"), offload=setting.strategy == "zero2-offload",
    )
    stage.ppo.noptepochs = args.noptepochs
    if setting.variant == "lora":
        stage.use_peft, stage.lora_r = True, args.lora_r
    stage.packing, stage.compile_train = setting.forwards != "padded", setting.forwards == "compiled"
    if setting.sampler != "sync":
        stage.async_steps = args.async_steps
    if setting.sampler == "overlapped":
        # (a GPU of its own where there are two: generation beside training, the asynchronous RLHF paper's setup)
        stage.async_worker = "cpu" if not torch.cuda.is_available() else "cuda:1" if torch.cuda.device_count() > 1 \
            else "cuda:0"
        stage.async_worker_threads = args.worker_threads
    return stage


def cli_flags(stage: ppo.Args) -> list:
    """The command line that gives `stage` (the fields that differ from the stage's defaults)."""
    default, flags = ppo.Args(), []
    for key, value in vars(stage).items():
        if key == "ppo":
            flags += [f"--ppo.{k}={v}" for k, v in vars(value).items() if getattr(default.ppo, k) != v]
        elif getattr(default, key) != value:
            flags.append(f"--{key}" if value is True else f"--no_{key}" if value is False else f"--{key}={value}")
    return flags


# the launched runs' rendezvous ports: below the ephemeral range (infra/ports.py) and below the tests' own
# launches (tests/conftest.py draws from 20000 up), so a sweep run by a test never meets one of theirs
PORTS = range(10000, 20000)


def launch_command(setting: Setting, device: str) -> list:
    """`accelerate launch` for the multi-process strategies: gloo DDP or DeepSpeed ZeRO-2."""
    launcher = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch",
                "--num_processes", str(setting.num_processes), "--main_process_port", str(free_port(PORTS))]
    if setting.strategy == "ddp":
        return launcher + ["--multi_gpu"] + (["--mixed_precision", "bf16"] if device == "cuda" else [])
    config = (os.path.join(REPO, "deepspeed.yaml") if device == "cuda"
              else os.path.join(REPO, "tests", "accelerate_configs", "deepspeed_zero2_cpu.yaml"))
    return launcher + ["--config_file", config]


@contextlib.contextmanager
def environment(**variables):
    """os.environ with `variables` set (None: removed), restored afterwards."""
    saved = {k: os.environ.get(k) for k in variables}
    for key, value in variables.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def release_memory() -> None:
    """Called before a run loads its models: the previous run's are gone by then (one GPU holds one
    run at a time)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def end_of_update_times(times: list):
    """Appends time.perf_counter() at each per-update `Logger.log` call of the stage (its last step
    of an update), without touching the stage's file."""
    original = Logger.log

    def log(self, metrics, step):
        original(self, metrics, step)
        times.append(time.perf_counter())

    Logger.log = log
    try:
        yield
    finally:
        Logger.log = original


def run_ours_in_process(stage, workdir: str, device: str, threads: int, stage_main=ppo.main) -> list:
    """`stage_main(stage)` (ppo_left_padding.main; grpo_vs_trl.py: rloo.main) in this process, from
    `workdir` (its runs/ folder lands there); returns the wall times of the ends of its updates."""
    from accelerate.state import AcceleratorState, GradientState

    release_memory()
    cwd, saved_threads, times = os.getcwd(), torch.get_num_threads(), []
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    torch.set_num_threads(threads)
    try:
        with environment(ACCELERATE_MIXED_PRECISION="bf16" if device == "cuda" else "no",
                         HF_HUB_OFFLINE="1"), end_of_update_times(times):
            stage_main(stage)
    finally:
        os.chdir(cwd)
        torch.set_num_threads(saved_threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        # accelerate keeps process-wide singletons: the next run (ours or TRL) starts clean
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return times


def run_ours_launched(stage: ppo.Args, setting: Setting, workdir: str, device: str, updates: int,
                      console: Console) -> None:
    """The stage under `accelerate launch`. A rank that a signal killed after the run logged all its
    updates (seen twice in CI: "terminate called without an active exception", SIGABRT, as a gloo
    rank exits) leaves a complete measurement but a failed launch: that run is started once more."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS=str(setting.threads))
    if setting.strategy == "ddp" and device == "cpu":
        env["ACCELERATE_USE_CPU"] = "1"  # gloo DDP on CPU processes (DeepSpeed reads use_cpu from its yaml)
    os.makedirs(workdir, exist_ok=True)
    run_folder = os.path.join(workdir, "runs", stage.run_name)
    for attempt in (1, 2):
        shutil.rmtree(run_folder, ignore_errors=True)  # (metrics.jsonl is appended to)
        result = subprocess.run(launch_command(setting, device) + [STAGE_SCRIPT, *cli_flags(stage)], cwd=workdir,
                                env=env, capture_output=True, text=True)
        if result.returncode == 0:
            return
        log = os.path.join(workdir, f"{stage.run_name}.log")
        with open(log, "w") as f:
            f.write(result.stdout + result.stderr)
        failure = f"exit status {result.returncode}: {launched_failure(result.stderr)} (whole output: {log})"
        if attempt == 1 and died_after_finishing(result.stderr, logged_updates(run_folder), updates):
            console.print(f"[yellow]warning:[/] a rank was killed by a signal after the run's last update "
                          f"({failure}); running it again", highlight=False)
            continue
        raise RuntimeError(failure)


def logged_updates(run_folder: str) -> int:
    """How many updates a run logged (its metrics.jsonl lines with time/update)."""
    path = os.path.join(run_folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        return sum("time/update" in json.loads(line) for line in f if line.strip())


def died_after_finishing(stderr: str, logged: int, updates: int) -> bool:
    """Whether a launched run failed only in its ranks' exit: every update logged, and the launcher
    reports a rank killed by a signal (a negative exit code) rather than one that raised."""
    return logged == updates and re.search(r"exitcode\s*:\s*-\d+", stderr) is not None \
        and not EXCEPTION_LINE.search(launched_failure(stderr))


def read_metrics(workdir: str, run_name: str) -> list:
    with open(os.path.join(workdir, "runs", run_name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def phase_seconds(metrics: list) -> dict:
    """phase -> seconds per update, for every `time/<phase>` the stage logs (`time/update` aside)."""
    names = sorted({k for m in metrics for k in m if k.startswith("time/") and k != "time/update"})
    return {name[len("time/"):]: [m.get(name, 0.0) for m in metrics] for name in names}


def measure_ours(args: Args, setting: Setting, workdir: str, device: str, console: Console) -> dict:
    """Runs the stage once; per-update seconds and phases without the warm-up update."""
    config = model_config(setting.shape)
    sft_path, rm_path = build_checkpoints(setting.shape, args.cache_dir, args.seed)
    dataset = build_query_dataset(args.cache_dir, args.batch_size, args.query_length, args.response_length,
                                  config.vocab_size, args.seed)
    name = (f"{setting.shape}_{setting.strategy}{setting.num_processes}_mb{setting.micro_batch_size}_"
            f"{setting.variant}_{setting.forwards}_{setting.sampler}_{time.time_ns()}")
    stage = stage_args(args, setting, sft_path, rm_path, dataset, name)
    peak = math.nan  # (a launched run's processes are not this one)
    if setting.strategy == "single":
        release_memory()
        baseline = reset_peak_memory(device)
        run_ours_in_process(stage, workdir, device, setting.threads)
        peak = peak_memory_gib(device, baseline)
    else:
        run_ours_launched(stage, setting, workdir, device, args.updates, console)
    metrics = read_metrics(workdir, name)
    # overlapped: the worker's decode seconds, the learner's wait for them, the fraction hidden (medians)
    worker = {key[len("async/"):]: statistics.median(m[key] for m in metrics[1:]) for key in WORKER_METRICS
              if all(key in m for m in metrics[1:])}
    return {"seconds": [m["time/update"] for m in metrics[1:]], "phases": phase_seconds(metrics[1:]),
            "peak_memory_gib": peak, "worker": worker}


WORKER_METRICS = ("async/worker_generation_seconds", "async/worker_wait_seconds", "async/worker_hidden_fraction")


def summary_row(args: Args, setting: Setting, measured: dict, device: str, peak: float, bandwidth: float) -> dict:
    """One row of the table / CSV: medians over the measured updates."""
    seconds = measured["seconds"]
    median = statistics.median(seconds)
    policy_params, critic_params = matmul_params(setting.shape)
    eval_queries = args.eval_batch_size * setting.num_processes
    flops = flops_per_update(policy_params, critic_params, args.batch_size, eval_queries, args.query_length,
                             args.response_length, args.noptepochs)
    phases = {f"time/{k}": statistics.median(v) for k, v in measured["phases"].items()}
    # per update, then the median (a sum of medians can exceed the median of the sums)
    other = statistics.median(s - sum(v[i] for v in measured["phases"].values()) for i, s in enumerate(seconds))
    generation = phases.get("time/generation")
    # the decode floor: one decode of the validation + rollout rows per process (the stage's default
    # --local_generation_batch_size with the whole batch as one chunk), `response_length` steps;
    # weights in bf16 only where DeepSpeed holds them so (accelerate's bf16 autocasts fp32 weights)
    rows = args.eval_batch_size + args.batch_size // setting.num_processes
    weight_bytes = 2 if device == "cuda" and setting.strategy.startswith("zero2") else 4
    step_bytes = decode_step_bytes(setting.shape, rows, args.query_length + args.response_length, weight_bytes,
                                   2 if device == "cuda" else 4)
    return {
        "shape": setting.shape, "params": total_params(setting.shape), "strategy": setting.strategy,
        "variant": setting.variant, "forwards": setting.forwards, "sampler": setting.sampler,
        "async_steps": 0 if setting.sampler == "sync" else args.async_steps,
        "trainable_params": trainable_params(setting.shape, setting.variant, args.lora_r),
        "peak_memory_gib": measured["peak_memory_gib"],
        "processes": setting.num_processes, "micro_batch": setting.micro_batch_size, "batch": args.batch_size,
        "query_length": args.query_length, "response_length": args.response_length, "device": device,
        "precision": "bf16" if device == "cuda" else "fp32", "threads": setting.threads,
        "updates_measured": len(seconds), "s_per_update": median, "s_per_update_min": min(seconds),
        "s_per_update_max": max(seconds), **phases, "other_s": other,
        "tokens_per_s": args.batch_size * (args.query_length + args.response_length) / median,
        # response tokens of the global batch per second of (rank 0's) generation: ranks generate at once
        "generated_tokens_per_s": (args.batch_size * args.response_length / generation) if generation else math.nan,
        # generation phase per decode step (its prefill included) against the bandwidth floor
        "decode_ms_per_step": (1e3 * generation / args.response_length) if generation else math.nan,
        "floor_ms_per_step": 1e3 * step_bytes / bandwidth, "bandwidth_gb_s": bandwidth / 1e9,  # (per process)
        "tflop_per_update": flops / 1e12, "achieved_tflops": flops / median / 1e12, "peak_tflops": peak / 1e12,
        "utilisation": flops / median / peak,
        # the epochs alone: their FLOPs over rank 0's `time/ppo_epochs` (forward, backward, optimizer steps)
        "epoch_utilisation": (epoch_flops(policy_params, critic_params, args.batch_size, args.query_length,
                                          args.response_length, args.noptepochs) / phases["time/ppo_epochs"] / peak
                              if phases.get("time/ppo_epochs") else math.nan),
        **measured.get("worker", {}), "status": "ok",
    }


def speed_settings(args: Args, device: str) -> list:
    """Every (shape, strategy, micro-batch) asked for, with its process and thread counts."""
    settings = []
    for shape in args.shapes:
        for strategy in args.strategies:
            processes = 1 if strategy == "single" else args.num_processes
            if device == "cuda" and strategy != "single":
                processes = min(processes, torch.cuda.device_count())
            default_threads = torch.get_num_threads() if processes == 1 else max(1, available_cores() // processes)
            local_batch = max(1, args.batch_size // processes)
            # a micro-batch larger than a process's share of the batch means "all of it"
            for micro in dict.fromkeys(min(m, local_batch) for m in args.micro_batch_sizes):
                for variant, forwards, sampler in itertools.product(args.variants, args.forwards, args.samplers):
                    threads = args.threads or default_threads
                    if sampler == "overlapped" and device == "cpu":
                        threads = max(1, threads - args.worker_threads)  # (the worker's cores are the setting's)
                    settings.append(Setting(shape, strategy, processes, micro, threads, variant, forwards, sampler))
    return settings


def check_setting(args: Args, setting: Setting) -> Optional[str]:
    """Why a setting cannot run (batch arithmetic), or None."""
    if setting.strategy == "ddp" and setting.num_processes < 2:
        return "DDP needs 2 or more processes (one GPU each)"
    if setting.sampler == "overlapped" and setting.strategy != "single":
        return "the overlapped sampler is measured on one process"
    if args.batch_size % setting.num_processes:
        return f"batch {args.batch_size} not divisible by {setting.num_processes} processes"
    local = args.batch_size // setting.num_processes
    if local % (args.nminibatches * setting.micro_batch_size):
        return f"per-process batch {local} not divisible by {args.nminibatches} minibatches x micro-batch " \
               f"{setting.micro_batch_size}"
    return None


# the last line of a Python traceback: "ValueError: ...", "torch.OutOfMemoryError: ..."
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*$")
# what the launcher (torchrun's agent) raises about its ranks, not what went wrong in them
LAUNCHER_ERRORS = ("ChildFailedError", "CalledProcessError", "SignalException")


def launched_failure(stderr: str) -> str:
    """What a rank of a launched run died of: the last exception line of the ranks' tracebacks, not
    the launcher's ChildFailedError summary that follows them; else the launcher's last line."""
    lines = [line.rstrip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if EXCEPTION_LINE.match(line) and not any(e in line for e in LAUNCHER_ERRORS)]
    return (errors or lines or ["no output"])[-1]


def failure_reason(error: Exception) -> str:
    """A failure's first line, for the table's status column."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines or [type(error).__name__])[0][:300]


def run_speed(args: Args, device: str, console: Console) -> list:
    if "lora" in args.variants:  # the stage imports peft for LoRA runs: here, outside their memory measurement
        importlib.import_module("peft")
    rows, peaks, bandwidths = [], {}, {}
    for setting in speed_settings(args, device):
        base = {"shape": setting.shape, "strategy": setting.strategy, "processes": setting.num_processes,
                "micro_batch": setting.micro_batch_size, "variant": setting.variant, "forwards": setting.forwards,
                "sampler": setting.sampler, "device": device}
        problem = check_setting(args, setting)
        if problem:
            rows.append({**base, "status": f"skipped: {problem}"})
            continue
        console.print(f"[bold]{setting.shape}[/] {setting.strategy} x{setting.num_processes} micro-batch "
                      f"{setting.micro_batch_size} {setting.variant} {setting.sampler}, {setting.threads} thread(s) "
                      "per process",
                      highlight=False)
        # the peak this setting's hardware share can give: all its threads (CPU) or all its GPUs
        peak_threads = min(available_cores(), setting.threads * setting.num_processes) if device == "cpu" else 1
        if peak_threads not in peaks:
            peaks[peak_threads] = matmul_peak(device, peak_threads, args.matmul_size)
        peak = peaks[peak_threads] * (setting.num_processes if device == "cuda" else 1)
        if peak_threads not in bandwidths:
            bandwidths[peak_threads] = memory_bandwidth(device, peak_threads)
        # each process decodes its own rows at once: on a CPU they share the one memory bus
        bandwidth = bandwidths[peak_threads] / (1 if device == "cuda" else setting.num_processes)
        try:
            measured = measure_ours(args, setting, os.path.join(args.out, "work"), device, console)
        except Exception as e:  # one shape out of memory must not end a sweep
            console.print(f"[red]failed[/]: {e}", highlight=False)
            rows.append({**base, "status": f"failed: {failure_reason(e)}"})
            continue
        rows.append(summary_row(args, setting, measured, device, peak, bandwidth))
    return rows


# ---------------------------------------------------------------------------------------------
# TRL 1.12 side by side
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def trl_phase_timers(trainer, phases: dict, device: str):
    """Seconds of TRL's generation and no-grad forwards, summed per phase and update: wraps the
    module-level functions its train() calls (restored afterwards)."""
    from trl.experimental.ppo import ppo_trainer as module

    def wait():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(function, phase_of):
        def wrapper(*a, **kw):
            wait()
            start = time.perf_counter()
            try:
                return function(*a, **kw)
            finally:
                wait()
                phase = phase_of(*a)
                if phase:
                    phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start
        return wrapper

    originals = {name: getattr(module, name) for name in ("batch_generation", "forward", "get_reward")}
    module.batch_generation = timed(originals["batch_generation"], lambda *a: "generation")
    # forward() without gradients is the reference's (the training forward has them)
    module.forward = timed(originals["forward"], lambda *a: None if torch.is_grad_enabled() else "reference_forward")
    module.get_reward = timed(originals["get_reward"],
                              lambda model, *a: "reward_forward" if model is trainer.reward_model else "value_forward")
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(module, name, function)


def run_trl(args: Args, shape: str, micro_batch_size: int, threads: int, device: str, workdir: str) -> dict:
    """One PPOTrainer.train() of `args.updates` updates; per-update seconds (wall time between
    consecutive on_step_end calls, the first update left out) and phases."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # (its "experimental" import warning)
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    release_memory()
    config = model_config(shape)
    sft_path, rm_path = build_checkpoints(shape, args.cache_dir, args.seed)
    queries = DatasetDict.load_from_disk(build_query_dataset(
        args.cache_dir, args.batch_size, args.query_length, args.response_length, config.vocab_size, args.seed))
    frozen = torch.bfloat16 if device == "cuda" else torch.float32  # as ours' frozen_dtype
    tokenizer = AutoTokenizer.from_pretrained(sft_path)
    policy = AutoModelForCausalLM.from_pretrained(sft_path, dtype=torch.float32)
    ref_policy = AutoModelForCausalLM.from_pretrained(sft_path, dtype=frozen)
    value_model = AutoModelForSequenceClassification.from_pretrained(rm_path, num_labels=1, dtype=torch.float32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(rm_path, num_labels=1, dtype=frozen)
    rollout = args.rollout_batch_size or args.batch_size
    trl_args = PPOConfig(
        output_dir=os.path.join(workdir, "trl"), seed=args.seed, report_to="none", save_strategy="no",
        push_to_hub=False, disable_tqdm=True, logging_steps=1, num_sample_generations=0,
        per_device_train_batch_size=micro_batch_size, gradient_accumulation_steps=args.batch_size // micro_batch_size,
        num_mini_batches=args.nminibatches, num_ppo_epochs=args.noptepochs,
        total_episodes=args.updates * args.batch_size, local_rollout_forward_batch_size=rollout,
        response_length=args.response_length, temperature=args.temperature, stop_token="eos",
        missing_eos_penalty=1.0, learning_rate=3e-6, adam_epsilon=1e-5, weight_decay=0.01,
        lr_scheduler_type="linear", bf16=device == "cuda", use_cpu=device == "cpu",
        # (its gradient_checkpointing, True by default, is never applied by PPOTrainer: nothing to turn off)
    )
    train = Dataset.from_dict({"input_ids": queries["train"]["query_token"]})
    return timed_trl_training(lambda callback: PPOTrainer(
        args=trl_args, processing_class=tokenizer, model=policy, ref_model=ref_policy, reward_model=reward_model,
        value_model=value_model, train_dataset=train, callbacks=[callback]), trl_phase_timers, threads, device)


def timed_trl_training(make_trainer, phase_timers, threads: int, device: str) -> dict:
    """A TRL trainer's train(), the trainer built by `make_trainer(callback)` and timed by
    `phase_timers(trainer, phases, device)`: per-update seconds (the wall time between consecutive
    on_step_end calls, the first update left out) and phases. grpo_vs_trl.py's TRL side too."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback

    times, phases, per_update = [], {}, []

    class EndOfUpdate(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            times.append(time.perf_counter())

        def on_step_end(self, *a, **kw):
            times.append(time.perf_counter())
            per_update.append(dict(phases))
            phases.clear()

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with environment(ACCELERATE_MIXED_PRECISION="bf16" if device == "cuda" else "no", HF_HUB_OFFLINE="1"):
            trainer = make_trainer(EndOfUpdate())
            for printer in (PrinterCallback, ProgressCallback):  # its console output is not the benchmark
                trainer.remove_callback(printer)
            with phase_timers(trainer, phases, device):
                trainer.train()
    finally:
        torch.set_num_threads(saved_threads)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    seconds = np.diff(times).tolist()
    return {"seconds": seconds[1:], "phases": {k: [u.get(k, 0.0) for u in per_update[1:]]
                                               for k in sorted({k for u in per_update for k in u})}}


def padding_share(dataset: str, response_length: int) -> float:
    """Padding's share of the positions a padded scoring or training forward computes on the train
    batch: queries without the columns every row pads, then full-length responses (random weights
    almost never sample EOS, so the reward model's rows are as long)."""
    real = np.array(load_from_disk(dataset)["train"]["query_token"]) != PAD_ID
    real = real[:, real.any(0).argmax():]
    responses = len(real) * response_length
    return 1 - (real.sum() + responses) / (real.size + responses)


def measure_ours_side_by_side(args: Args, shape: str, micro_batch_size: int, threads: int, device: str,
                              workdir: str, forwards: str) -> dict:
    """One ppo_left_padding run in this process; seconds between the ends of consecutive updates
    (as TRL's), the stage's own phases."""
    config = model_config(shape)
    sft_path, rm_path = build_checkpoints(shape, args.cache_dir, args.seed)
    dataset = build_query_dataset(args.cache_dir, args.batch_size, args.query_length, args.response_length,
                                  config.vocab_size, args.seed)
    name = f"{shape}_{forwards}_vs_trl_{time.time_ns()}"
    setting = Setting(shape, "single", 1, micro_batch_size, threads, forwards=forwards)
    times = run_ours_in_process(stage_args(args, setting, sft_path, rm_path, dataset, name), workdir, device, threads)
    metrics = read_metrics(workdir, name)
    return {"seconds": np.diff(times).tolist(), "phases": phase_seconds(metrics[1:]),
            "stage_seconds": [m["time/update"] for m in metrics[1:]],
            "padding_share": padding_share(dataset, args.response_length)}


def ratio_line(shape: str, ours: list, trl: list) -> str:
    """The printed comparison: TRL seconds / ours seconds per paired update (> 1: ours is faster)."""
    ratios = [t / o for o, t in zip(ours, trl)]
    return (f"ratio TRL / ours, seconds per update ({shape}): median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {len(ratios)} paired updates; "
            f"ours median {statistics.median(ours):.3f} s, TRL median {statistics.median(trl):.3f} s")


def run_side_by_side(args: Args, device: str, console: Console) -> list:
    """Alternating blocks of ours and TRL per shape; per-update rows, the ratio line and a phase table
    printed."""
    rows = []
    threads = args.threads or torch.get_num_threads()
    micro = min(args.micro_batch_sizes[0], args.batch_size)
    workdir = os.path.join(args.out, "work")
    for shape in args.shapes:
        for round_ in range(args.rounds):
            # every forwards setting of ours against the round's TRL run; the order flips every round
            sides = [*args.forwards, "trl"] if round_ % 2 == 0 else ["trl", *args.forwards]
            measured = {}
            for side in sides:
                console.print(f"[bold]{shape}[/] round {round_ + 1}: {'TRL' if side == 'trl' else f'ours, {side}'}",
                              highlight=False)
                if side == "trl":
                    measured[side] = run_trl(args, shape, micro, threads, device, workdir)
                else:
                    measured[side] = measure_ours_side_by_side(args, shape, micro, threads, device, workdir, side)
            for forwards in args.forwards:
                ours, trl = measured[forwards], measured["trl"]
                for k, (o, t) in enumerate(zip(ours["seconds"], trl["seconds"])):
                    row = {"shape": shape, "params": total_params(shape), "forwards": forwards, "round": round_ + 1,
                           "update": k + 2, "first": sides[0], "device": device, "threads": threads,
                           "micro_batch": micro, "batch": args.batch_size, "padding_share": ours["padding_share"],
                           "ours_s": o, "trl_s": t, "ratio_trl_over_ours": t / o,
                           # the stage's own time/update (its loop body minus logging), for comparison
                           "stage_time_update": ours["stage_seconds"][k]}
                    for side, side_measured, seconds in (("ours", ours, o), ("trl", trl, t)):
                        phases = {p: v[k] for p, v in side_measured["phases"].items()}
                        row.update({f"{side}_{p}": v for p, v in phases.items()})
                        row[f"{side}_other"] = seconds - sum(phases.values())
                    rows.append(row)
        for forwards in args.forwards:
            paired = [r for r in rows if r["shape"] == shape and r["forwards"] == forwards]
            print_side_by_side_phases(paired, console)
            console.print(ratio_line(f"{shape}, {forwards}", [r["ours_s"] for r in paired],
                                     [r["trl_s"] for r in paired]), highlight=False, soft_wrap=True)
    return rows


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------


def write_csv(rows: list, path: str) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))  # first-seen order, union of keys
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


# the stage's phases in the order an update runs them, with short labels for the tables
PHASE_LABELS = {"validation": "valid", "generation": "gen", "reference_forward": "ref fwd",
                "value_forward": "value fwd", "reward_forward": "rm fwd", "advantages": "adv",
                "ppo_epochs": "epochs", "other": "other"}


def ordered_phases(names) -> list:
    """Phase names in update order (unknown ones after the known, alphabetically)."""
    known = list(PHASE_LABELS)
    return sorted(set(names), key=lambda n: (known.index(n) if n in known else len(known), n))


def print_speed_table(rows: list, console: Console) -> None:
    phases = ordered_phases(k[len("time/"):] for row in rows for k in row if k.startswith("time/"))
    table = Table(title="ppo_left_padding.py: seconds per update (median over the measured updates)")
    for column in ["shape", "params", "strategy", "variant", "forwards", "sampler", "trainable", "proc", "micro",
                   "s/update", *[PHASE_LABELS.get(p, p) for p in phases], "other", "tok/s", "gen tok/s", "ms/step",
                   "floor ms", "TFLOP/upd", "util", "epoch util", "peak GiB", "worker gen", "hidden", "status"]:
        text = column in ("shape", "strategy", "variant", "forwards", "sampler", "status")
        table.add_column(column, justify="left" if text else "right", no_wrap=column != "status")
    for row in rows:
        ok = row.get("status") == "ok"

        def number(value, fmt):
            return format(value, fmt) if ok and value is not None and not math.isnan(value) else "-"

        table.add_row(row["shape"], f"{total_params(row['shape']) / 1e6:.1f}M", row["strategy"], row["variant"],
                      row["forwards"], row.get("sampler", "sync"),
                      f"{row['trainable_params'] / 1e6:.2f}M" if ok else "-",
                      str(row["processes"]), str(row["micro_batch"]), number(row.get("s_per_update"), ".3f"),
                      *[number(row.get(f"time/{p}"), ".3f") for p in phases], number(row.get("other_s"), ".3f"),
                      number(row.get("tokens_per_s"), ".0f"), number(row.get("generated_tokens_per_s"), ".0f"),
                      number(row.get("decode_ms_per_step"), ".2f"), number(row.get("floor_ms_per_step"), ".2f"),
                      number(row.get("tflop_per_update"), ".4f"), f"{row['utilisation']:.1%}" if ok else "-",
                      f"{row['epoch_utilisation']:.1%}" if ok else "-",
                      number(row.get("peak_memory_gib"), ".2f"), number(row.get("worker_generation_seconds"), ".3f"),
                      number(row.get("worker_hidden_fraction"), ".0%"), row["status"])
    # a wide console even in a pipe or a log: the table has a column per phase
    Console(width=max(console.width, 180)).print(table)


def print_side_by_side_phases(rows: list, console: Console, title: Optional[str] = None) -> None:
    """Median seconds per phase of each side (TRL's `other`: its PPO epochs, GAE and logging; ours'
    `other`: logging and what its phases leave out)."""
    title = title or (f"{rows[0]['shape']}, ours {rows[0]['forwards']} (padding {rows[0]['padding_share']:.0%} of "
                      "a padded forward's positions)")
    table = Table(title=f"{title}: median seconds per update and phase")
    for column in ("phase", "ours", "TRL 1.12"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase in ordered_phases(k.split("_", 1)[1] for r in rows for k in r
                                if k.startswith(("ours_", "trl_")) and k not in ("ours_s", "trl_s")):
        cells = [statistics.median(r[f"{side}_{phase}"] for r in rows) if f"{side}_{phase}" in rows[0] else None
                 for side in ("ours", "trl")]
        table.add_row(PHASE_LABELS.get(phase, phase), *["-" if c is None else f"{c:.3f}" for c in cells])
    table.add_row("update", *[f"{statistics.median(r[f'{side}_s'] for r in rows):.3f}" for side in ("ours", "trl")])
    Console(width=max(console.width, 100)).print(table)


def plot_speed(rows: list, path: str) -> None:
    """Stacked bars: each configuration's seconds per update split by phase (`other`: the rest)."""
    rows = [r for r in rows if r.get("status") == "ok"]
    if not rows:
        return
    phases = ordered_phases(k[len("time/"):] for r in rows for k in r if k.startswith("time/"))
    labels = [f"{r['shape']} {r['strategy']} x{r['processes']} mb{r['micro_batch']} {r['variant']} {r['forwards']}"
              for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.8))
    left = np.zeros(len(rows))
    for phase in phases + ["other"]:
        widths = np.array([r["other_s"] if phase == "other" else r.get(f"time/{phase}", 0.0) for r in rows]).clip(min=0)
        ax.barh(labels, widths, left=left, label=PHASE_LABELS.get(phase, phase))
        left += widths
    ax.set_xlabel("seconds per PPO update (median)")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # (beside the bars, not over them)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_side_by_side(rows: list, path: str) -> None:
    """Seconds per update of ours (each forwards setting) and TRL per paired update, one panel per shape."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 3.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r["shape"] == shape]
        settings = list(dict.fromkeys(r["forwards"] for r in mine))
        for forwards in settings:
            ours = [r for r in mine if r["forwards"] == forwards]
            ratio = statistics.median(r["ratio_trl_over_ours"] for r in ours)
            ax.plot([r["ours_s"] for r in ours], "o-", label=f"ppo_left_padding.py, {forwards} (x{ratio:.2f})")
        ax.plot([r["trl_s"] for r in mine if r["forwards"] == settings[0]], "s-", label="TRL 1.12 PPOTrainer")
        ax.set_title(f"{shape}: TRL / ours, median per paired update")
        ax.set_xlabel("paired update")
        ax.set_ylabel("seconds per update")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: Args) -> dict:
    """Runs what `args.mode` asks for; returns {"speed": rows, "trl": rows}."""
    quiet_libraries()
    if args.updates < 2:
        raise ValueError("--updates must be >= 2: the first update is warm-up")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    console = Console()
    # the stage runs from its own work folder (its runs/ lands there): every path absolute
    args.out, args.cache_dir = os.path.abspath(args.out), os.path.abspath(args.cache_dir)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.cache_dir, exist_ok=True)
    results = {}
    if args.mode in ("speed", "both"):
        rows = run_speed(args, device, console)
        write_csv(rows, os.path.join(args.out, "ppo_speed.csv"))
        plot_speed(rows, os.path.join(args.out, "ppo_speed.png"))
        print_speed_table(rows, console)
        results["speed"] = rows
    if args.mode in ("trl", "both"):
        rows = run_side_by_side(args, device, console)
        write_csv(rows, os.path.join(args.out, "trl_side_by_side.csv"))
        plot_side_by_side(rows, os.path.join(args.out, "trl_side_by_side.png"))
        results["trl"] = rows
    console.print(f"written to {args.out}/", highlight=False)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
