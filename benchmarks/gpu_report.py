"""`make gpu-report`: every GPU check and the GPU benchmark rows in one go, into one report: the first
thing to run on a GPU machine (DESIGN.md section 21).

    make gpu-report                                    # into gpu_report/ (GPU_REPORT=<folder> for another)
    python benchmarks/gpu_report.py --out gpu_report
    python benchmarks/gpu_report.py --smoke --out /tmp/r   # the plumbing on the CPU at tiny shapes (make test)

The steps, each a command whose whole output goes to <out>/<step>.log (a failed step is reported and
the next one runs):
1. `test_gpu`: `pytest -m gpu` (tests/test_gpu.py: the four stages at Pythia-410m's shape under the
   paper's DeepSpeed ZeRO-2 bf16 config, LoRA and 4-bit, the CUDA-graph decode against the eager one,
   PPO at Pythia-1B's shape with the sbatch micro-batches, --offload, 4-bit PPO, two GPUs where
   there are two, the packed forwards against the padded ones at Llama 3.2 1B's shape in bf16 on
   sdpa); its `[gpu]` lines (seconds per update, peak memory per stage) go into the report;
2. `speed`: benchmarks/ppo_speed.py at Pythia-1B's shape with one GPU's share of the paper's batch
   (64 queries x 512 + 53 tokens, bf16), one process and ZeRO-2, micro-batch 16: seconds per update
   by phase, tokens/s, utilisation of the measured bf16 matmul peak, and decode ms/step against the
   bandwidth floor (the policy's weights and its batch's KV cache at the real context length, read
   once per step);
3. `trl`: the same shape, ours and TRL 1.12's PPOTrainer side by side (ratio min / median / max);
4. `drift`: benchmarks/logprob_drift.py at the same shape (a random-init policy, 16 queries x 512 +
   53): the same sampled tokens scored at batch 1 and 16 in fp32, bf16 and fp16, against fp32 at
   batch 1: how far the batch shape and the dtype move PPO's ratio before any update;
5. `dpo_memory`: benchmarks/dpo_memory.py at the same shape: dpo.py's peak memory for one sbatch
   micro-batch (8 pairs x 512 + 53, bf16) with all logits (before issue 27), response logits, packed;
6. `async`: ppo_speed.py at the same shape and batch, one process, `--samplers sync sequential
   overlapped` (docs/async.md): seconds per update with the rollouts sampled in the learner's process
   (today's loop; one update old) or by a worker process while the learner trains (one update old, on
   a second GPU where there is one, else beside the learner on its GPU), and how much of the worker's
   decode the learner did not wait for.
Steps 2 and 3 run each setting with the padded, packed and packed + compiled forwards.
Output: <out>/report.md (the GPU, the versions, each step's status, time and numbers), the CSVs of
steps 2 and 3, and the logs. Without CUDA it says so and exits 1, running nothing.
"""

import csv
import datetime
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import tyro

from summarize_from_feedback_details.infra.preflight import cuda_problem, nvidia_smi_gpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    out: str = "gpu_report"
    """the report's folder (created; an existing report in it is replaced)"""
    smoke: bool = False
    """run the plumbing on the CPU at tiny shapes, without the GPU tests (what make test checks)"""
    shape: str = "pythia-1b"
    """the benchmark and drift shape (benchmarks/ppo_speed.py's names)"""
    steps: tuple[str, ...] = ("test_gpu", "speed", "trl", "drift", "dpo_memory")
    """which steps to run, in the report's order (a lent GPU's minutes are few: run the rest another time)"""
    step_timeout_s: int = 0
    """stop a step after this many seconds and report it as timed out (0: no limit), so that one slow step
    cannot take the whole of a lent GPU's time from the steps after it"""


@dataclass
class Step:
    name: str
    command: list
    description: str


def steps(args: Args) -> list:
    """The report's commands. A GPU machine: the paper's per-GPU shapes; --smoke: tiny ones on the CPU."""
    python, speed = sys.executable, os.path.join(REPO, "benchmarks", "ppo_speed.py")
    drift = os.path.join(REPO, "benchmarks", "logprob_drift.py")
    dpo_memory = os.path.join(REPO, "benchmarks", "dpo_memory.py")
    out = os.path.abspath(args.out)
    if args.smoke:
        shape = ["--shapes", "tiny-s", "--batch_size", "4", "--query_length", "16", "--response_length", "8",
                 "--eval_batch_size", "1", "--updates", "2", "--threads", "1", "--matmul_size", "256"]
        return [Step("test_gpu", [python, "-m", "pytest", "-q", "-s", "-rs", "-m", "gpu", "-k", "nvidia_smi",
                                  os.path.join(REPO, "tests", "test_gpu.py")], "the GPU check alone (smoke)"),
                Step("speed", [python, speed, *shape, "--strategies", "single", "--micro_batch_sizes", "4",
                               "--out", os.path.join(out, "speed")], "seconds per update at tiny-s (smoke)"),
                Step("trl", [python, speed, "--mode", "trl", *shape, "--rounds", "1", "--out",
                             os.path.join(out, "trl")], "ours vs TRL at tiny-s (smoke)"),
                Step("async", [python, speed, *shape, "--strategies", "single", "--micro_batch_sizes", "4",
                               "--samplers", "overlapped", "--out", os.path.join(out, "async")],
                     "the overlapped sampler at tiny-s (smoke)"),
                Step("drift", [python, drift, "--model", "tiny-s", "--rows", "4", "--query_length", "16",
                               "--response_length", "8", "--out", os.path.join(out, "drift")],
                     "log-prob drift at tiny-s (smoke)"),
                Step("dpo_memory", [python, dpo_memory, "--shape", "tiny-s", "--pairs", "2", "--query_length", "16",
                                    "--response_length", "8", "--out", os.path.join(out, "dpo_memory")],
                     "DPO micro-batch memory at tiny-s (smoke)")]
    paper = ["--shapes", args.shape, "--query_length", "512", "--response_length", "53", "--batch_size", "64",
             "--eval_batch_size", "8"]
    return [Step("test_gpu", [python, "-m", "pytest", "-q", "-s", "-rs", "-m", "gpu", os.path.join(REPO, "tests")],
                 "make test-gpu"),
            Step("speed", [python, speed, *paper, "--strategies", "single", "zero2", "--micro_batch_sizes", "16",
                           "--forwards", "padded", "packed", "compiled", "--out", os.path.join(out, "speed")],
                 f"seconds per update at {args.shape}, 64 queries x 512 + 53 tokens, bf16"),
            Step("trl", [python, speed, "--mode", "trl", *paper, "--rounds", "2", "--forwards", "padded", "packed",
                         "compiled", "--out", os.path.join(out, "trl")],
                 f"ours vs TRL 1.12 at {args.shape}, the same settings"),
            Step("async", [python, speed, *paper, "--strategies", "single", "--micro_batch_sizes", "16", "--samplers",
                           "sync", "sequential", "overlapped", "--out", os.path.join(out, "async")],
                 f"asynchronous RLHF at {args.shape} (--async_steps 1): rollouts sampled in the learner's process "
                 f"(sync, sequential) or by a worker process beside it (overlapped: on a GPU of its own where there "
                 f"are two, else on the learner's)"),
            Step("drift", [python, drift, "--model", args.shape, "--out", os.path.join(out, "drift")],
                 f"log-prob drift at {args.shape}: batch 1 vs 16, fp32 / bf16 / fp16"),
            Step("dpo_memory", [python, dpo_memory, "--shape", args.shape, "--out", os.path.join(out, "dpo_memory")],
                 f"dpo.py's peak memory per micro-batch at {args.shape} (8 pairs x 512 + 53): all logits / response "
                 f"logits / packed")]


def markdown_table(path: str, columns: list) -> str:
    """The CSV at `path` as a markdown table of `columns` (those it has), numbers rounded."""
    if not os.path.exists(path):
        return "(no table)"
    with open(path) as f:
        rows = list(csv.DictReader(f))
    columns = [c for c in columns if rows and c in rows[0]]

    def cell(value: str) -> str:
        try:
            number = float(value)
        except ValueError:
            return value
        return f"{number:.4g}" if number == number else "n/a"

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


SPEED_COLUMNS = ["shape", "strategy", "forwards", "processes", "micro_batch", "precision", "s_per_update",
                 "time/generation", "time/ppo_epochs", "tokens_per_s", "utilisation", "epoch_utilisation", "decode_ms_per_step", "floor_ms_per_step",
                 "peak_memory_gib", "status"]
ASYNC_COLUMNS = ["shape", "sampler", "async_steps", "s_per_update", "s_per_update_min", "s_per_update_max",
                 "time/generation", "time/ppo_epochs", "worker_generation_seconds", "worker_wait_seconds",
                 "worker_hidden_fraction", "peak_memory_gib", "status"]
TRL_COLUMNS = ["shape", "forwards", "round", "update", "padding_share", "ours_s", "trl_s", "ratio_trl_over_ours"]
DPO_MEMORY_COLUMNS = ["shape", "device", "pairs", "setting", "peak_gib", "seconds"]
DRIFT_COLUMNS = ["dtype", "batch", "tokens", "share_outside_0.9_1.1", "max_abs_log_ratio", "mean_abs_log_ratio"]


def section(step: Step, result: dict, out: str) -> str:
    """The report's part for one step."""
    head = (f"## {step.name}: {step.description}\n\n{result['status']} in {result['seconds']:.0f} s "
            f"(`{os.path.basename(step.command[1]) if step.command[1] != '-m' else ' '.join(step.command[1:3])}`; "
            f"log: {step.name}.log)\n\n")
    if step.name == "test_gpu":
        with open(os.path.join(out, "test_gpu.log")) as f:
            lines = [line.rstrip() for line in f if line.startswith("[gpu]") or " passed" in line or " failed" in line
                     or line.startswith(("SKIPPED", "FAILED"))]
        return head + "```\n" + "\n".join(lines) + "\n```\n"
    tables = {"speed": (os.path.join(out, "speed", "ppo_speed.csv"), SPEED_COLUMNS),
              "trl": (os.path.join(out, "trl", "trl_side_by_side.csv"), TRL_COLUMNS),
              "async": (os.path.join(out, "async", "ppo_speed.csv"), ASYNC_COLUMNS),
              "drift": (os.path.join(out, "drift", "logprob_drift.csv"), DRIFT_COLUMNS),
              "dpo_memory": (os.path.join(out, "dpo_memory", "dpo_memory.csv"), DPO_MEMORY_COLUMNS)}
    return head + markdown_table(*tables[step.name]) + "\n"


def machine() -> str:
    gpus = nvidia_smi_gpus()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device (smoke run on the CPU)"
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    return (f"- device: {device}" + (f" x {torch.cuda.device_count()}" if torch.cuda.is_available() else "") + "\n"
            f"- driver: {gpus[0][1] if gpus and len(gpus[0]) == 2 else 'n/a'}; torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}; python {platform.python_version()}\n"
            f"- commit {commit.strip() or 'unknown'}, {datetime.datetime.now().isoformat(timespec='seconds')}\n")


def live_processes_of_group(group: int) -> list:
    """The pids of process group `group` that have not exited (a zombie has: it holds no GPU memory)."""
    live = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, process_group = f.read().rsplit(")", 1)[1].split()[:3]
        except OSError:  # it exited meanwhile
            continue
        if state != "Z" and int(process_group) == group:
            live.append(int(pid))
    return live


def kill_group(group: int, wait_s: float = 60) -> None:
    """SIGKILL to every process of `group`, then wait until none runs: a killed process lets go of its GPU
    memory only when it has exited, which under load comes a while after the signal."""
    os.killpg(group, signal.SIGKILL)
    end = time.time() + wait_s
    while live_processes_of_group(group) and time.time() < end:
        time.sleep(0.05)


def run_step(step: Step, out: str, timeout_s: int) -> dict:
    """One step, its whole output into <out>/<step>.log: its status ("ok", "FAILED (exit N)" or "TIMED OUT
    after N s") and seconds."""
    start = time.time()
    with open(os.path.join(out, f"{step.name}.log"), "w") as log:
        # its own process group: a timeout stops the processes it launched too (they hold the GPU)
        process = subprocess.Popen(step.command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                   env=dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline"))
        try:
            code = process.wait(timeout=timeout_s or None)
            status = "ok" if code == 0 else f"FAILED (exit {code})"
        except subprocess.TimeoutExpired:
            kill_group(process.pid)
            process.wait()
            status = f"TIMED OUT after {timeout_s} s"
    return {"status": status, "seconds": time.time() - start}


def main(args: Args) -> int:
    if not args.smoke and not torch.cuda.is_available():
        print("gpu-report runs on a CUDA machine: torch sees no GPU here" +
              (f" ({cuda_problem()})" if cuda_problem() else "") + "; nothing ran", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    report = [f"# GPU report{' (smoke: tiny shapes on the CPU)' if args.smoke else ''}\n", machine()]
    unknown = set(args.steps) - {step.name for step in steps(args)}
    if unknown:
        print(f"--steps: no step named {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    failed = 0
    for step in [step for step in steps(args) if step.name in args.steps]:
        result = run_step(step, args.out, args.step_timeout_s)
        failed += result["status"] != "ok"
        report.append(section(step, result, args.out))
        print(f"{step.name}: {result['status']} in {result['seconds']:.0f} s", flush=True)
        with open(os.path.join(args.out, "report.md"), "w") as f:  # after every step: a killed run keeps the rest
            f.write("\n".join(report))
    print(f"report: {os.path.join(args.out, 'report.md')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
