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
- `push_to_hub`: only with --push_to_hub, no hub call otherwise;
- no silent failure: `checked_load` refuses a checkpoint without the head a stage needs,
  `Run.optimizer_step` / `Run.all_finite` stop a run at a non-finite loss, gradient or rollout
  value (--on_nonfinite), `progress` prints plain lines with an ETA where no terminal shows a bar,
  `lock_output_dir` keeps a second run out of a folder in use, `check_fresh_start` keeps a new run
  out of an earlier run's checkpoints and logs, `check_disk_space` refuses a run whose model the
  disk cannot hold, a checkpoint or final save that fails names its path and cause and loses
  nothing (`rescue_model`), `run_summary` ends every run;
- `parse_args`: the command line, with our names for flags that TRL, CleanRL or the paper's
  scripts name differently.

No base classes, callbacks or hooks: plain functions and a few concrete classes that a stage calls
where the reader sees it.
"""

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import typing
import warnings
from dataclasses import asdict
from typing import Optional

import numpy as np
import pandas as pd
import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs, broadcast
from datasets import load_dataset, load_from_disk
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress as RichProgress
from rich.progress import TextColumn
from safetensors import SafetensorError
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig
from transformers.utils import logging as transformers_logging

# Library noise that buried a run's own lines. A stage imports this module before transformers'
# optimization module, which imports peft, which imports bitsandbytes, which warns on every command
# (--help included) that an optional CPU kernel package is missing. DeepSpeed warns that it falls
# back to the CPU wherever there is no GPU (and is told so here). transformers draws a progress bar
# and prints a load report for every model: the loaders below check what the report would show
# (a head missing from the checkpoint) and stop with what it means.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
transformers_logging.set_verbosity_error()
transformers_logging.disable_progress_bar()


# ---------------------------------------------------------------------------------------------
# loaders
# ---------------------------------------------------------------------------------------------


def looks_local(path: str) -> bool:
    return os.path.exists(path) or path.startswith((".", "/", "~")) or path.count("/") > 1


# what a local folder must hold to be loaded as a model, or as a tokenizer
MODEL_FILES, TOKENIZER_FILES = ("config.json",), ("tokenizer_config.json", "tokenizer.json")


def check_model_path(path: str, needs: tuple = MODEL_FILES) -> None:
    """A local `path` that does not exist, or that holds none of the files `needs` (a stage that
    failed or was stopped before its final save leaves its output folder with a `.lock` and perhaps
    checkpoints), is named as such, not as transformers' "Unrecognized model ... model_type"."""
    if not looks_local(path):
        return
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path} does not exist")
    if not any(os.path.isfile(os.path.join(path, name)) for name in needs):
        held = sorted(os.listdir(path))
        listing = ", ".join(held[:8]) + (" ..." if len(held) > 8 else "") if held else "nothing"
        resume = (" Its checkpoints/ can be finished with the same command and --resume." if "checkpoints" in held
                  else "")
        raise FileNotFoundError(f"model path {path} holds no model (no {needs[0]}; it holds {listing}): a failed or "
                                f"unfinished run?{resume}")


# written by tldr_dataset.py into each dataset folder it builds: which tokenizer made its token ids
TOKENIZER_RECORD = "tokenizer_record.json"


def tokenizer_fingerprint(tokenizer) -> str:
    """What decides how text becomes ids, hashed: the vocabulary and merges, the added tokens and their
    ids, the normaliser, pre-tokeniser, post-processor and decoder (not the padding or truncation
    settings of the moment). Two tokenizers of one size but other vocabularies differ here."""
    import hashlib

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec = {k: v for k, v in spec.items() if k not in ("padding", "truncation", "added_tokens", "version")}
    spec["added_tokens"] = sorted((t.content, i) for i, t in tokenizer.added_tokens_decoder.items())
    spec["special"] = [tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token]
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def check_dataset_tokenizer(tokenizer, dataset: str) -> None:
    """Refuses a dataset whose token ids another tokenizer made (its TOKENIZER_RECORD; a dataset
    without one, such as a hub dataset, is taken as it is)."""
    path = os.path.join(dataset, TOKENIZER_RECORD)
    if not (looks_local(dataset) and os.path.isfile(path)):
        return
    with open(path) as f:
        record = json.load(f)
    if record["fingerprint"] != tokenizer_fingerprint(tokenizer):
        raise ValueError(f"dataset {dataset} was tokenized with {record['tokenizer']}, whose tokenizer differs from "
                         f"{tokenizer.name_or_path}'s: its token ids would mean other text to this model. Rebuild it "
                         f"with tldr_dataset.py --base_model {tokenizer.name_or_path}, or use the models of that "
                         "tokenizer")


def load_tokenizer(name: str, *datasets: str):
    """`name`'s tokenizer, right-padding, with a dedicated pad token that is never EOS: `[PAD]` is added
    where there is none (Pythia; id 50277 fits in its 50304-row embedding) or where it is the EOS
    (Qwen's base models), which padding would otherwise mask out of every loss, so that EOS could never
    be learned. The EOS text must encode to the EOS id (the datasets append it as text). Encoding may
    prepend a BOS (Llama 3): queries keep it, responses and the EOS are encoded without it
    (`add_special_tokens=False`); a tokenizer that adds anything else is refused. Refused too where one
    of the `datasets` (folders) was tokenized by another tokenizer."""
    check_model_path(name, TOKENIZER_FILES)
    tokenizer = AutoTokenizer.from_pretrained(name, padding_side="right")
    if tokenizer.eos_token is None:
        raise ValueError(f"tokenizer {name} has no EOS token")
    # (the one embedding row a loader may add: fit_embeddings)
    tokenizer.added_pad = tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id
    if tokenizer.added_pad:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    if tokenizer.encode(tokenizer.eos_token, add_special_tokens=False) != [tokenizer.eos_token_id]:
        raise ValueError(f"tokenizer {name}: EOS text {tokenizer.eos_token!r} does not encode to its id")
    added = special_tokens_added(tokenizer)
    if added["after"] or added["before"] not in ([], [tokenizer.bos_token_id]):
        raise ValueError(f"tokenizer {name} adds {tokenizer.convert_ids_to_tokens(added['before'])} before and "
                         f"{tokenizer.convert_ids_to_tokens(added['after'])} after every text it encodes: only a BOS "
                         "before it is supported (queries and responses are encoded apart and joined)")
    for dataset in datasets:
        check_dataset_tokenizer(tokenizer, dataset)
    return tokenizer


def check_architecture(name: str) -> None:
    """Refuses, before any training (the data stage calls it), a base model the pipeline cannot take
    end to end: transformers needs a causal-LM class for it (the policies) and a sequence-classification
    class (the reward model and the critic). A local folder holding only a tokenizer is not checked."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
    if looks_local(name) and not os.path.isfile(os.path.join(name, "config.json")):
        return
    model_type = AutoConfig.from_pretrained(name).model_type
    missing = [role for role, classes in (("causal-LM class (the policies)", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                                          ("sequence-classification class (the reward model and the critic)",
                                           MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES))
               if model_type not in classes]
    if missing:
        raise ValueError(f"{name}: transformers has no {' and no '.join(missing)} for its architecture "
                         f"{model_type!r}, so the pipeline cannot run on it; nothing was trained")


def special_tokens_added(tokenizer) -> dict:
    """{"before": ids, "after": ids}: what `tokenizer.encode` adds around a text's own tokens."""
    plain = tokenizer.encode("a b", add_special_tokens=False)
    framed = tokenizer.encode("a b")
    start = next((i for i in range(len(framed) - len(plain) + 1) if framed[i: i + len(plain)] == plain), None)
    if start is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path}: its special tokens change how a text itself is encoded")
    return {"before": framed[:start], "after": framed[start + len(plain):]}


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


def checked_load(model_class, path: str, expected: str, new_head: Optional[str] = None, **kwargs):
    """`model_class.from_pretrained(path, **kwargs)`, refused where the checkpoint is not `expected`
    ("causal LM" or "reward model"): transformers loads a causal LM as a sequence classifier (and the
    reverse) with a freshly initialised head and only a load report to say so, and a run would then
    train against a random reward or sample from a random LM head. `new_head`: the name of the head
    the caller initialises itself (reward.py's score head over an SFT model), allowed to be missing."""
    model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    missing = sorted(k for k in info["missing_keys"] if not (new_head and k.split(".")[0] == new_head))
    architectures = getattr(model.config, "architectures", None) or []
    suffix = {"causal LM": "ForCausalLM", "reward model": "ForSequenceClassification"}[expected]
    wrong_kind = new_head is None and architectures and not any(a.endswith(suffix) for a in architectures)
    if missing or wrong_kind:
        found = f"a {', '.join(architectures)} checkpoint" if architectures else "a checkpoint of unnamed architecture"
        lacks = f", without {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing else ""
        hint = (" (a reward model from reward.py)" if expected == "reward model"
                else " (a base model or a policy from sft.py, ppo or dpo)")
        raise ValueError(f"{path}: expected a {expected}{hint}, found {found}{lacks}: loading it would start "
                         "those weights from random values")
    return model


def check_model_tokenizer(path: str, tokenizer) -> None:
    """Refuses a model folder saved with another tokenizer than `tokenizer` (every stage saves its
    model's tokenizer beside it; a folder without one, or a hub name, is taken as it is)."""
    if not looks_local(path) or not any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZER_FILES):
        return
    if os.path.abspath(path) == os.path.abspath(tokenizer.name_or_path):
        return
    if tokenizer_fingerprint(load_tokenizer(path)) != tokenizer_fingerprint(tokenizer):
        raise ValueError(f"{path} was saved with another tokenizer than {tokenizer.name_or_path}'s: it reads token "
                         "ids as other text. Use models and datasets built on one tokenizer")


def fit_embeddings(model, path: str, tokenizer) -> None:
    """Grows the embedding by the `[PAD]` row load_tokenizer added, and by nothing else: a model with
    fewer rows than the tokenizer has tokens was built on another tokenizer, and a grown row reads one
    mean embedding for every id it never saw."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) <= rows:
        return
    if not (getattr(tokenizer, "added_pad", False) and len(tokenizer) == rows + 1):
        raise ValueError(f"{path} has {rows} embedding rows, fewer than the {len(tokenizer)} tokens of "
                         f"{tokenizer.name_or_path}'s tokenizer: it was built on another tokenizer (only the [PAD] "
                         "row this project adds is ever added to an embedding)")
    model.resize_token_embeddings(len(tokenizer))


def load_policy(path: str, tokenizer, dtype: torch.dtype = torch.float32, **quantized):
    """A causal LM in `dtype` whatever the checkpoint's (fp32 master weights for the trained policy;
    mixed precision is accelerate's job); `quantized`: from `quantization`. Refused where it was saved
    with another tokenizer than `tokenizer`."""
    check_model_path(path)
    check_model_tokenizer(path, tokenizer)
    model = checked_load(AutoModelForCausalLM, path, "causal LM", dtype=dtype, **quantized)
    fit_embeddings(model, path, tokenizer)
    disable_dropout(model)
    return model


def load_reward_model(path: str, tokenizer, dtype: torch.dtype = torch.float32, new_head: bool = False,
                      **quantized):
    """A saved reward model (reward.py), head and normalisation included, in `dtype`; with `new_head`,
    any backbone (an SFT model) under a score head that the caller initialises."""
    check_model_path(path)
    check_model_tokenizer(path, tokenizer)
    model = checked_load(AutoModelForSequenceClassification, path, "reward model", "score" if new_head else None,
                         num_labels=1, dtype=dtype, **quantized)
    fit_embeddings(model, path, tokenizer)
    # HF's pooling reads the rightmost token that is not config.pad_token_id: the EOS
    model.config.pad_token_id = tokenizer.pad_token_id
    disable_dropout(model)
    add_reward_offset(model)
    return model


def add_reward_offset(model) -> None:
    """Adds `config.reward_offset` (where reward.py stores the reward normalisation of an architecture
    whose final norm has no bias to fold it into: RMSNorm in Llama, Qwen, Gemma, OLMo-2, SmolLM) to
    the `score` head's output at every position, by a forward hook on the head: padded, packed and
    per-position (critic) reads all get it, and the saved weights stay a plain transformers model.
    The hook reads the config at every call (reward.py sets the offset after training); added once."""
    if getattr(model, "reward_offset_hook", None) is None:
        config = model.config

        def shifted(module, args, output):
            offset = getattr(config, "reward_offset", 0.0)
            return output + offset if offset else None

        model.reward_offset_hook = model.score.register_forward_hook(shifted)


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


@contextlib.contextmanager
def quiet_peft():
    """peft reads transformers' deprecated `is_gradient_checkpointing`: a FutureWarning in every LoRA run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


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
    try:
        with quiet_peft():
            return get_peft_model(model, config)
    except ValueError as e:  # peft's message names none of the modules that do exist
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear)})
        raise ValueError(f"--lora_target_modules {' '.join(targets)}: {str(e).rstrip('.')}. This model's linear "
                         f"layers are named {' '.join(linear)} (or use all-linear)") from None


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

    with quiet_peft():
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


def make_optimizer(args, model) -> torch.optim.Optimizer:
    """`--optimizer` over the trainable parameters with --lr, --eps and --weight_decay (adamw:
    decoupled weight decay; adam: torch's Adam, which adds the decay to the gradient). Under
    --compile_train torch's fused kernel (one kernel per step where the default loops over tensors on
    a CPU; the same update to float noise, tests/test_packing.py)."""
    optimizer_class = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
    fused = {"fused": True} if getattr(args, "compile_train", False) else {}
    return optimizer_class([p for p in model.parameters() if p.requires_grad], lr=args.lr, eps=args.eps,
                           weight_decay=args.weight_decay, **fused)


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


# settings that must be at least 1 wherever a stage has them (0 ended in a library traceback)
POSITIVE_SETTINGS = ("response_length", "local_rollout_forward_batch_size", "local_generation_batch_size",
                     "keep_checkpoints")


def check_settings(args) -> None:
    for name in POSITIVE_SETTINGS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if args.checkpoint_every < 0:
        raise ValueError(f"--checkpoint_every must be >= 0 (0: only on a stop signal), got {args.checkpoint_every}")


def require_splits(dataset, name: str, splits: tuple, why: str) -> None:
    """Stops at the start, not after training, where `dataset` lacks a split the run will need."""
    missing = [s for s in splits if s not in dataset]
    if missing:
        raise ValueError(f"{name} has no {' or '.join(repr(s) for s in missing)} split, which {why} needs "
                         f"(it has {', '.join(repr(s) for s in dataset)})")


def lock_output_dir(output_dir: str):
    """An exclusive lock on <output_dir>/.lock for this run (held by the main process), or an error
    naming the run that holds it: two runs writing checkpoints and a model into one folder would
    overwrite each other's. The operating system drops the lock when the process ends, however it
    ends, so a crashed run leaves no stale lock behind. (A POSIX lock: a second run started inside
    the same Python process, as the tests do, shares it.)"""
    try:
        os.makedirs(output_dir, exist_ok=True)
        handle = open(os.path.join(output_dir, ".lock"), "a+")
    except OSError as e:  # (a path through a file, a read-only or unwritable place, a full disk)
        raise OSError(e.errno, f"--output_dir {output_dir} cannot be created or written: {e.strerror} "
                               f"({e.filename})") from None
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise RuntimeError(f"--output_dir {output_dir} is in use by a running {holder}: two runs writing one folder "
                           "would overwrite each other's checkpoints and model. Wait for it, stop it, or choose "
                           "another --output_dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"run (pid {os.getpid()} on {platform.node()}, started {time.strftime('%Y-%m-%d %H:%M:%S')})")
    handle.flush()
    return handle


def check_fresh_start(args) -> None:
    """A run without --resume starts only where no earlier run would be mixed into it: in an
    --output_dir holding another run's checkpoints, the newest checkpoint would be that run's (it
    sorts after this run's first one, which `--keep_checkpoints` then prunes), and after a crash
    --resume would continue the old run; a run folder runs/<--run_name> that already holds logs
    would get this run's metrics appended to the old ones and a second TensorBoard event file."""
    if args.resume:
        return
    folder = os.path.join(args.output_dir, "checkpoints") if args.output_dir else None
    names = sorted(n for n in os.listdir(folder) if n.startswith("update-")) if folder and os.path.isdir(folder) else []
    if names:
        raise FileExistsError(f"--output_dir {args.output_dir} holds checkpoints of an earlier run (newest: "
                              f"{names[-1]}), and --resume was not given. --resume continues that run; to start over, "
                              f"delete {folder} or choose another --output_dir")
    logs = os.path.join("runs", args.run_name) if args.run_name else None
    if logs and os.path.isdir(logs) and os.listdir(logs):
        raise FileExistsError(f"--run_name {args.run_name}: {logs} already holds a run's logs, which this run would "
                              f"append to. Choose another --run_name, or delete {logs}")


# what a write to a full (or failing) disk raises: OSError from Python's own writes, RuntimeError from
# torch.save ("unexpected pos", "basic_ios::clear"), SafetensorError from safetensors' serializer
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024


def disk_needs(module) -> tuple:
    """(the final save, one checkpoint) of the trained `module` (unwrapped), in bytes, estimated: the
    saved model's parameters as they are held (PPO saves the policy of its policy + critic; a LoRA
    run its merged model), and a checkpoint's trained parameters with the optimizer's two fp32
    moments (AdamW)."""
    def numel(p) -> int:
        return getattr(p, "ds_numel", p.numel())  # (ZeRO-3 partitions a parameter; ds_numel is its size)

    saved = getattr(module, "policy", module)
    final = sum(numel(p) * p.element_size() for p in saved.parameters())
    trained = [p for p in module.parameters() if p.requires_grad]
    return final, sum(numel(p) * (p.element_size() + 8) for p in trained)


def check_disk_space(output_dir: str, final: int, checkpoint: int, copies: int) -> Optional[str]:
    """Before update 1: refuses a run whose final model (`final` bytes) the disk of `output_dir` cannot
    hold, and returns a warning where `copies` checkpoints (--keep_checkpoints and the one being
    written) of `checkpoint` bytes each would not fit beside it."""
    free = shutil.disk_usage(output_dir).free
    if free < final:
        raise OSError(errno.ENOSPC, f"--output_dir {output_dir}: the trained model needs about {human_bytes(final)} "
                                    f"at the end of the run, and its disk has {human_bytes(free)} free. Free space "
                                    "there or choose another --output_dir")
    if copies and free < final + copies * checkpoint:
        return (f"{output_dir}'s disk has {human_bytes(free)} free; the model and {copies} checkpoints of about "
                f"{human_bytes(checkpoint)} (--keep_checkpoints and the one being written) need about "
                f"{human_bytes(final + copies * checkpoint)}: a checkpoint that does not fit is skipped with a warning "
                "(the last one written is kept)")
    return None


def write_model(module, state_dict: dict, tokenizer, output_dir: str) -> None:
    """`module` with `state_dict`, and `tokenizer`, written aside in <output_dir>/.model.partial and
    moved into `output_dir` once complete: a failed write leaves no half-written model there."""
    partial = os.path.join(output_dir, ".model.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        tokenizer.save_pretrained(partial)
        module.save_pretrained(partial, state_dict=state_dict)  # (safetensors)
        for name in os.listdir(partial):
            os.replace(os.path.join(partial, name), os.path.join(output_dir, name))
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def rescue_model(module, state_dict: dict, tokenizer, output_dir: str) -> Optional[str]:
    """Where the trained weights went when the final save to `output_dir` failed: the first of $TMPDIR,
    /dev/shm and the system temp folder with room for them that takes the write, or None where none
    could."""
    needed = sum(t.numel() * t.element_size() for t in state_dict.values())
    for place in dict.fromkeys(p for p in (os.environ.get("TMPDIR"), "/dev/shm", tempfile.gettempdir()) if p):
        try:
            if shutil.disk_usage(place).free < needed:
                continue
            folder = tempfile.mkdtemp(prefix=f"rescued_{os.path.basename(os.path.abspath(output_dir))}_", dir=place)
            write_model(module, state_dict, tokenizer, folder)
            return folder
        except WRITE_ERRORS:
            continue
    return None


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
        for item in progress(iterable, total, description, self.accelerator.is_main_process, status):
            yield item
            if stoppable and self.checkpoints is not None:
                self.checkpoints.stop_if_asked()

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


def gather_global(accelerator: Accelerator, *tensors: torch.Tensor) -> list:
    """Each tensor gathered over the processes along its first dimension, in rank order: the global
    batch on every process (one process: the tensors themselves). Bools travel as integers (gloo
    cannot gather them)."""
    return [accelerator.gather(t.long()).bool() if t.dtype == torch.bool else accelerator.gather(t) for t in tensors]


# ---------------------------------------------------------------------------------------------
# logs, checkpoints, timing
# ---------------------------------------------------------------------------------------------


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
                what = {"above": f"above {threshold:g}", "below": f"below {threshold:g}",
                        "change": f"{value / first - 1:+.0%} from the first update's {first:.4g}"}[kind]
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


# A stage stopped by SIGTERM, SIGUSR1 or Ctrl-C exits with this status once its checkpoint is written
# (EX_TEMPFAIL: try again later); the same command with --resume finishes the run.
CHECKPOINT_EXIT_CODE = 75
# A stage stopped by a non-finite loss, gradient or rollout value (--on_nonfinite stop)
NONFINITE_EXIT_CODE = 1


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


def push_to_hub(args, model, tokenizer, state_dict) -> None:
    from huggingface_hub import HfApi

    entity = args.hf_entity or HfApi().whoami()["name"]
    repo_id = f"{entity}/{args.base_model.replace('/', '_')}__{args.exp_name}__tldr"
    tokenizer.push_to_hub(repo_id, revision=args.run_name)
    model.push_to_hub(repo_id, revision=args.run_name, state_dict=state_dict)
    print(f"pushed https://huggingface.co/{repo_id}/tree/{args.run_name}")


# ---------------------------------------------------------------------------------------------
# the command line: flags that people bring from TRL, CleanRL and the paper's scripts
# ---------------------------------------------------------------------------------------------

TRL, CLEANRL, PAPER = "TRL's", "CleanRL's", "the paper's"
# Settings that another codebase names differently: foreign flag -> (whose name, [(our flag, what differs)]).
# The first of our flags that the stage has is suggested; a stage with none of them leaves the flag to tyro.
# Sources: TRL 1.12 (transformers' TrainingArguments under every config; SFTConfig, DPOConfig, RLOOConfig /
# GRPOConfig, the experimental PPOConfig; ModelConfig and ScriptArguments of its example scripts), TRL's
# PPOConfig before 0.12, CleanRL's ppo.py, and the paper's scripts (vwxyzjn/summarize_from_feedback_details).
# A nested name (`--ppo.num_mini_batches`, `--reward.kl_coef`) is also looked up by its last part, and a flag
# of ours given at another depth (`--kl_coef` for `--ppo.kl_coef`) is found by its name.
FOREIGN_FLAGS = {
    "learning_rate": (TRL + " and " + CLEANRL, [("lr", "")]),
    "per_device_train_batch_size": (TRL, [("local_micro_batch_size", "")]),
    "per_device_eval_batch_size": (TRL, [("local_eval_batch_size", "")]),
    "adam_epsilon": (TRL, [("eps", "")]),
    "lr_scheduler_type": (TRL, [("scheduler", "")]),
    "warmup_steps": (TRL, [("warm_up_steps", "")]),
    "optim": (TRL, [("optimizer", "adamw or adam")]),
    "report_to": (TRL, [("track", "a switch for wandb; TensorBoard and metrics.jsonl are always written")]),
    "max_steps": (TRL, [("total_episodes", "in episodes: updates x batch_size")]),
    "num_train_epochs": (TRL, [("total_episodes", "in episodes: epochs x the queries of the train split")]),
    "save_steps": (TRL, [("checkpoint_every", "")]),
    "save_total_limit": (TRL, [("keep_checkpoints", "")]),
    "resume_from_checkpoint": (TRL, [("resume", "a switch: the newest checkpoint in <output_dir>/checkpoints")]),
    "do_eval": (TRL, [("run_eval", "")]),
    "hub_model_id": (TRL, [("hf_entity", "the repo is <hf_entity>/<base_model>__<exp_name>__tldr")]),
    "model_name_or_path": (TRL, [("sft_model_path", "the model trained from; the tokenizer is --base_model"),
                                 ("base_model", "")]),
    "dataset_name": (TRL, [("label_dataset", "the preference pairs"), ("query_dataset", "")]),
    "completion_only_loss": (TRL, [("response_only_loss", "")]),
    "assistant_only_loss": (TRL, [("response_only_loss", "")]),
    "loss_type": (TRL, [("ipo", "a switch for the IPO loss; DPO's sigmoid loss is the default"),
                        ("grpo_loss", "grpo (DeepSeekMath) or dr_grpo")]),
    "beta": (TRL + " GRPO/RLOO", [("ppo.kl_coef", ""), ("kl_coef", "")]),
    "epsilon": (TRL + " GRPO/RLOO", [("ppo.cliprange", ""), ("cliprange", "")]),
    "num_iterations": (TRL + " GRPO/RLOO", [("ppo.noptepochs", ""), ("noptepochs", "")]),
    "num_generations": (TRL + " GRPO/RLOO", [("rloo_k", "samples per query")]),
    "max_completion_length": (TRL, [("response_length", "the tokens generated per query")]),
    "max_new_tokens": (TRL, [("response_length", "the tokens generated per query")]),
    "num_mini_batches": (TRL, [("nminibatches", "")]),
    "num_ppo_epochs": (TRL, [("ppo.noptepochs", ""), ("noptepochs", "")]),
    "num_total_batches": (TRL, [("total_episodes", "num_updates = total_episodes // batch_size")]),
    "micro_batch_size": (TRL + " and " + PAPER, [("local_micro_batch_size", "per process, not over all of them")]),
    "missing_eos_penalty": (TRL, [("penalty_reward_value", "the score a response without EOS gets, not an amount "
                                                           "taken off")]),
    "stop_token": (TRL, [("truncate_token", "")]),
    "stop_token_id": (TRL, [("truncate_token", "the tokenizer's EOS, the only choice")]),
    "num_sample_generations": (TRL, [("print_sample_output_freq", "every this many updates, not a count")]),
    "init_kl_coef": (TRL, [("ppo.kl_coef", ""), ("kl_coef", "")]),
    "adap_kl_ctrl": (TRL, [("ppo.use_adaptive_kl", "")]),
    "ppo_epochs": (TRL, [("ppo.noptepochs", ""), ("noptepochs", "")]),
    "forward_batch_size": (TRL, [("local_rollout_forward_batch_size", "")]),
    "total_timesteps": (CLEANRL, [("total_episodes", "")]),
    "num_minibatches": (CLEANRL, [("nminibatches", "")]),
    "update_epochs": (CLEANRL, [("ppo.noptepochs", ""), ("noptepochs", "")]),
    "clip_coef": (CLEANRL, [("ppo.cliprange", "the value loss clips at --ppo.cliprange_value"), ("cliprange", "")]),
    "gae_lambda": (CLEANRL, [("ppo.lam", "")]),
    "ppo.nminibatches": (PAPER, [("nminibatches", "the one the paper's ppo.py read; --ppo.nminibatches did nothing")]),
    "truncate_token_id": (PAPER, [("truncate_token", "the tokenizer's EOS, the only choice")]),
    "hf_repo_id": (PAPER, [("hf_entity", "the repo is <hf_entity>/<base_model>__<exp_name>__tldr")]),
    "hf_repo_revision": (PAPER, [("run_name", "the revision pushed to")]),
}
# never suggested for a foreign flag: fields derived at run time (a value given to them is ignored; PPO's
# batch_size is one of them)
RUN_TIME_FIELDS = ("world_size", "local_batch_size", "local_mini_batch_size", "mini_batch_size", "batch_size",
                   "num_updates")


def flag_names(args_class, prefix: str = "") -> set:
    """The flags of a tyro Args dataclass as field paths with underscores (`lr`, `ppo.kl_coef`)."""
    names = set()
    hints = typing.get_type_hints(args_class)
    for f in dataclasses.fields(args_class):
        if dataclasses.is_dataclass(hints[f.name]):
            names |= flag_names(hints[f.name], f"{prefix}{f.name}.")
        else:
            names.add(prefix + f.name)
    return names


def foreign_flag_hint(flag: str, ours: set, foreign: dict) -> Optional[str]:
    """Why `flag` (as typed, `--x.y=1` or `--x-y` too) is not a flag of ours, where the stage (`ours`, from
    flag_names) has the setting under another name; None for our own flags (`--no-<switch>` included) and
    for flags we know nothing about, which tyro answers."""
    typed = flag.split("=", 1)[0]
    name = typed[2:].replace("-", "_")
    prefix, _, leaf = name.rpartition(".")
    switch = prefix + "." + leaf[3:] if prefix else leaf[3:]  # (tyro's `--no-<switch>` and `--ppo.no-<switch>`)
    if name in ours or (leaf.startswith("no_") and switch in ours):
        return None
    for key in (name, leaf):
        source, targets = foreign.get(key, ("", []))
        for target, note in targets:
            if target in ours:
                return f"{typed} is {source} name; here it is --{target}" + (f" ({note})" if note else "")
    # one of our flags at another depth (`--kl_coef`, `--ppo.lr`, the paper's `--reward.adaptive_kl.target`)
    same = sorted(n for n in ours if n.rpartition(".")[2] == leaf and leaf not in RUN_TIME_FIELDS)
    return f"{typed} is --{' or --'.join(same)} here" if same else None


def parse_args(args_class, foreign: Optional[dict] = None, args: Optional[list] = None):
    """`tyro.cli(args_class)`, after a look for flags that TRL, CleanRL or the paper's scripts name differently
    (FOREIGN_FLAGS, with the stage's own `foreign` entries on top): those stop with our name for them (exit 2,
    like any usage error), where tyro would only say "unrecognized". Everything else is tyro's, its
    misspelling suggestions included. `args`: the command line without the program (default sys.argv[1:])."""
    argv = sys.argv[1:] if args is None else list(args)
    argv = argv[:argv.index("--")] if "--" in argv else argv  # (after "--" every token is a value)
    ours, table = flag_names(args_class), {**FOREIGN_FLAGS, **(foreign or {})}
    hints = [foreign_flag_hint(token, ours, table) for token in argv if token.startswith("--")]
    hints = [hint for hint in hints if hint]
    if hints:
        prog = os.path.basename(sys.argv[0])
        print("\n".join(f"{prog}: {hint}" for hint in hints + ["see --help for every flag"]), file=sys.stderr)
        raise SystemExit(2)
    return tyro.cli(args_class, args=args)
