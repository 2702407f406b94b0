"""Run infrastructure of the stages: nothing in this module changes a result.

What can change a result (data order, batch arithmetic, masks, losses, advantages, KL, generation
settings, eval metrics) lives in the stage files, where a researcher reads it top to bottom
(DESIGN.md section 1). What is here makes a run start, stop, resume, log and save the same way in
every stage, and is written once:

- loaders (`load_tokenizer`, `load_split_dataset`, `load_policy`, `load_reward_model`): local
  folders or hub names, a clear error for a path that does not exist, fp32 master weights, the
  `[PAD]` row of the embedding, dropout off (the N+ detail every stage needs);
- LoRA and 4-bit plumbing (`check_peft_args`, `quantization`, `with_lora`, `reference_policy`,
  `merged_model`, `saved_form`): peft adapters over frozen (optionally NF4) base weights, the
  reference as the policy with its adapter disabled, and a merged model that plain transformers
  loads;
- frozen DeepSpeed engines (`frozen_dtype`, `prepare_frozen`, `describe_frozen`): reference and
  reward models as inference engines, ZeRO-3 with CPU offload under `--offload`;
- `start_run`: the prologue every main() shared (a refusal where nvidia-smi lists GPUs that torch
  cannot see, gloo for CPU processes, the Accelerator, the DeepSpeed micro-batch, accumulation
  (in fp32) and clipping, the checkpoint to resume and the settings it must keep, the run name, the
  per-rank seeds); its `Run` then prints the batch arithmetic, builds the checkpoints and the
  logger, merges LoRA, saves the model and ends the run;
- `gather_global`: a rollout's tensors from every process, for minibatches drawn from the global
  batch;
- `Logger`: TensorBoard + metrics.jsonl + wandb, continued exactly by a resumed run;
- `Checkpoints`: atomic checkpoints, exact resume on any process count, the stop signals;
- `PhaseTimer`: seconds per phase of an update;
- `push_to_hub`: only with --push_to_hub, no hub call otherwise.

No base classes, callbacks or hooks: plain functions and a few concrete classes that a stage calls
where the reader sees it.
"""

import contextlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import time
from dataclasses import asdict
from typing import Optional

import numpy as np
import pandas as pd
import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs, broadcast
from datasets import load_dataset, load_from_disk
from rich.console import Console
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig


# ---------------------------------------------------------------------------------------------
# loaders
# ---------------------------------------------------------------------------------------------


def looks_local(path: str) -> bool:
    return os.path.exists(path) or path.startswith((".", "/", "~")) or path.count("/") > 1


def check_model_path(path: str) -> None:
    if looks_local(path) and not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path} does not exist")


def load_tokenizer(name: str):
    """`name`'s tokenizer, right-padding, with a dedicated pad token that is never EOS (Pythia has
    none: `[PAD]` is added, and id 50277 fits in its 50304-row embedding) and an EOS text that
    encodes to the EOS id (the datasets append it as text)."""
    check_model_path(name)
    tokenizer = AutoTokenizer.from_pretrained(name, padding_side="right")
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    if tokenizer.eos_token is None:
        raise ValueError(f"tokenizer {name} has no EOS token")
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(f"tokenizer {name}: pad token equals EOS ({tokenizer.eos_token!r}); the pad token must be a "
                         "dedicated token such as [PAD], or EOS could never be learned")
    if tokenizer.encode(tokenizer.eos_token) != [tokenizer.eos_token_id]:
        raise ValueError(f"tokenizer {name}: EOS text {tokenizer.eos_token!r} does not encode to its id")
    return tokenizer


def load_split_dataset(name: str, columns: tuple, kind: str = "SFT"):
    if looks_local(name):
        if not os.path.isdir(name):
            raise FileNotFoundError(f"dataset {name} does not exist (build it with tldr_dataset.py)")
        dataset = load_from_disk(name)
    else:
        dataset = load_dataset(name)
    for split, ds in dataset.items():
        missing = [c for c in columns if c not in ds.column_names]
        if missing:
            raise ValueError(f"dataset {name} split {split} lacks columns {missing}; is it the {kind} dataset "
                             "written by tldr_dataset.py?")
    return dataset


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def frozen_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype of the reference policy and reward model, which never train: the mixed-precision
    dtype when there is one (DeepSpeed would cast an fp32 copy to it anyway, after the host had held
    it: 4 bytes per parameter per process instead of 2), else fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)


def load_policy(path: str, tokenizer, dtype: torch.dtype = torch.float32, **quantized):
    """A causal LM in `dtype` whatever the checkpoint's (fp32 master weights for the trained policy;
    mixed precision is accelerate's job); `quantized`: from `quantization`."""
    check_model_path(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **quantized)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    disable_dropout(model)
    return model


def load_reward_model(path: str, tokenizer, dtype: torch.dtype = torch.float32, **quantized):
    """A saved reward model (reward.py), head and normalisation included, in `dtype`."""
    check_model_path(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype, **quantized)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    # HF's pooling reads the rightmost token that is not config.pad_token_id: the EOS
    model.config.pad_token_id = tokenizer.pad_token_id
    disable_dropout(model)
    return model


def enable_gradient_checkpointing(model) -> None:
    """Activation checkpointing of every layer, non-reentrant: the backward recomputes exactly the
    forward it replaces (dropout is off), and no input needs requires_grad. transformers 5.23 renamed
    the method; older 5.x only has the first name."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# ---------------------------------------------------------------------------------------------
# LoRA and 4-bit base weights (DESIGN section 18)
# ---------------------------------------------------------------------------------------------


def check_peft_args(args, deepspeed: bool) -> None:
    """Stops on LoRA / 4-bit settings that cannot work, before any model is loaded."""
    if args.load_in_4bit and not args.use_peft:
        raise ValueError("--load_in_4bit freezes 4-bit base weights under LoRA adapters: add --use_peft")
    if args.use_peft and args.lora_r < 1:
        raise ValueError(f"--lora_r must be >= 1, got {args.lora_r}")
    if args.use_peft and not 0 <= args.lora_dropout < 1:
        raise ValueError(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if not args.load_in_4bit:
        return
    if deepspeed:
        raise ValueError("--load_in_4bit: DeepSpeed cannot partition bitsandbytes' packed 4-bit weights; "
                         "launch without DeepSpeed (one process or DDP)")
    capability = torch.backends.cpu.get_cpu_capability()
    if not torch.cuda.is_available() and not (platform.machine() in ("x86_64", "AMD64")
                                              and capability in ("AVX2", "AVX512")):
        raise ValueError(f"--load_in_4bit: bitsandbytes' 4-bit kernels need a CUDA GPU or an x86-64 CPU with AVX2; "
                         f"this machine has no GPU and a {platform.machine()} CPU with capability {capability}")


def quantization(args, device: torch.device) -> dict:
    """`from_pretrained` arguments of --load_in_4bit: NF4 base weights placed on this process's
    device, computing in fp32 (mixed precision autocasts them like any other layer)."""
    if not args.load_in_4bit:
        return {}
    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                      bnb_4bit_compute_dtype=torch.float32),
            "device_map": {"": device}}


def with_lora(model, args, head: Optional[str] = None):
    """`model` with the LoRA adapters of --use_peft, base weights frozen. "all-linear" adapts every
    linear layer but the LM head; `head` (a reward model's or critic's `score`) trains in full: peft
    keeps a trainable copy and the original, which the disabled adapter uses. The adapters start as
    a zero update (B = 0): the wrapped model computes exactly what the base does. (peft is imported
    here: it takes seconds to import, bitsandbytes with it, and only LoRA runs need it.)"""
    from peft import LoraConfig, get_peft_model

    if args.load_in_4bit:
        import bitsandbytes

        for module in model.modules():
            if isinstance(module, bitsandbytes.nn.Linear4bit):
                # bitsandbytes 0.50 repacks 4-bit weights into an inference layout at the first no-grad
                # eval-mode forward on AVX512-BF16 CPUs (a rollout), after which every backward fails
                module.support_avx512bf16_for_cpu = False
    targets = args.lora_target_modules
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules="all-linear" if targets == ["all-linear"] else targets,
                        modules_to_save=[head] if head else None)
    return get_peft_model(model, config)


def trainable_parameters(model) -> str:
    # (ZeRO-3 loads each rank's shard only: a parameter's full size is its ds_numel)
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    trainable, total = sum(n for n, trains in sizes if trains), sum(n for n, _ in sizes)
    return f"{trainable:,} trainable parameters of {total:,} ({trainable / total:.2%})"


def merged_model(model, load_base):
    """A plain transformers model: `model`'s LoRA adapter (peft) merged into its base as loaded from
    disk in full precision, `load_base()`. Merging into the weights the run holds would round the
    adapter's update away where they are low-precision: most of it over 4-bit NF4 weights, and under
    DeepSpeed bf16 (whose engine holds the module in bf16) about a third of an update of std 1e-4
    on weights of std 0.02. `model` is untouched (peft's merge_and_unload rewrites its model)."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    full = get_peft_model(load_base(), model.peft_config["default"])
    set_peft_model_state_dict(full, get_peft_model_state_dict(model))
    return full.merge_and_unload()


def saved_form(model, state_dict: dict, output_dir: str, load_base, use_peft: bool) -> tuple:
    """What `output_dir` gets, as (model, state dict): a model as it is, or a LoRA model (peft) as
    its merged model, after the adapter alone is written to `output_dir`/adapter."""
    if not use_peft:
        return model, state_dict
    model.save_pretrained(os.path.join(output_dir, "adapter"))
    merged = merged_model(model, load_base)
    return merged, merged.state_dict()


@contextlib.contextmanager
def reference_policy(policy, ref_policy):
    """The model of a reference forward: `ref_policy`, or with LoRA (`ref_policy` None) the policy
    itself with its adapter disabled, which computes exactly the SFT model's logits."""
    if ref_policy is not None:
        yield ref_policy
    else:
        with policy.disable_adapter():
            yield policy


# ---------------------------------------------------------------------------------------------
# frozen models under DeepSpeed
# ---------------------------------------------------------------------------------------------


def prepare_frozen(model, args, accelerator: Accelerator):
    """Reference policy and reward model: no gradients, eval mode. Under DeepSpeed they become
    inference engines in the trainable model's precision (as the paper); with --offload, ZeRO-3
    engines whose parameters live on the CPU and are gathered layer by layer for each forward.
    None (a LoRA run's reference, the policy itself) stays None."""
    if model is None:
        return None
    model.requires_grad_(False)
    if accelerator.state.deepspeed_plugin is None:
        return model.to(accelerator.device).eval()
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": args.local_micro_batch_size,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": accelerator.mixed_precision == "bf16"},
        "fp16": {"enabled": accelerator.mixed_precision == "fp16"},
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }
    if args.offload:
        config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 1e4,
                                       "offload_param": {"device": "cpu"}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def describe_frozen(model) -> str:
    """How a frozen model is held (printed at startup, so a run shows its dtype and where --offload
    put it); None is a LoRA run's reference."""
    if model is None:
        return "the policy, its LoRA adapter disabled"
    dtype = next(model.parameters()).dtype
    if not hasattr(model, "zero_optimization_stage"):
        return f"plain module on {next(model.parameters()).device}, {dtype}"
    offload = model.zero_offload_param()
    device = getattr(offload.device, "value", offload.device) if offload is not None else "none"
    local = sum(p.numel() for p in model.module.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.module.parameters())
    return (f"DeepSpeed ZeRO-{model.zero_optimization_stage()} engine, {dtype}, parameter offload {device}, "
            f"{local} of {total} parameters resident on this rank")


# ---------------------------------------------------------------------------------------------
# the start and the end of a run
# ---------------------------------------------------------------------------------------------


def clipping_norm(max_grad_norm: Optional[float]) -> Optional[float]:
    """The gradient norm to clip at, or None for no clipping (unset or <= 0). torch's
    clip_grad_norm_ at 0 would zero every gradient, and DeepSpeed reads 0 as "off": this makes both
    backends agree."""
    return max_grad_norm if max_grad_norm is not None and max_grad_norm > 0 else None


# the oldest NVIDIA driver (Linux) that runs a CUDA major version's builds (CUDA 12's minor-version
# compatibility covers 12.0-12.9 from R525)
MINIMUM_DRIVER = {12: 525, 13: 580}


def nvidia_smi_gpus() -> list:
    """(name, driver version) of each GPU nvidia-smi lists; none where it is missing or fails."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if listed.returncode:
        return []
    return [tuple(part.strip() for part in line.rsplit(",", 1)) for line in listed.stdout.splitlines() if line.strip()]


def cuda_problem() -> Optional[str]:
    """Why this process would run on the CPU although the node has GPUs: nvidia-smi lists some that
    torch cannot see (a CPU build of torch, or a CUDA build newer than the driver). None where torch
    sees a GPU, nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them on purpose."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_available() or (hidden is not None and hidden.strip() in ("", "-1")):
        return None
    gpus = nvidia_smi_gpus()
    if not gpus:
        return None
    name, driver = gpus[0] if len(gpus[0]) == 2 else (gpus[0][0], "unknown")
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU build"
    else:
        major = int(torch.version.cuda.split(".")[0])
        why = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, which needs NVIDIA driver "
               f"{MINIMUM_DRIVER.get(major, '(see NVIDIA)')} or newer, and this node's driver is {driver}")
    return (f"nvidia-smi lists {len(gpus)} GPU(s) ({name}, driver {driver}) but torch sees none: {why}. Install a "
            "torch built for a CUDA this driver runs (docs/real_pipeline.md, the driver requirement), or set "
            "ACCELERATE_USE_CPU=1 to run on the CPU on purpose")


def lora_identity(args) -> Optional[list]:
    """The LoRA settings a checkpoint of adapters over frozen weights resumes only with."""
    return [args.lora_r, args.lora_alpha, args.lora_target_modules, args.load_in_4bit] if args.use_peft else None


# Args a resumed run may change: memory and speed knobs (they change no result), and how the run is
# launched, logged and saved; every other field must be the checkpoint's (--accept_changed_settings)
RESUME_MAY_CHANGE = {"world_size", "local_micro_batch_size", "gradient_accumulation_steps", "local_batch_size",
                     "local_mini_batch_size", "local_eval_batch_size", "local_generation_batch_size",
                     "gradient_checkpointing", "deepspeed", "offload", "compile_decode", "free_decode_cache",
                     "resume", "checkpoint_every", "keep_checkpoints", "accept_changed_settings", "run_name",
                     "exp_name", "track", "wandb_project_name", "wandb_entity", "push_to_hub", "hf_entity",
                     "output_dir", "print_sample_output_freq", "run_eval"}


def run_settings(args) -> dict:
    """The Args that decide the run's results (all but RESUME_MAY_CHANGE), as JSON values: a checkpoint
    records them, and a resumed run must keep them."""
    return {k: v for k, v in json.loads(json.dumps(asdict(args))).items() if k not in RESUME_MAY_CHANGE}


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


def start_run(args, identity: dict, generates: bool = False) -> "Run":
    """The prologue of every stage, after its batch arithmetic (`args.world_size` and the batch
    fields are set): the Accelerator (CPU processes talk over gloo; a single plain process needs no
    group at all), the checks of --deepspeed / --offload / LoRA, DeepSpeed told our micro-batch,
    accumulation and clipping (accelerate would fill in 1.0 where nothing is set; DeepSpeed reads 0
    as "off"), the checkpoint to resume (`identity`: what a checkpoint must match to continue this
    run; any process count), the run name (rank 0's clock, broadcast so every rank logs under one
    name; a resumed run keeps its own) and the per-rank seeds of DESIGN section 4. A stage that
    `generates` from the trained model's unwrapped module refuses ZeRO-3 for it."""
    problem = cuda_problem()
    if problem and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes"):
        raise RuntimeError(problem)  # a GPU run would otherwise run on the CPU, without a word
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
    return Run(args, accelerator, identity, resumed, local_seed, clip_norm, changes)


class Run:
    """A started run (from `start_run`): its accelerator, where it resumes from, and the calls that
    bracket the training loop."""

    def __init__(self, args, accelerator: Accelerator, identity: dict, resumed: Optional[tuple], local_seed: int,
                 clip_norm: Optional[float], changed_settings: list = ()):
        self.args, self.accelerator, self.identity, self.resumed = args, accelerator, identity, resumed
        self.local_seed, self.clip_norm, self.changed_settings = local_seed, clip_norm, list(changed_settings)
        self.deepspeed = accelerator.state.deepspeed_plugin is not None
        self.start_update = resumed[1]["update"] if resumed else 0
        # what the stage asked the checkpoints to keep (reward/dpo: the pairs trained on so far)
        self.records = resumed[1]["records"] if resumed else None
        self.console = Console()

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
        checkpoints = Checkpoints(self.args, self.accelerator, model, optimizer, objects, self.identity)
        if self.resumed:
            checkpoints.load(*self.resumed)
            self.print(f"resumed run {self.args.run_name} from {self.resumed[0]} at update {self.start_update}")
            if self.changed_settings:
                self.print(f"[bold yellow]WARNING: resumed with changed settings (--accept_changed_settings): "
                           f"{'; '.join(self.changed_settings)}")
        logger = Logger(self.args, self.accelerator, resume=self.resumed[1]["logger"] if self.resumed else None)
        return checkpoints, logger

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
            tokenizer.save_pretrained(args.output_dir)
            module.save_pretrained(args.output_dir, state_dict=state_dict)  # (safetensors)
            if args.push_to_hub:
                push_to_hub(args, module, tokenizer, state_dict)

    def finish(self, logger) -> None:
        if torch.cuda.is_available():
            self.print(f"peak GPU memory of rank 0: {torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB")
        logger.close()
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()


def gather_global(accelerator: Accelerator, *tensors: torch.Tensor) -> list:
    """Each tensor gathered over the processes along its first dimension, in rank order: the global
    batch on every process (one process: the tensors themselves). Bools travel as integers (gloo
    cannot gather them)."""
    return [accelerator.gather(t.long()).bool() if t.dtype == torch.bool else accelerator.gather(t) for t in tensors]


# ---------------------------------------------------------------------------------------------
# logs, checkpoints, timing
# ---------------------------------------------------------------------------------------------


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
        if not self.main:
            return
        if args.track:
            import wandb

            self.wandb_id = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                                       config=asdict(args), name=args.run_name, save_code=True, id=self.wandb_id,
                                       resume="allow" if self.wandb_id else None).id
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
        if not self.main:
            return
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        self.last_step = step

    def state(self) -> dict:
        """Where the logs stand (main process): what a checkpoint keeps to continue them."""
        return {"jsonl_bytes": self.jsonl.tell(), "last_step": self.last_step, "wandb_id": self.wandb_id}

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


# A stage stopped by SIGTERM or SIGUSR1 exits with this status once its checkpoint is written
# (EX_TEMPFAIL: try again later); the same command with --resume finishes the run.
CHECKPOINT_EXIT_CODE = 75


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
    SIGTERM and SIGUSR1 (what Slurm sends before a preemption or the time limit) ask for a checkpoint
    at the end of the current update, after which the run exits with CHECKPOINT_EXIT_CODE."""

    def __init__(self, args, accelerator: Accelerator, model, optimizer, objects: list, identity: dict):
        self.folder = os.path.join(args.output_dir, "checkpoints") if args.output_dir else None
        self.every, self.keep, self.identity = args.checkpoint_every, args.keep_checkpoints, identity
        self.settings = run_settings(args)
        self.accelerator, self.model, self.optimizer, self.objects = accelerator, model, optimizer, objects
        self.deepspeed = accelerator.state.deepspeed_plugin is not None
        self.signal = None
        if self.folder:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._remember)
        if self.deepspeed:
            accelerator.register_for_checkpointing(*objects)

    def _remember(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name

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
        if self.folder is None:
            return
        asked = torch.tensor(float(self.signal is not None), device=self.accelerator.device)
        stop = self.accelerator.reduce(asked, "sum").item() > 0
        if stop or (self.every and update % self.every == 0):
            self.save(update, run_name, logger, records)
        if stop:
            if self.accelerator.is_main_process:
                print(f"checkpoint saved at update {update} after a stop signal; exiting with status "
                      f"{CHECKPOINT_EXIT_CODE} (rerun with --resume)", flush=True)
            logger.close()
            raise SystemExit(CHECKPOINT_EXIT_CODE)

    def save(self, update: int, run_name: str, logger, records=None) -> None:
        main = self.accelerator.is_main_process
        final = os.path.join(self.folder, f"update-{update:07d}")
        partial = os.path.join(self.folder, f".update-{update:07d}.partial")
        if main:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        self.accelerator.wait_for_everyone()
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
                           "logger": logger.state(), "records": records}, f)
        self.accelerator.wait_for_everyone()
        if main:
            shutil.rmtree(final, ignore_errors=True)  # (the same update saved again)
            os.replace(partial, final)
            names = sorted(n for n in os.listdir(self.folder) if n.startswith("update-"))
            for name in names[:-self.keep]:
                shutil.rmtree(os.path.join(self.folder, name))
        self.accelerator.wait_for_everyone()


class PhaseTimer:
    """Seconds of one update (a timer per update, started with it) and of its named phases, summed
    over the phase's entries (the rollout enters each phase once per chunk). On a GPU it waits for
    the queued kernels at both ends of a phase, so that a phase is charged with its own GPU work, not
    with the previous phase's."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict = {}
        self.start = time.perf_counter()

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._wait()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._wait()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self, tokens: int, generated_tokens: Optional[int] = None) -> dict:
        """time/<phase>, time/update (seconds since the timer started) and throughput/tokens_per_second:
        `tokens` (positions of the global batch, padding included) per second of the update; with
        `generated_tokens`, throughput/generated_tokens_per_second of the `generation` phase too."""
        self._wait()
        seconds = time.perf_counter() - self.start
        metrics = {**{f"time/{phase}": s for phase, s in self.seconds.items()}, "time/update": seconds,
                   "throughput/tokens_per_second": tokens / seconds}
        if generated_tokens is not None:
            metrics["throughput/generated_tokens_per_second"] = generated_tokens / self.seconds["generation"]
        return metrics


def push_to_hub(args, model, tokenizer, state_dict) -> None:
    from huggingface_hub import HfApi

    entity = args.hf_entity or HfApi().whoami()["name"]
    repo_id = f"{entity}/{args.base_model.replace('/', '_')}__{args.exp_name}__tldr"
    tokenizer.push_to_hub(repo_id, revision=args.run_name)
    model.push_to_hub(repo_id, revision=args.run_name, state_dict=state_dict)
    print(f"pushed https://huggingface.co/{repo_id}/tree/{args.run_name}")
