"""Seconds per GRPO update of rloo.py (`--algorithm grpo`, k samples per query) against TRL 1.12's
`GRPOTrainer` on identical settings, side by side in one process: issue 62's like-for-like row.

    python benchmarks/grpo_vs_trl.py --shapes 1m 10m                 # this CPU, fp32

The models, tokenizer and queries are ppo_speed.py's (random-init GPT-NeoX policy and reward model of
each shape, written once to `--cache_dir`; a word-level tokenizer of exactly the shape's vocabulary,
EOS id 0, `[PAD]` id 1; `--queries` random queries of real length in [query_length / 2, query_length]).
TRL's trainer reads text, so the queries reach it as their words ("t17 t942 ..."), which its tokenizer
reads back to the same ids; its reward model reads prompt + completion re-tokenized the same way.

Both sides, per update: `--queries` queries x `--k` samples at T `--temperature`, `--response_length`
new tokens (random weights almost never sample EOS: every response is full length on both sides), the
reference's log-probabilities, one reward-model call per sample, advantages (r - group mean) /
(group std + eps) with the Bessel-corrected std, one epoch of one minibatch of every sample in
micro-batches of `--micro_batch_size` samples, the per-token clipped ratio (0.2), the k3 KL term in the
loss at `--kl_coef` (TRL's `beta`), each response's token losses averaged, then over responses (TRL's
`loss_type="grpo"`), AdamW lr 3e-6, eps 1e-5, weight decay 0.01, linear decay. What differs and cannot
be turned off: ours also scores `--eval_batch_size` validation queries every update (a greedy decode and
two reward-model calls: the stage logs the policy's score on held-out queries), and takes the sampler's
log-probabilities from the generation logits where TRL, at one iteration, reuses the training forward's.

Rounds alternate the order (round 1 ours then TRL, round 2 TRL then ours, ...); each side is a fresh
run of `--updates` updates, the first a warm-up and left out. Seconds per update are the wall time
between consecutive end-of-update points (ours: its per-update `Logger.log` call; TRL: `on_step_end`).
Update k of a run is paired with update k of the other side's run in the same round; the ratio TRL
seconds / ours seconds (> 1: ours is faster) is printed with its min / median / max over the pairs.
Phases: ours' own `time/<phase>`; TRL's from timing its trainer's `_generate` (generation),
`_calculate_rewards` (reward_forward) and the no-grad calls of `_get_per_token_logps_and_entropies`
(reference_forward); `other` is the rest of the update (for both: mostly the training step).

Output in `--out`: grpo_vs_trl.csv (one row per paired update) and grpo_vs_trl.png.
Timings on a machine shared with other work are noisy; compare numbers from one run.
"""

import contextlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import tyro
from datasets import Dataset, DatasetDict
from rich.console import Console

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo_speed  # noqa: E402  (benchmarks/ is a folder of scripts: its models, queries and timing helpers)

from summarize_from_feedback_details import rloo  # noqa: E402
from summarize_from_feedback_details.infra.launch import quiet_libraries  # noqa: E402


@dataclass
class Args:
    shapes: list[str] = field(default_factory=lambda: ["1m", "10m"])
    """model shapes of ppo_speed.py (tiny-s, tiny-m, 1m, 10m, pythia-160m, ...)"""
    queries: int = 16
    """queries per update; an update trains on queries x k samples"""
    k: int = 4
    """samples per query (GRPO's group; TRL's num_generations)"""
    micro_batch_size: int = 16
    """samples per forward / backward in the training step (gradient accumulation makes up the rest)"""
    query_length: int = 128
    response_length: int = 53
    temperature: float = 0.7
    kl_coef: float = 0.05
    """the k3 KL term's coefficient in the loss (TRL's beta)"""
    eval_batch_size: int = 2
    """ours' per-update validation queries (the stage's default; it has no switch to turn them off)"""
    updates: int = 4
    """updates per run; the first is warm-up and not counted"""
    rounds: int = 2
    """blocks of (ours, TRL) runs, the order flipping every round"""
    threads: Optional[int] = None
    """torch threads (default: this process's)"""
    seed: int = 1
    out: str = "runs/grpo_vs_trl"
    cache_dir: str = os.path.join(tempfile.gettempdir(), "grpo_vs_trl_cache")
    """random-init checkpoints and synthetic queries, reused across runs"""


def stage_args(args: Args, sft_path: str, rm_path: str, dataset: str, run_name: str) -> rloo.Args:
    """rloo.py as GRPO on the benchmark's settings."""
    episodes = args.queries * args.k
    return rloo.Args(
        base_model=sft_path, sft_model_path=sft_path, reward_model_path=rm_path, query_dataset=dataset,
        run_name=run_name, seed=args.seed, output_dir="", print_sample_output_freq=0,
        algorithm="grpo", rloo_k=args.k, kl_coef=args.kl_coef, response_length=args.response_length,
        temperature=args.temperature, total_episodes=args.updates * episodes, nminibatches=1, noptepochs=1,
        local_micro_batch_size=args.micro_batch_size, gradient_accumulation_steps=episodes // args.micro_batch_size,
        local_rollout_forward_batch_size=args.queries, local_eval_batch_size=args.eval_batch_size,
    )


def prompt_texts(query_tokens: list) -> list:
    """The queries as TRL reads them: their words without the padding, ending in a space so that
    prompt + completion (TRL's reward-model input) splits into the same words."""
    return ["".join(f"t{i} " for i in row if i != ppo_speed.PAD_ID) for row in query_tokens]


def trl_config(args: Args, workdir: str, device: str):
    from trl import GRPOConfig

    episodes = args.queries * args.k
    return GRPOConfig(
        output_dir=os.path.join(workdir, "trl"), seed=args.seed, report_to="none", save_strategy="no",
        push_to_hub=False, disable_tqdm=True, logging_steps=1, log_completions=False, max_steps=args.updates,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=episodes // args.micro_batch_size, num_generations=args.k,
        max_completion_length=args.response_length, temperature=args.temperature, top_p=1.0, top_k=0,
        beta=args.kl_coef, num_iterations=1, epsilon=0.2, loss_type="grpo", scale_rewards="group",
        learning_rate=3e-6, adam_epsilon=1e-5, weight_decay=0.01, lr_scheduler_type="linear",
        gradient_checkpointing=False, bf16=device == "cuda", use_cpu=device == "cpu",
    )


@contextlib.contextmanager
def trl_phase_timers(trainer, phases: dict, device: str):
    """Seconds of TRL's generation, reward-model calls and no-grad log-probability forwards, summed
    per phase and update: wraps the trainer's own methods (on the instance, restored afterwards)."""
    def wait():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(name, phase_of):
        function = getattr(trainer, name)

        def wrapper(*a, **kw):
            wait()
            start = time.perf_counter()
            try:
                return function(*a, **kw)
            finally:
                wait()
                phase = phase_of()
                if phase:
                    phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start
        setattr(trainer, name, wrapper)

    timed("_generate", lambda: "generation")
    timed("_calculate_rewards", lambda: "reward_forward")
    # without gradients it is the reference's (or the old policy's) forward; with them the training step's
    timed("_get_per_token_logps_and_entropies", lambda: None if torch.is_grad_enabled() else "reference_forward")
    try:
        yield
    finally:
        for name in ("_generate", "_calculate_rewards", "_get_per_token_logps_and_entropies"):
            del trainer.__dict__[name]


def run_trl(args: Args, shape: str, threads: int, device: str, workdir: str) -> dict:
    """One GRPOTrainer.train() of `args.updates` updates: per-update seconds (the first left out) and phases."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl import GRPOTrainer

    ppo_speed.release_memory()
    sft_path, rm_path = ppo_speed.build_checkpoints(shape, args.cache_dir, args.seed)
    queries = DatasetDict.load_from_disk(query_dataset(args, shape))
    tokenizer = AutoTokenizer.from_pretrained(sft_path)
    frozen = torch.bfloat16 if device == "cuda" else torch.float32  # as ours' frozen_dtype
    policy = AutoModelForCausalLM.from_pretrained(sft_path, dtype=torch.float32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(rm_path, num_labels=1, dtype=frozen)
    prompts = Dataset.from_dict({"prompt": prompt_texts(queries["train"]["query_token"])})
    return ppo_speed.timed_trl_training(lambda callback: GRPOTrainer(
        model=policy, reward_funcs=reward_model, args=trl_config(args, workdir, device), train_dataset=prompts,
        processing_class=tokenizer, reward_processing_classes=tokenizer, callbacks=[callback]),
        trl_phase_timers, threads, device)


def query_dataset(args: Args, shape: str) -> str:
    return ppo_speed.build_query_dataset(args.cache_dir, args.queries, args.query_length, args.response_length,
                                         ppo_speed.model_config(shape).vocab_size, args.seed)


def run_ours(args: Args, shape: str, threads: int, device: str, workdir: str) -> dict:
    """One rloo.py GRPO run in this process: seconds between the ends of consecutive updates (as
    TRL's), the stage's own phases."""
    sft_path, rm_path = ppo_speed.build_checkpoints(shape, args.cache_dir, args.seed)
    name = f"{shape}_grpo_vs_trl_{time.time_ns()}"
    stage = stage_args(args, sft_path, rm_path, query_dataset(args, shape), name)
    times = ppo_speed.run_ours_in_process(stage, workdir, device, threads, stage_main=rloo.main)
    metrics = ppo_speed.read_metrics(workdir, name)
    return {"seconds": np.diff(times).tolist(), "phases": ppo_speed.phase_seconds(metrics[1:])}


def paired_rows(shape: str, round_: int, first: str, ours: dict, trl: dict, common: dict) -> list:
    """One row per paired update k >= 2: both sides' seconds, their ratio and phases (`other`: the rest)."""
    rows = []
    for k, (o, t) in enumerate(zip(ours["seconds"], trl["seconds"])):
        row = {"shape": shape, "round": round_ + 1, "update": k + 2, "first": first, **common,
               "ours_s": o, "trl_s": t, "ratio_trl_over_ours": t / o}
        for side, measured, seconds in (("ours", ours, o), ("trl", trl, t)):
            phases = {p: v[k] for p, v in measured["phases"].items()}
            row.update({f"{side}_{p}": v for p, v in phases.items()})
            row[f"{side}_other"] = seconds - sum(phases.values())
        rows.append(row)
    return rows


def run_side_by_side(args: Args, device: str, console: Console) -> list:
    rows = []
    threads = args.threads or torch.get_num_threads()
    workdir = os.path.join(args.out, "work")
    for shape in args.shapes:
        common = {"params": ppo_speed.total_params(shape), "device": device, "threads": threads,
                  "queries": args.queries, "k": args.k, "micro_batch": args.micro_batch_size,
                  "query_length": args.query_length, "response_length": args.response_length}
        for round_ in range(args.rounds):
            sides = ["ours", "trl"] if round_ % 2 == 0 else ["trl", "ours"]
            measured = {}
            for side in sides:
                console.print(f"[bold]{shape}[/] round {round_ + 1}: {'TRL' if side == 'trl' else 'ours'}",
                              highlight=False)
                measured[side] = (run_trl(args, shape, threads, device, workdir) if side == "trl"
                                  else run_ours(args, shape, threads, device, workdir))
            rows += paired_rows(shape, round_, sides[0], measured["ours"], measured["trl"], common)
        paired = [r for r in rows if r["shape"] == shape]
        ppo_speed.print_side_by_side_phases(paired, console, title=f"{shape}, GRPO k={args.k}")
        console.print(ppo_speed.ratio_line(f"{shape}, GRPO k={args.k}", [r["ours_s"] for r in paired],
                                           [r["trl_s"] for r in paired]), highlight=False, soft_wrap=True)
    return rows


def plot(rows: list, path: str) -> None:
    """The ratio per paired update, per shape (> 1: ours is faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(shapes), 3.6))
    for x, shape in enumerate(shapes):
        ratios = [r["ratio_trl_over_ours"] for r in rows if r["shape"] == shape]
        ax.scatter([x] * len(ratios), ratios, color="C0", alpha=0.6)
        ax.hlines(statistics.median(ratios), x - 0.25, x + 0.25, color="C0")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_ylabel("TRL s / ours s per update")
    ax.set_title("GRPO: TRL GRPOTrainer over rloo.py --algorithm grpo", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: Args) -> list:
    quiet_libraries()
    if args.updates < 2:
        raise ValueError("--updates must be >= 2: the first update is warm-up")
    unknown = [s for s in args.shapes if s not in ppo_speed.SHAPES]
    if unknown:
        raise ValueError(f"unknown shapes {unknown}; choose from {', '.join(ppo_speed.SHAPES)}")
    if (args.queries * args.k) % args.micro_batch_size:
        raise ValueError(f"--micro_batch_size {args.micro_batch_size} must divide the update's {args.queries} x "
                         f"{args.k} samples")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    console = Console()
    args.out, args.cache_dir = os.path.abspath(args.out), os.path.abspath(args.cache_dir)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.cache_dir, exist_ok=True)
    rows = run_side_by_side(args, device, console)
    ppo_speed.write_csv(rows, os.path.join(args.out, "grpo_vs_trl.csv"))
    plot(rows, os.path.join(args.out, "grpo_vs_trl.png"))
    console.print(f"written to {args.out}/", highlight=False)
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
