"""LoRA and 4-bit base weights (DESIGN section 18), the plumbing only: nothing here changes a result
that the stage's LoRA flags do not ask for.

`check_peft_args`, `quantization`, `with_lora`, `reference_policy`, `merged_model`, `saved_form`:
peft adapters over frozen (optionally NF4) base weights, the reference as the policy with its adapter
disabled, and a merged model that plain transformers loads.
"""

import contextlib
import os
import platform
import warnings
from typing import Optional

import torch
from transformers import BitsAndBytesConfig


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
