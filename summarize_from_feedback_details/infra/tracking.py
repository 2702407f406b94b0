"""What a run reports while it trains: nothing in this module changes a result.

- `Logger`: TensorBoard + metrics.jsonl + wandb, continued exactly by a resumed run;
- `EarlyWarnings`: the online stages' --warn signals (`WARNING_SIGNALS`; `first_warning` applies the
  same rule afterwards to a metric's history);
- `progress` prints plain lines with an ETA where no terminal shows a bar;
- `PhaseTimer`: seconds per phase of an update;
- `explained_variance`: how much of the returns a critic predicts (PPO's ppo/val/explained_variance);
- `last_metrics` and `metric_history` read a run's metrics.jsonl back (the report, eval/).
"""

import contextlib
import datetime
import json
import math
import os
import time
from dataclasses import asdict
from typing import Optional

import pandas as pd
import torch
from accelerate import Accelerator
from rich.console import Console
from rich.progress import Progress as RichProgress
from rich.progress import TextColumn
from torch.utils.tensorboard import SummaryWriter


# The online stages' early-warning signals (--warn NAME=THRESHOLD; DESIGN.md section 20): the metric each
# reads and how it fires. They print, nothing else: the usual finding is that they audit after the fact,
# which eval/overoptimization.py measures against the gold judge.
WARNING_SIGNALS = {"kl": ("objective/kl", "above"), "entropy": ("objective/entropy", "below"),
                   "length_change": ("ppo/val/response_length", "change")}


def parse_warnings(entries: list) -> dict:
    """{name: threshold} of --warn's NAME=THRESHOLD entries; an unknown name or a bad number is an error
    before anything trains."""
    thresholds = {}
    for entry in entries:
        name, _, value = entry.partition("=")
        if name not in WARNING_SIGNALS:
            raise ValueError(f"--warn {entry}: the signals are {', '.join(f'{n}=X' for n in WARNING_SIGNALS)}")
        try:
            thresholds[name] = float(value)
        except ValueError:
            raise ValueError(f"--warn {entry}: {value!r} is not a number") from None
        if name == "length_change" and thresholds[name] <= 0:
            raise ValueError(f"--warn {entry}: the length change is a fraction above 0 (0.3: 30%)")
    return thresholds


def signal_fires(kind: str, threshold: float, value: float, first: float) -> bool:
    """Whether a signal of `kind` (above, below, change) fires at `value`; `first` is its first update's
    value (change: |value / first - 1| > threshold)."""
    if kind == "above":
        return value > threshold
    if kind == "below":
        return value < threshold
    return first > 0 and abs(value / first - 1) > threshold


def first_warning(history: list, name: str, threshold: float) -> Optional[int]:
    """The index of the first value of a metric's history at which the signal `name` fires (None: never);
    what --warn would have printed, computed afterwards from metrics.jsonl."""
    kind = WARNING_SIGNALS[name][1]
    for i, value in enumerate(history):
        if signal_fires(kind, threshold, value, history[0]):
            return i
    return None


class EarlyWarnings:
    """--warn's signals during a run: each fires once, at the first update that crosses its threshold,
    with a message naming the update, the metric, its value and the threshold. Its state (the first
    update's values, what fired) goes into the checkpoint, so a resumed run warns as the uninterrupted one."""

    def __init__(self, thresholds: dict, state: Optional[dict] = None):
        self.thresholds = thresholds
        self.first = dict(state["first"]) if state else {}
        self.fired = dict(state["fired"]) if state else {}

    def check(self, metrics: dict, step: int) -> list:
        messages = []
        for name, threshold in self.thresholds.items():
            metric, kind = WARNING_SIGNALS[name]
            if metric not in metrics or name in self.fired:
                continue
            value = metrics[metric]
            first = self.first.setdefault(metric, value)
            if signal_fires(kind, threshold, value, first):
                self.fired[name] = step
                # only the fired kind's text: a first value of 0 (a KL of exactly 0.0) has no relative change
                what = (f"{value / first - 1:+.0%} from the first update's {first:.4g}" if kind == "change"
                        else f"{kind} {threshold:g}")
                messages.append(f"early warning at update {step}: {metric} {value:.4g} {what} (--warn {name}={threshold:g})")
        return messages

    def state(self) -> dict:
        return {"first": self.first, "fired": self.fired}


class Logger:
    """TensorBoard + metrics.jsonl (+ wandb: scalars via TensorBoard sync, and the eval tables) on the
    main process only. `resume` (the `state()` a checkpoint kept) continues a run where it stood:
    metrics.jsonl is cut back to its length then, TensorBoard hides the events logged after it, and
    wandb continues the same run."""

    def __init__(self, args, accelerator: Accelerator, resume: Optional[dict] = None):
        self.main = accelerator.is_main_process
        self.track = self.main and args.track
        self.folder = os.path.join("runs", args.run_name)
        self.last_step = resume["last_step"] if resume else None
        self.wandb_id = resume["wandb_id"] if resume else None
        self.wandb_url = None
        # the newest value of every metric logged (progress lines, the summary); the optimizer steps
        # (and PPO rollouts) skipped under --on_nonfinite skip, logged as nonfinite/skipped
        self.latest: dict = {}
        self.skip_nonfinite = getattr(args, "on_nonfinite", "stop") == "skip"
        self.nonfinite_skipped = resume.get("nonfinite_skipped", 0) if resume else 0
        self.warnings = EarlyWarnings(parse_warnings(getattr(args, "warn", [])), resume.get("warnings") if resume else None)
        if not self.main:
            return
        if args.track:
            import wandb

            wandb_run = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                                   config=asdict(args), name=args.run_name, save_code=True, id=self.wandb_id,
                                   resume="allow" if self.wandb_id else None)
            self.wandb_id, self.wandb_url = wandb_run.id, wandb_run.url
        os.makedirs(self.folder, exist_ok=True)
        self.writer = SummaryWriter(self.folder, purge_step=None if self.last_step is None else self.last_step + 1)
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v}|" for k, v in asdict(args).items()))
        with open(os.path.join(self.folder, "args.json"), "w") as f:
            json.dump(asdict(args), f, indent=2)
        path = os.path.join(self.folder, "metrics.jsonl")
        if resume and os.path.exists(path):
            with open(path, "r+") as f:
                f.truncate(resume["jsonl_bytes"])
        self.jsonl = open(path, "a")

    def log(self, metrics: dict, step: int) -> None:
        if self.skip_nonfinite:
            metrics = {**metrics, "nonfinite/skipped": self.nonfinite_skipped}
        self.latest.update(metrics)
        fired = self.warnings.check(metrics, step)
        if not self.main:
            return
        for message in fired:
            Console(soft_wrap=True).print(f"[bold yellow]WARNING:[/] {message}", highlight=False)
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        # strict JSON: a non-finite value is null (json.dumps would write NaN, which strict readers refuse)
        self.jsonl.write(json.dumps({"step": step, **{k: v if math.isfinite(v) else None for k, v in metrics.items()}},
                                    allow_nan=False) + "\n")
        self.jsonl.flush()
        self.last_step = step

    def state(self) -> dict:
        """Where the logs stand (main process): what a checkpoint keeps to continue them."""
        return {"jsonl_bytes": self.jsonl.tell(), "last_step": self.last_step, "wandb_id": self.wandb_id,
                "nonfinite_skipped": self.nonfinite_skipped, "warnings": self.warnings.state()}

    def table(self, name: str, frame: pd.DataFrame) -> None:
        if self.main:
            frame.to_csv(os.path.join(self.folder, f"{name}.csv"), index=False)
        if self.track:  # eval/rlhf_scaling_plot.py judges this table from wandb
            import wandb

            wandb.log({name: wandb.Table(dataframe=frame)})

    def close(self) -> None:
        if self.main:
            self.writer.close()
            self.jsonl.close()
        if self.track:
            import wandb

            wandb.finish()


def metric_status(latest: dict, keys: tuple) -> str:
    """'loss 0.4057, accuracy 0.6500': the newest values of `keys`, each named by its last part."""
    return ", ".join(f"{k.rsplit('/', 1)[-1]} {latest[k]:.4g}" for k in keys if latest.get(k) is not None)


def progress(iterable, total: int, description: str, enabled: bool = True, status=None, lines_per_run: int = 20,
             seconds_between_lines: float = 60.0):
    """`iterable`, shown while it runs (on `enabled` processes). On a terminal a rich bar with
    `status()` beside it; elsewhere (a redirect, every Slurm job), where a bar would print only when it
    ends, a plain line every `total / lines_per_run` items and whenever `seconds_between_lines`
    have passed since the last one: items done / total, `status()` and an ETA, so that a log tells
    slow from hung."""
    if not enabled:
        yield from iterable
        return
    if Console().is_terminal:
        columns = (*RichProgress.get_default_columns(), TextColumn("{task.fields[status]}"))
        with RichProgress(*columns) as bar:
            task = bar.add_task(description, total=total, status="")
            for item in iterable:
                yield item
                bar.update(task, advance=1, status=status() if status else "")
        return
    every, start = max(1, total // lines_per_run), time.time()
    done, shown, last_line = 0, 0, start
    try:
        for item in iterable:
            yield item
            done += 1
            now = time.time()
            if done % every == 0 or now - last_line >= seconds_between_lines:
                print(progress_line(description, done, total, now - start, status() if status else ""), flush=True)
                shown, last_line = done, now
    finally:
        if done != shown:  # the last line, unless it was just printed
            print(progress_line(description, done, total, time.time() - start, status() if status else ""), flush=True)


def progress_line(description: str, done: int, total: int, seconds: float, status: str) -> str:
    eta = datetime.timedelta(seconds=round(seconds / done * (total - done))) if done else "?"
    return (f"{description} {done}/{total} ({done / max(total, 1):.0%})" + (f" | {status}" if status else "")
            + f" | {datetime.timedelta(seconds=round(seconds))} elapsed, ETA {eta}")


class PhaseTimer:
    """Seconds of one update (a timer per update, started with it) and of its named phases, summed
    over the phase's entries (the rollout enters each phase once per chunk). On a GPU it waits for
    the queued kernels at both ends of a phase, so that a phase is charged with its own GPU work, not
    with the previous phase's."""

    clock = staticmethod(time.perf_counter)  # (a test sets a clock of its own, to know every second)

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict = {}
        self.start = self.clock()

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._wait()
        start = self.clock()
        try:
            yield
        finally:
            self._wait()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + self.clock() - start

    def metrics(self, tokens: int, generated_tokens: Optional[int] = None) -> dict:
        """time/<phase>, time/update (seconds since the timer started) and throughput/tokens_per_second:
        `tokens` (positions of the global batch, padding included) per second of the update; with
        `generated_tokens`, throughput/generated_tokens_per_second of the `generation` phase too."""
        self._wait()
        seconds = self.clock() - self.start
        metrics = {**{f"time/{phase}": s for phase, s in self.seconds.items()}, "time/update": seconds,
                   "throughput/tokens_per_second": tokens / seconds}
        if generated_tokens is not None:
            metrics["throughput/generated_tokens_per_second"] = generated_tokens / self.seconds["generation"]
        return metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the entries where `mask` is True: 1 for a critic
    that predicts every return, 0 for one no better than the batch's mean return, below 0 for one worse
    (CleanRL's diagnostic of the critic; issue 61 found the miniature's below 0 for every update)."""
    returns, errors = returns[mask].double(), (returns - values)[mask].double()
    return (1 - errors.var(unbiased=False) / returns.var(unbiased=False)).item()


def last_metrics(run_folder: str) -> dict:
    """The last logged value of every metric of a run (metrics.jsonl holds one dict per log call)."""
    metrics = {}
    with open(os.path.join(run_folder, "metrics.jsonl")) as f:
        for line in f:
            metrics.update(json.loads(line))
    metrics.pop("step", None)
    return metrics


def metric_history(run_folder: str, key: str) -> list:
    """Every logged value of one metric, in order."""
    with open(os.path.join(run_folder, "metrics.jsonl")) as f:
        return [m[key] for m in map(json.loads, f) if key in m]
