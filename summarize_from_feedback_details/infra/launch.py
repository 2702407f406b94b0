"""A run from its start to its end, the same in every stage: nothing in this module changes a result.

- `start_run`: the prologue every main() shared (the library noise quieted, a refusal where
  nvidia-smi lists GPUs that torch cannot see, gloo for CPU processes, the Accelerator, the DeepSpeed
  micro-batch, accumulation (in fp32) and clipping, the checkpoint to resume and the settings it must
  keep, the run name, the per-rank seeds); its `Run` then prints the batch arithmetic, builds the
  checkpoints and the logger, merges LoRA, saves the model and ends the run;
- no silent failure: `Run.optimizer_step` / `Run.all_finite` stop a run at a non-finite loss,
  gradient or rollout value (--on_nonfinite), `run_summary` ends every run;
- `make_optimizer`, `clipping_norm`: the optimizer and the clipping norm every stage builds alike;
- `gather_global`: a rollout's tensors from every process, for minibatches drawn from the global
  batch.
"""

import datetime
import logging
import os
import random
import shutil
import time
from typing import Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs, broadcast
from rich.console import Console
from rich.markup import escape
from transformers.utils import logging as transformers_logging

from summarize_from_feedback_details.infra.checkpoints import (Checkpoints, changed_settings, find_checkpoint,
                                                               lora_identity, rng_state, run_settings)
from summarize_from_feedback_details.infra.cores import ENV as TAKE_CORES_ENV, CoresAtUpdate
from summarize_from_feedback_details.infra.lora import check_peft_args, merged_model, saved_form
from summarize_from_feedback_details.infra.preflight import (check_fresh_start, check_settings, cuda_problem,
                                                             lock_output_dir)
from summarize_from_feedback_details.infra.saving import (WRITE_ERRORS, check_disk_space, disk_needs, human_bytes,
                                                          push_to_hub, rescue_model, write_model)
from summarize_from_feedback_details.infra.tracking import Logger, metric_status, progress

# A stage stopped by a non-finite loss, gradient or rollout value (--on_nonfinite stop)
NONFINITE_EXIT_CODE = 1


def quiet_libraries() -> None:
    """Quiets the library noise that buried a run's own lines; start_run calls it first, and so do the
    scripts that load models without it. bitsandbytes warns, as it is imported (peft imports it, and
    transformers' optimization module imports peft), that an optional CPU kernel package is missing:
    on every command, --help included, unless its logger is quiet before that import, so a stage that
    imports that module calls this first. DeepSpeed warns that it falls back to the CPU wherever there
    is no GPU (and is told so here). transformers draws a progress bar and prints a load report for
    every model: the loaders (infra/loading.py) check what the report would show (a head missing from
    the checkpoint) and stop with what it means. Nothing is quieted by importing a module."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


def make_optimizer(args, model, groups: tuple = ()) -> torch.optim.Optimizer:
    """`--optimizer` over the trainable parameters with --lr, --eps and --weight_decay (adamw:
    decoupled weight decay; adam: torch's Adam, which adds the decay to the gradient). `groups`:
    submodules of `model` that each get their own parameter group, in this order, so that a stage can
    set their learning rates apart (Adam's update is elementwise: groups at one rate update as one).
    Under --compile_train torch's fused kernel (one kernel per step where the default loops over
    tensors on a CPU; the same update to float noise, tests/test_packing.py)."""
    optimizer_class = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
    fused = {"fused": True} if getattr(args, "compile_train", False) else {}
    param_groups = [{"params": [p for p in part.parameters() if p.requires_grad]} for part in groups or (model,)]
    return optimizer_class(param_groups, lr=args.lr, eps=args.eps, weight_decay=args.weight_decay, **fused)


def clipping_norm(max_grad_norm: Optional[float]) -> Optional[float]:
    """The gradient norm to clip at, or None for no clipping (unset or <= 0). torch's
    clip_grad_norm_ at 0 would zero every gradient, and DeepSpeed reads 0 as "off": this makes both
    backends agree."""
    return max_grad_norm if max_grad_norm is not None and max_grad_norm > 0 else None


def start_run(args, identity: dict, generates: bool = False) -> "Run":
    """The prologue of every stage, after its batch arithmetic (`args.world_size` and the batch
    fields are set): the Accelerator (CPU processes talk over gloo; a single plain process needs no
    group at all), the checks of --deepspeed / --offload / LoRA, DeepSpeed told our micro-batch,
    accumulation and clipping (accelerate would fill in 1.0 where nothing is set; DeepSpeed reads 0
    as "off"), the checkpoint to resume (`identity`: what a checkpoint must match to continue this
    run; any process count), the run name (rank 0's clock, broadcast so every rank logs under one
    name; a resumed run keeps its own) and the per-rank seeds of DESIGN section 4. A stage that
    `generates` from the trained model's unwrapped module refuses ZeRO-3 for it."""
    quiet_libraries()  # (before the Accelerator, DeepSpeed and the first model load)
    problem = cuda_problem()
    if problem and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes"):
        raise RuntimeError(problem)  # a GPU run would otherwise run on the CPU, without a word
    check_settings(args)
    # before the process group: the refused rank ends the launch without the others waiting on it
    lock = lock_output_dir(args.output_dir) if args.output_dir and int(os.environ.get("RANK", "0")) == 0 else None
    check_fresh_start(args)
    distributed_cpu = "WORLD_SIZE" in os.environ and not torch.cuda.is_available()
    kwargs_handlers = [InitProcessGroupKwargs(backend="gloo")] if distributed_cpu else []
    accelerator = Accelerator(
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False),
        kwargs_handlers=kwargs_handlers,
    )
    assert accelerator.num_processes == args.world_size, (accelerator.num_processes, args.world_size)
    deepspeed_plugin = accelerator.state.deepspeed_plugin
    if args.deepspeed and deepspeed_plugin is None:
        raise ValueError("--deepspeed given, but accelerate is not configured for DeepSpeed "
                         "(accelerate launch --config_file deepspeed.yaml ...)")
    if getattr(args, "offload", False) and deepspeed_plugin is None:
        raise ValueError("--offload puts the frozen models on DeepSpeed ZeRO-3: launch with a DeepSpeed "
                         "accelerate config (accelerate launch --config_file deepspeed.yaml ...)")
    if generates and deepspeed_plugin is not None and deepspeed_plugin.zero_stage == 3:
        raise ValueError("the policy generates from its unwrapped module, which needs full parameters on "
                         "every rank: use ZeRO-2 for the trained models (deepspeed.yaml); --offload puts the "
                         "frozen reference and reward models on ZeRO-3")
    check_peft_args(args, deepspeed_plugin is not None)
    clip_norm = clipping_norm(args.max_grad_norm)
    if deepspeed_plugin is not None:
        # our loaders yield whole local batches: one micro-batch per backward, one optimizer step per
        # `gradient_accumulation_steps` of them; clipping inside DeepSpeed's step
        deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.local_micro_batch_size
        deepspeed_plugin.deepspeed_config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
        deepspeed_plugin.deepspeed_config["gradient_clipping"] = clip_norm or 0.0
        if deepspeed_plugin.zero_stage >= 1:
            # gradients accumulate over micro-batches in fp32, also with bf16 weights: accumulated in
            # bf16, 16 x 1 and 1 x 16 micro-batches gave updates 5e-3 apart (the memory knobs changed it)
            deepspeed_plugin.deepspeed_config["data_types"] = {"grad_accum_dtype": "fp32"}
    identity = {**identity, "lora": lora_identity(args)}
    if (args.resume or args.checkpoint_every) and not args.output_dir:
        raise ValueError("--resume and --checkpoint_every keep checkpoints in <output_dir>/checkpoints: set --output_dir")
    resumed = (find_checkpoint(args.output_dir, identity, args.world_size, deepspeed_plugin is not None)
               if args.resume else None)
    saved_settings = resumed[1].get("settings") if resumed else None  # (older checkpoints have none)
    changes = changed_settings(saved_settings, run_settings(args)) if saved_settings is not None else []
    if changes and not args.accept_changed_settings:
        raise ValueError(f"{resumed[0]} was written with other settings: {'; '.join(changes)}. Resume with the "
                         "checkpoint's flags, or add --accept_changed_settings to continue with these")
    stamp = broadcast(torch.tensor(int(time.time()), device=accelerator.device), 0).item()
    args.run_name = resumed[1]["run_name"] if resumed else args.run_name or f"{args.exp_name}__{args.seed}__{stamp}"
    local_seed = args.seed + accelerator.process_index * 100003
    random.seed(local_seed)
    np.random.seed(local_seed)
    torch.manual_seed(local_seed)
    torch.backends.cudnn.deterministic = True
    return Run(args, accelerator, identity, resumed, local_seed, clip_norm, changes, lock)


class Run:
    """A started run (from `start_run`): its accelerator, where it resumes from, and the calls that
    bracket the training loop."""

    def __init__(self, args, accelerator: Accelerator, identity: dict, resumed: Optional[tuple], local_seed: int,
                 clip_norm: Optional[float], changed_settings: list = (), lock=None):
        self.args, self.accelerator, self.identity, self.resumed = args, accelerator, identity, resumed
        self.local_seed, self.clip_norm, self.changed_settings = local_seed, clip_norm, list(changed_settings)
        self.deepspeed = accelerator.state.deepspeed_plugin is not None
        self.start_update = resumed[1]["update"] if resumed else 0
        # what the stage asked the checkpoints to keep (reward/dpo: the pairs trained on so far)
        self.records = resumed[1]["records"] if resumed else None
        self.console = Console(soft_wrap=True)  # a log keeps each line whole (a path, a warning) for grep
        self.lock, self.started = lock, time.time()
        self.checkpoints, self.logger = None, None  # (checkpoints_and_logger)
        self.key_metrics: tuple = ()  # what the progress lines and the summary show (progress)
        self.loss_finite = None  # (optimizer_step: whether this step's micro-batch losses were finite)
        self.deepspeed_skipped = 0
        self.cores_at_update = CoresAtUpdate(os.environ.get(TAKE_CORES_ENV))  # (progress)

    def print(self, *objects, **kwargs) -> None:
        """Prints on the main process only."""
        if self.accelerator.is_main_process:
            self.console.print(*objects, **kwargs)

    def print_batch_arithmetic(self, unit: str, *details: str) -> None:
        """The derived batch arithmetic (DESIGN section 4: `unit` is what the batch counts) with the
        settings that shape every update, then the stage's own `details`."""
        args = self.args
        factors = [f"world_size {args.world_size}", f"local_micro_batch_size {args.local_micro_batch_size}",
                   f"gradient_accumulation_steps {args.gradient_accumulation_steps}"]
        batch = f"batch_size {args.batch_size} {unit}"
        if hasattr(args, "nminibatches"):
            factors.append(f"nminibatches {args.nminibatches}")
            batch += f" (minibatch {args.mini_batch_size})"
        left_over = args.total_episodes - args.num_updates * args.batch_size
        self.print("; ".join([" x ".join(factors) + " = " + batch,
                              f"{args.num_updates} updates over {args.total_episodes} episodes ({left_over} left over)",
                              f"weight_decay {args.weight_decay}", f"gradient clipping {self.clip_norm or 'off'}",
                              *details]))

    def checkpoints_and_logger(self, model, optimizer, objects: list) -> tuple:
        """After accelerator.prepare: the `Checkpoints` of `model`, `optimizer` and `objects` (a
        scheduler, a KL controller), restored from the checkpoint being resumed, and the `Logger`,
        continuing that checkpoint's logs."""
        if self.deepspeed:  # what the engine really got
            weights, accumulation = model.get_data_types()
            self.print(f"DeepSpeed engine: ZeRO-{model.zero_optimization_stage()}, "
                       f"gradient_clipping {model.gradient_clipping()}, weights {weights}, "
                       f"gradients accumulated in {accumulation}")
        if self.args.output_dir:
            final, checkpoint = disk_needs(self.accelerator.unwrap_model(model))
            warning = check_disk_space(self.args.output_dir, final, checkpoint,
                                       self.args.keep_checkpoints + 1 if self.args.checkpoint_every else 0)
            if warning:
                self.print(f"[bold yellow]WARNING:[/] {escape(warning)}", highlight=False)
        checkpoints = Checkpoints(self.args, self.accelerator, model, optimizer, objects, self.identity)
        if self.resumed:
            checkpoints.load(*self.resumed)
            self.print(f"resumed run {self.args.run_name} from {self.resumed[0]} at update {self.start_update}")
            if self.changed_settings:
                self.print(f"[bold yellow]WARNING: resumed with changed settings (--accept_changed_settings): "
                           f"{'; '.join(self.changed_settings)}")
        logger = Logger(self.args, self.accelerator, resume=self.resumed[1]["logger"] if self.resumed else None)
        checkpoints.update = self.start_update
        checkpoints.position = (self.start_update, self.args.run_name, logger, self.records,
                                logger.state() if self.accelerator.is_main_process else None)
        checkpoints.position_rng = rng_state()
        self.checkpoints, self.logger = checkpoints, logger
        return checkpoints, logger

    # -- non-finite values (--on_nonfinite) ----------------------------------------------------

    def optimizer_step(self, model, optimizer, update: int, loss: torch.Tensor) -> None:
        """The end of a micro-batch inside `accelerator.accumulate(model)`, after its backward. At the
        accumulation boundary: clips at --max_grad_norm (under DeepSpeed the engine clipped and stepped
        inside backward, skipping a step whose gradient is not finite), then steps, unless this
        step's loss or gradient norm is not finite: --on_nonfinite stop ends the run there (nothing
        applied, no model saved), skip leaves the weights as they were and counts it. Between
        boundaries it only notes, on the device, whether `loss` was finite. One reduce per step: a
        rank's non-finite loss stops every rank at the same step."""
        accelerator = self.accelerator
        finite = torch.isfinite(loss.detach()).all()
        self.loss_finite = finite if self.loss_finite is None else self.loss_finite & finite
        if not accelerator.sync_gradients:
            return
        if self.deepspeed:
            skipped = model.skipped_steps - self.deepspeed_skipped
            self.deepspeed_skipped = model.skipped_steps
            # (fp16: a skipped step is the loss scaler finding its scale, not a failure)
            norm_finite = torch.tensor(skipped == 0 or accelerator.mixed_precision == "fp16", device=accelerator.device)
        else:
            if self.clip_norm is not None:
                norm = accelerator.clip_grad_norm_(model.parameters(), self.clip_norm)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
            # (fp16 under a grad scaler: inf gradients are how the scaler finds its scale; it skips those)
            norm_finite = torch.isfinite(norm) | (accelerator.scaler is not None)
        bad = accelerator.reduce(torch.stack([~self.loss_finite, ~norm_finite]).float(), "sum") > 0
        self.loss_finite = None
        if bad.any():
            optimizer.zero_grad()
            self.nonfinite(update, "optimizer step", [n for n, b in zip(("loss", "gradient norm"), bad.tolist()) if b])
            return
        optimizer.step()
        optimizer.zero_grad()

    def all_finite(self, update: int, phase: str, **tensors: torch.Tensor) -> bool:
        """Whether every value of `tensors` is finite on every process (one reduce); if not,
        --on_nonfinite stop ends the run with their names, and skip returns False for the stage to
        skip the rest of the update."""
        bad = self.accelerator.reduce(torch.stack([(~torch.isfinite(t)).any() for t in tensors.values()]).float(),
                                      "sum") > 0
        if not bad.any():
            return True
        self.nonfinite(update, phase, [n for n, b in zip(tensors, bad.tolist()) if b])
        return False

    def nonfinite(self, update: int, phase: str, names: list) -> None:
        what = f"update {update}, {phase}: non-finite {' and '.join(names)}"
        if self.args.on_nonfinite == "skip":
            self.logger.nonfinite_skipped += 1
            self.print(f"[bold yellow]WARNING: {what}; skipped (--on_nonfinite skip; "
                       f"{self.logger.nonfinite_skipped} so far)", highlight=False)
            return
        newest = self.checkpoints.newest() if self.checkpoints else None
        self.print(f"[bold red]STOPPED: {what}.[/] No model saved; "
                   + (f"the last checkpoint, {newest}, is kept: --resume continues from it (with a lower --lr or "
                      "other settings, add --accept_changed_settings). " if newest else "there is no checkpoint. ")
                   + "--on_nonfinite skip would skip such updates instead", highlight=False)
        if self.logger:
            self.logger.close()
        raise SystemExit(NONFINITE_EXIT_CODE)

    # -- progress and the end of the run ----------------------------------------------------

    def progress(self, iterable, total: int, description: str, key_metrics: tuple = (), stoppable: bool = False):
        """`iterable` with `progress` lines on the main process showing `key_metrics` (the newest
        logged values; the summary at the end shows them too). `stoppable` (the evaluations after
        training): a stop signal between two items saves a checkpoint and exits (Checkpoints)."""
        if key_metrics:
            self.key_metrics = key_metrics
        status = (lambda: metric_status(self.logger.latest, key_metrics)) if key_metrics and self.logger else None
        self.take_cores(description)  # (a run resumed past the hand-off update: before its first item)
        for item in progress(iterable, total, description, self.accelerator.is_main_process, status):
            yield item
            self.take_cores(description)
            if stoppable and self.checkpoints is not None:
                self.checkpoints.stop_if_asked()

    def take_cores(self, description: str) -> None:
        """From the update TAKE_CORES_AT names on, the cores of the job beside once it has ended
        (infra/cores.py), the update read from the checkpoints' count of updates ended. A stop signal
        while waiting for them saves the checkpoint of that update and exits, so that the resumed run
        takes the cores where the uninterrupted one did."""
        update = self.checkpoints.update if self.checkpoints is not None else self.start_update
        stopping = lambda: self.checkpoints is not None and self.checkpoints.signal is not None  # noqa: E731
        taken = self.cores_at_update.poll(update, stopping, lambda message: self.print(f"{description}: {message}"))
        if self.cores_at_update.stopped:
            self.checkpoints.stop_if_asked()
        if taken:
            self.print(f"{description}: the job beside this one ended; from update {update + 1} on {taken} threads")

    def merged_lora_model(self, model, load_base):
        """A LoRA run's trained `model` as the plain model it is saved as, on every process: the
        adapter alone to <output_dir>/adapter (main process), then `merged_model` over `load_base()`."""
        unwrapped = self.accelerator.unwrap_model(model)
        if self.args.output_dir and self.accelerator.is_main_process:
            unwrapped.save_pretrained(os.path.join(self.args.output_dir, "adapter"))
        return merged_model(unwrapped, load_base).to(self.accelerator.device).eval()

    def save(self, model, tokenizer, module, load_base=None, prefix: str = "") -> None:
        """The final save to --output_dir (and --push_to_hub): `module` (unwrapped) with the weights
        of `model`'s state dict, those under `prefix` only (PPO's policy of policy + critic), and the
        tokenizer. With `load_base` (a stage's loader of the untrained base) a LoRA module is saved
        as its merged model, the adapter alone in <output_dir>/adapter (`saved_form`); without it,
        `module` is saved as it is."""
        args, accelerator = self.args, self.accelerator
        if not args.output_dir:
            return
        accelerator.wait_for_everyone()
        state_dict = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            if prefix:
                state_dict = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
            if load_base is not None:
                module, state_dict = saved_form(module, state_dict, args.output_dir, load_base, args.use_peft)
            try:
                write_model(module, state_dict, tokenizer, args.output_dir)
            except WRITE_ERRORS as e:
                self.save_failed(module, state_dict, tokenizer, e)
            if args.push_to_hub:
                push_to_hub(args, module, tokenizer, state_dict)

    def save_failed(self, module, state_dict: dict, tokenizer, error: Exception) -> None:
        """The final save failed: the trained weights exist only in memory, so they go to another disk
        (`rescue_model`) before the run ends with an error that says where they are."""
        output_dir = self.args.output_dir
        cause = f"{type(error).__name__}: {error}; {human_bytes(shutil.disk_usage(output_dir).free)} free there"
        rescued = rescue_model(module, state_dict, tokenizer, output_dir)
        newest = self.checkpoints.newest() if self.checkpoints else None
        if rescued:
            memory = " (memory-backed: move it before a reboot)" if rescued.startswith("/dev/shm") else ""
            where = f"The trained model was written to {rescued} instead{memory}: move its files into {output_dir}"
        else:
            where = ("It could not be written anywhere else either: "
                     + (f"{newest}, the last checkpoint, is kept; once there is room, the same command with --resume "
                        "continues from it" if newest else "there is no checkpoint to continue from"))
        raise RuntimeError(f"the final save to {output_dir} failed ({cause}). {where}") from error

    def finish(self, logger) -> None:
        """Closes the logs, ends the processes and prints where everything went."""
        if torch.cuda.is_available():
            self.print(f"peak GPU memory of rank 0: {torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB")
        logger.close()
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        self.print(run_summary(self.args, self.identity["stage"], time.time() - self.started, self.start_update,
                               logger, self.key_metrics), highlight=False)
        if self.lock is not None:
            self.lock.close()


def run_summary(args, stage: str, seconds: float, start_update: int, logger, key_metrics: tuple) -> str:
    """The block a run ends with: what ran, how long, the last values of its key metrics, and where
    the model, the metrics and the TensorBoard events went."""
    resumed = f" (resumed at update {start_update})" if start_update else ""
    lines = [f"── {stage} done: {args.run_name}, {args.num_updates} updates{resumed} in "
             f"{datetime.timedelta(seconds=round(seconds))}",
             f"  model        {args.output_dir or '(not saved: no --output_dir)'}"
             + (f" (LoRA adapter alone: {os.path.join(args.output_dir, 'adapter')})"
                if args.use_peft and args.output_dir else ""),
             f"  metrics      {os.path.join(logger.folder, 'metrics.jsonl')} (and the tables: *.csv there)",
             f"  TensorBoard  tensorboard --logdir {logger.folder}"]
    if logger.wandb_url:
        lines.append(f"  wandb        {logger.wandb_url}")
    if metric_status(logger.latest, key_metrics):
        lines.append(f"  last values  {metric_status(logger.latest, key_metrics)}")
    if logger.nonfinite_skipped:
        lines.append(f"  skipped      {logger.nonfinite_skipped} non-finite optimizer steps or rollouts "
                     "(--on_nonfinite skip)")
    return "\n".join(lines)


def gather_global(accelerator: Accelerator, *tensors: torch.Tensor) -> list:
    """Each tensor gathered over the processes along its first dimension, in rank order: the global
    batch on every process (one process: the tensors themselves). Bools travel as integers (gloo
    cannot gather them)."""
    return [accelerator.gather(t.long()).bool() if t.dtype == torch.bool else accelerator.gather(t) for t in tensors]
