"""Checkpoints and exact resume: nothing in this module changes a result; a resumed run ends where
the uninterrupted one would have.

- what a resume must keep: the checkpoint's identity (stage, batch arithmetic, `lora_identity`) and
  the settings that decide the run's results (`run_settings`: every Args field but those a stage
  marks `Resumable`), compared field by field (`changed_settings`);
- `find_checkpoint`: the newest checkpoint, once it is clear that this run can continue it;
- `Checkpoints`: atomic checkpoints, exact resume on any process count, the stop signals (SIGTERM,
  SIGUSR1, Ctrl-C), after which a run exits with CHECKPOINT_EXIT_CODE.
"""

import json
import os
import random
import shutil
import signal
import typing
from dataclasses import asdict
from typing import Optional

import numpy as np
import torch
from accelerate import Accelerator
from rich.console import Console
from rich.markup import escape

from summarize_from_feedback_details.infra.saving import WRITE_ERRORS, human_bytes


# A stage stopped by SIGTERM, SIGUSR1 or Ctrl-C exits with this status once its checkpoint is written
# (EX_TEMPFAIL: try again later); the same command with --resume finishes the run.
CHECKPOINT_EXIT_CODE = 75


def lora_identity(args) -> Optional[list]:
    """The LoRA settings a checkpoint of adapters over frozen weights resumes only with."""
    return [args.lora_r, args.lora_alpha, args.lora_target_modules, args.load_in_4bit] if args.use_peft else None


class MayChangeOnResume:
    """The mark of an Args field that a resumed run may change: a memory or speed knob (it changes no
    result), how the run is launched, logged and saved, or what a non-finite value does (a run stopped
    by one may resume with --on_nonfinite skip). Every other field must be the checkpoint's
    (--accept_changed_settings). tyro ignores the mark; the flag and its help stay as they are."""

    def __repr__(self) -> str:
        return "MayChangeOnResume()"


_Field = typing.TypeVar("_Field")
# a stage marks such a field where it declares it: `local_micro_batch_size: Resumable[int] = 16`
Resumable = typing.Annotated[_Field, MayChangeOnResume()]


def resumable_fields(args_type) -> set:
    """The fields of an Args class marked Resumable."""
    hints = typing.get_type_hints(args_type, include_extras=True)
    return {name for name, hint in hints.items()
            if any(isinstance(mark, MayChangeOnResume) for mark in getattr(hint, "__metadata__", ()))}


def run_settings(args) -> dict:
    """The Args that decide the run's results (all but the Resumable fields), as JSON values: a checkpoint
    records them, and a resumed run must keep them."""
    may_change = resumable_fields(type(args))
    return {k: v for k, v in json.loads(json.dumps(asdict(args))).items() if k not in may_change}


def changed_settings(saved: dict, current: dict, prefix: str = "") -> list:
    """'<name> <value there>, <value here>' for each setting that differs (nested Args as a.b)."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        there, here = saved.get(key), current.get(key)
        if isinstance(there, dict) and isinstance(here, dict):
            changes += changed_settings(there, here, f"{prefix}{key}.")
        elif there != here:
            changes.append(f"{prefix}{key} {there!r} there, {here!r} here")
    return changes


def rng_state() -> dict:
    """Every random stream this process draws from."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def find_checkpoint(output_dir: str, identity: dict, world_size: int, deepspeed: bool) -> tuple:
    """(folder, trainer state) of the newest checkpoint in `<output_dir>/checkpoints`, once it is
    clear that this run can continue it: the same stage and batch arithmetic (`identity`), the same
    backend, and under DeepSpeed the same process count (its ZeRO files are sharded by rank)."""
    folder = os.path.join(output_dir, "checkpoints")
    names = sorted(n for n in os.listdir(folder) if n.startswith("update-")) if os.path.isdir(folder) else []
    if not names:
        raise FileNotFoundError(f"--resume: no checkpoint in {folder}")
    path = os.path.join(folder, names[-1])
    state_file = os.path.join(path, "trainer_state.json")
    try:
        with open(state_file) as f:
            state = json.load(f)
        saved = state["identity"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{state_file}: not a readable checkpoint state ({type(e).__name__}: {e})") from None
    mismatch = [f"{k} {saved.get(k)!r} there, {v!r} here" for k, v in identity.items() if saved.get(k) != v]
    if mismatch:
        raise ValueError(f"{path} is not a checkpoint of this run: {'; '.join(mismatch)}")
    if state["deepspeed"] != deepspeed:
        raise ValueError(f"{path} was written {'with' if state['deepspeed'] else 'without'} DeepSpeed; resume it the "
                         "same way")
    if deepspeed and state["world_size"] != world_size:
        raise ValueError(f"{path}: DeepSpeed's ZeRO checkpoint of {state['world_size']} processes loads only on as "
                         f"many (this run has {world_size})")
    return path, state


class Checkpoints:
    """Checkpoints of a run in `<output_dir>/checkpoints/update-<k>/`, and the signals that ask for one.

    A checkpoint holds what decides the rest of the run: the trained model and its optimizer (under
    DeepSpeed in its own ZeRO format through accelerate, with every rank's RNG streams; otherwise
    plain torch files of the unwrapped model's trained parameters, so another process count can
    resume), the `objects`
    (learning-rate scheduler, KL controller), every rank's RNG streams, and `trainer_state.json`: the
    update reached (the data position follows from the global order), the run name, where the logs
    stand, the stage's `records`, the `identity` a resume must match and the run's settings (the Args
    that decide its results), which a resume must keep unless told otherwise. It is written aside and
    renamed into place, so a run killed while writing keeps the previous one; the newest `keep` stay.
    SIGTERM and SIGUSR1 (what Slurm sends before a preemption or the time limit) and a first Ctrl-C
    (SIGINT; a second one aborts at once) ask for a checkpoint at the end of the current update, or
    between two batches of the evaluations after training (`stop_if_asked`), after which the run
    exits with CHECKPOINT_EXIT_CODE."""

    def __init__(self, args, accelerator: Accelerator, model, optimizer, objects: list, identity: dict):
        self.folder = os.path.join(args.output_dir, "checkpoints") if args.output_dir else None
        self.every, self.keep, self.identity = args.checkpoint_every, args.keep_checkpoints, identity
        self.settings = run_settings(args)
        self.accelerator, self.model, self.optimizer, self.objects = accelerator, model, optimizer, objects
        self.deepspeed = accelerator.state.deepspeed_plugin is not None
        self.signal = None
        self.update = 0  # the last update ended (Run: a resumed run's first; infra/cores.py reads it)
        # (update, run name, logger, records, where the logs stood) of the last update ended, and the
        # random streams then: where a stop after training (in its evaluations) saves
        self.position: Optional[tuple] = None
        self.position_rng: Optional[dict] = None
        if self.folder:
            for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                signal.signal(sig, self._remember)
        if self.deepspeed:
            accelerator.register_for_checkpointing(*objects)

    def _remember(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name
        if signum == signal.SIGINT:  # a second Ctrl-C: KeyboardInterrupt, now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print("Ctrl-C: stopping with a checkpoint at the end of this update (press it again to abort "
                  "without one)", flush=True)

    def newest(self) -> Optional[str]:
        """The newest checkpoint folder, if any."""
        names = sorted(n for n in os.listdir(self.folder) if n.startswith("update-")) if self.folder and \
            os.path.isdir(self.folder) else []
        return os.path.join(self.folder, names[-1]) if names else None

    def load(self, path: str, state: dict) -> None:
        """Restores what `save` wrote (after accelerator.prepare; `state` from find_checkpoint)."""
        rank = self.accelerator.process_index
        try:
            if self.deepspeed:
                self.accelerator.load_state(path)
            else:
                saved = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False)
                model = self.accelerator.unwrap_model(self.model)
                missing, unexpected = model.load_state_dict(saved["model"], strict=False)
                trained = {name for name, p in model.named_parameters() if p.requires_grad}
                if unexpected or trained & set(missing):
                    raise KeyError(f"not this model's: {unexpected[:5]}; missing: {sorted(trained & set(missing))[:5]}")
                self.optimizer.load_state_dict(saved["optimizer"])
                for obj, obj_state in zip(self.objects, saved["objects"], strict=True):
                    obj.load_state_dict(obj_state)
                # another process count: ranks the checkpoint did not have keep their own seeds
                if rank < state["world_size"]:
                    set_rng_state(torch.load(os.path.join(path, f"rng_rank{rank}.pt"), weights_only=False))
        except Exception as e:
            raise ValueError(f"{path}: cannot load the checkpoint ({type(e).__name__}: {e})") from e

    def after_update(self, update: int, run_name: str, logger, records=None) -> None:
        """The safe point at the end of an update: saves a checkpoint when one is due, and after a
        signal (on any rank; all ranks stop at the same update) exits."""
        self.update = update
        if self.folder is None:
            return
        logger_state = logger.state() if self.accelerator.is_main_process else None
        self.position = (update, run_name, logger, records, logger_state)
        self.position_rng = rng_state()
        stop = self.stop_asked()
        if stop:
            self.save(update, run_name, logger, records)  # (one that fails ends the run with its cause)
            self.exit_after_stop(update, logger)
        if self.every and update % self.every == 0:
            try:
                self.save(update, run_name, logger, records)
            except CheckpointWriteError as e:  # the run goes on; its final save has its own rescue
                if self.accelerator.is_main_process:
                    Console(soft_wrap=True).print(f"[bold yellow]WARNING:[/] {escape(str(e))}; the run goes on",
                                                  highlight=False)

    def stop_if_asked(self) -> None:
        """Between two batches of an evaluation after training: after a stop signal, a checkpoint
        where the training ended (a resumed run then only evaluates and saves), and exit."""
        if self.folder is not None and self.position is not None and self.stop_asked():
            set_rng_state(self.position_rng)  # the random streams as the training left them, not the evaluation
            self.save(*self.position)
            self.exit_after_stop(self.position[0], self.position[2])

    def stop_asked(self) -> bool:
        """Whether any rank got a stop signal (all ranks stop at the same point)."""
        asked = torch.tensor(float(self.signal is not None), device=self.accelerator.device)
        return self.accelerator.reduce(asked, "sum").item() > 0

    def exit_after_stop(self, update: int, logger) -> None:
        if self.accelerator.is_main_process:
            print(f"checkpoint saved at update {update} after a stop signal ({self.signal or 'on another rank'}); "
                  f"exiting with status {CHECKPOINT_EXIT_CODE} (rerun with --resume)", flush=True)
        logger.close()
        raise SystemExit(CHECKPOINT_EXIT_CODE)

    def write(self, partial: str, update: int, run_name: str, logger_state: Optional[dict], records) -> None:
        """This process's part of a checkpoint, into the folder `partial`."""
        main = self.accelerator.is_main_process
        if self.deepspeed:
            self.accelerator.save_state(partial)
        else:
            if main:
                # the trained parameters: frozen ones (a LoRA run's base) are reloaded from their own
                # checkpoint at the start of every run
                model = self.accelerator.unwrap_model(self.model)
                trained = {name for name, p in model.named_parameters() if p.requires_grad}
                torch.save({"model": {k: v for k, v in model.state_dict().items() if k in trained},
                            "optimizer": self.optimizer.state_dict(),
                            "objects": [obj.state_dict() for obj in self.objects]}, os.path.join(partial, "state.pt"))
            torch.save(rng_state(), os.path.join(partial, f"rng_rank{self.accelerator.process_index}.pt"))
        if main:
            with open(os.path.join(partial, "trainer_state.json"), "w") as f:
                json.dump({"identity": self.identity, "settings": self.settings, "update": update, "run_name": run_name,
                           "world_size": self.accelerator.num_processes, "deepspeed": self.deepspeed,
                           "logger": logger_state, "records": records}, f)

    def save(self, update: int, run_name: str, logger, records=None, logger_state: Optional[dict] = None) -> None:
        """`logger_state`: where the logs stood at `update`, if they have moved on since (evaluations)."""
        main = self.accelerator.is_main_process
        final = os.path.join(self.folder, f"update-{update:07d}")
        partial = os.path.join(self.folder, f".update-{update:07d}.partial")
        error = None
        if main:
            shutil.rmtree(partial, ignore_errors=True)
            try:
                os.makedirs(partial)
            except OSError as e:
                error = e
        self.accelerator.wait_for_everyone()
        try:
            if error is None:
                self.write(partial, update, run_name, logger_state or (logger.state() if main else None), records)
        except WRITE_ERRORS as e:
            error = e
        failed = self.accelerator.reduce(torch.tensor(float(error is not None), device=self.accelerator.device),
                                         "sum")
        if failed.item() > 0:  # (the reduce is also the barrier: every rank has written, or failed)
            if main:
                shutil.rmtree(partial, ignore_errors=True)
            cause = f"{type(error).__name__}: {error}" if error else "a write failed on another process"
            raise CheckpointWriteError(f"checkpoint {final} could not be written ({cause}; "
                                       f"{human_bytes(shutil.disk_usage(self.folder).free)} free on its disk). "
                                       f"The last checkpoint, {self.newest() or 'none'}, is kept")
        if main:
            shutil.rmtree(final, ignore_errors=True)  # (the same update saved again)
            os.replace(partial, final)
            names = sorted(n for n in os.listdir(self.folder) if n.startswith("update-"))
            for name in names[:-self.keep]:
                shutil.rmtree(os.path.join(self.folder, name))
        self.accelerator.wait_for_everyone()


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (its partial folder removed, the last one kept)."""
