"""Time to the synchronous run's gold on the embedded default: ppo_left_padding.py from hello_world's
SFT policy and reward model, synchronous (`--async_steps 0`), then at `--async_steps N` sampled in the
learner's process (sequential) and by a worker process beside it (overlapped, `--async_worker cpu`).

    ./hello_world.sh && python benchmarks/async_time_to_gold.py            # this CPU, 2 threads
    python benchmarks/async_time_to_gold.py --async_steps 2 --threads 4

The three runs are hello_world's PPO (its flags, `sbatches/tiny_default.sh`: 15 updates of 64 rollouts at
tiny-m, seed `--seed`) on the same cores: sync and sequential on `--threads` torch threads, overlapped
with the worker's `--worker_threads` taken out of them (the learner keeps the rest). Sequential and
overlapped sample the same tokens from the same weights (docs/async.md; tests/test_async.py): their
gold curves are one curve, and only the wall clock tells them apart.

Every update's validation step scores the policy's responses to that update's new held-out queries
under the gold judge (`eval/gold/score`, `--local_eval_batch_size` 16 queries: the same queries for every
run at a given update). The target is the synchronous run's gain: G0 + `--fraction` x (G* - G0), G0 its
first update's gold (the SFT policy's), G* the mean of its last three; a run reaches it at the first update
whose mean gold over the last three updates (fewer at the start) is at or above it, at that update's
cumulative wall time (the ends of updates, as `Logger.log` sees them: the loop body whole). A run that
never reaches it says so. Phase seconds per update are the stage's own `time/<phase>`; overlapped rows
add the worker's decode seconds, the learner's wait for it and the fraction hidden.

Output in `--out`: time_to_gold.csv (one row per run and update) and time_to_gold.png (gold against wall
time). Timings on a machine shared with other work are noisy; compare numbers from one run.
"""

import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
import tyro
from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo_speed  # noqa: E402  (benchmarks/ is a folder of scripts: its in-process runner and readers)

from summarize_from_feedback_details import ppo_left_padding as ppo  # noqa: E402
from summarize_from_feedback_details.infra.launch import quiet_libraries  # noqa: E402

REPO = ppo_speed.REPO
SAMPLERS = ("sync", "sequential", "overlapped")
WINDOW = 3  # updates in the gold's running mean and in G*


@dataclass
class Args:
    models: str = "models/hello_world"
    """hello_world's model folder: sft/ and reward_model/ (`./hello_world.sh` writes them)"""
    base_model: str = "models/tiny/pythia-tiny-m"
    query_dataset: str = "data/tldr/sft"
    async_steps: int = 1
    """the rollouts' age in updates of the sequential and overlapped runs"""
    threads: int = 2
    """torch threads of every run (overlapped: the learner's and the worker's together)"""
    worker_threads: int = 1
    fraction: float = 0.9
    """the target: this fraction of the synchronous run's gold gain"""
    seed: int = 1
    out: str = "runs/async_time_to_gold"


def tiny_default(*names: str) -> list:
    """Values of sbatches/tiny_default.sh's settings (arrays whole), read by bash itself."""
    script = "source sbatches/tiny_default.sh; " + "; ".join(f'echo "${{{name}[*]}}"' for name in names)
    lines = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return lines.splitlines()


def hello_world_ppo(args: Args, run_name: str, sampler: str) -> ppo.Args:
    """hello_world's PPO stage (its PPO_ARGS) with `sampler`'s flags."""
    batch, micro, updates, flags = tiny_default("TINY_PPO_BATCH", "TINY_PPO_MICRO_BATCH", "TINY_PPO_UPDATES",
                                                "TINY_PPO_FLAGS")
    batch, micro = int(batch), int(micro)
    stage = tyro.cli(ppo.Args, args=flags.split())  # (the stage's own parser reads TINY_PPO_FLAGS)
    stage.base_model, stage.sft_model_path = args.base_model, os.path.join(args.models, "sft")
    stage.reward_model_path, stage.query_dataset = os.path.join(args.models, "reward_model"), args.query_dataset
    stage.run_name, stage.seed, stage.output_dir, stage.total_episodes = run_name, args.seed, "", int(updates) * batch
    stage.local_micro_batch_size, stage.gradient_accumulation_steps = micro, batch // micro
    stage.local_rollout_forward_batch_size = batch
    if sampler != "sync":
        stage.async_steps = args.async_steps
    if sampler == "overlapped":
        stage.async_worker, stage.async_worker_threads = "cpu", args.worker_threads
    return stage


def learner_threads(args: Args, sampler: str) -> int:
    """The learner's torch threads: every thread, less the worker's where one samples beside it."""
    return max(1, args.threads - args.worker_threads) if sampler == "overlapped" else args.threads


def run(args: Args, sampler: str, workdir: str) -> list:
    """One PPO run; a row per update: its seconds, cumulative seconds, gold and phases."""
    name = f"{sampler}_n{0 if sampler == 'sync' else args.async_steps}_seed{args.seed}"
    ppo_speed.run_ours_in_process(hello_world_ppo(args, name, sampler), workdir, "cpu", learner_threads(args, sampler))
    metrics = ppo_speed.read_metrics(workdir, name)
    rows, elapsed = [], 0.0
    for update, m in enumerate(metrics, 1):
        elapsed += m["time/update"]
        rows.append({"sampler": sampler, "async_steps": 0 if sampler == "sync" else args.async_steps,
                     "update": update, "seconds": m["time/update"], "elapsed": elapsed, "gold": m["eval/gold/score"],
                     **{k: v for k, v in m.items() if k.startswith("time/") and k != "time/update"},
                     **{k[len("async/"):]: v for k, v in m.items() if k in ppo_speed.WORKER_METRICS}})
    return rows


def running_gold(rows: list) -> list:
    """Mean gold over each update's last WINDOW updates (fewer at the start)."""
    gold = [r["gold"] for r in rows]
    return [float(np.mean(gold[max(0, t + 1 - WINDOW):t + 1])) for t in range(len(gold))]


def gold_target(sync_rows: list, fraction: float) -> float:
    """G0 + fraction x (G* - G0): G0 the synchronous run's first update's gold, G* its last WINDOW's mean."""
    start, final = sync_rows[0]["gold"], float(np.mean([r["gold"] for r in sync_rows[-WINDOW:]]))
    return start + fraction * (final - start)


def time_to(rows: list, target: float) -> Optional[tuple]:
    """(update, cumulative seconds) where the running gold first reaches `target`; None if it never does."""
    for row, gold in zip(rows, running_gold(rows)):
        if gold >= target:
            return row["update"], row["elapsed"]
    return None


def summarize(runs: dict, fraction: float, console: Console) -> dict:
    """The table of each run's time to the target and its median phase seconds; returns the times."""
    target = gold_target(runs["sync"], fraction)
    table = Table(title=f"time to {fraction:.0%} of the synchronous run's gold gain (target {target:.3f})")
    phases = sorted({k for rows in runs.values() for r in rows for k in r if k.startswith("time/")})
    worker = [k[len("async/"):] for k in ppo_speed.WORKER_METRICS]
    for column in ("run", "reached at update", "seconds", "s / update (median)", *phases, *worker):
        table.add_column(column.removeprefix("time/"), justify="left" if column == "run" else "right")
    times = {}
    for sampler, rows in runs.items():
        reached = time_to(rows, target)
        times[sampler] = reached
        medians = [statistics.median(r[k] for r in rows[1:]) if k in rows[-1] else None for k in (*phases, *worker)]
        seconds = statistics.median(r["seconds"] for r in rows[1:])
        table.add_row(f"{sampler} (N={rows[0]['async_steps']})", str(reached[0]) if reached else "never",
                      f"{reached[1]:.1f}" if reached else "-", f"{seconds:.3f}",
                      *["-" if v is None else f"{v:.3f}" for v in medians])
    Console(width=max(console.width, 160)).print(table)
    return times


def plot(runs: dict, target: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for sampler, rows in runs.items():
        ax.plot([r["elapsed"] for r in rows], running_gold(rows), marker="o", ms=3,
                label=f"{sampler} (N={rows[0]['async_steps']})")
    ax.axhline(target, color="grey", lw=0.8, ls="--", label="target")
    ax.set_xlabel("wall seconds (ends of updates)")
    ax.set_ylabel(f"gold, mean of the last {WINDOW} updates")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: Args) -> dict:
    quiet_libraries()
    for part in ("sft", "reward_model"):
        if not os.path.isfile(os.path.join(args.models, part, "model.safetensors")):
            raise FileNotFoundError(f"{os.path.join(args.models, part)} holds no model: run ./hello_world.sh first")
    if args.async_steps < 1 or not 0 < args.fraction <= 1 or args.threads < 1:
        raise ValueError("--async_steps must be >= 1, --fraction in (0, 1], --threads >= 1")
    console = Console()
    args.out = os.path.abspath(args.out)
    args.models, args.base_model, args.query_dataset = (os.path.abspath(p) for p in
                                                        (args.models, args.base_model, args.query_dataset))
    workdir = os.path.join(args.out, "work")
    runs = {}
    for sampler in SAMPLERS:
        console.print(f"[bold]{sampler}[/] (--async_steps {0 if sampler == 'sync' else args.async_steps})",
                      highlight=False)
        runs[sampler] = run(args, sampler, workdir)
    times = summarize(runs, args.fraction, console)
    ppo_speed.write_csv([r for rows in runs.values() for r in rows], os.path.join(args.out, "time_to_gold.csv"))
    plot(runs, gold_target(runs["sync"], args.fraction), os.path.join(args.out, "time_to_gold.png"))
    if times["sequential"] and times["overlapped"]:
        console.print(f"overlapped / sequential seconds to the target: "
                      f"{times['overlapped'][1] / times['sequential'][1]:.3f}", highlight=False)
    console.print(f"written to {args.out}/", highlight=False)
    return {"runs": runs, "times": times}


if __name__ == "__main__":
    main(tyro.cli(Args))
