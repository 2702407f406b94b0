"""Direct preference optimisation on TL;DR preference pairs (the fourth stage of the paper's repo).

    accelerate launch [--config_file deepspeed.yaml] summarize_from_feedback_details/dpo.py \\
        --base_model EleutherAI/pythia-1b-deduped --sft_model_path models/sft_model --run_eval
    python summarize_from_feedback_details/dpo.py --base_model models/tiny/pythia-tiny-m \\
        --sft_model_path <sft.py output> --label_dataset data/tldr/preference --query_dataset data/tldr/sft \\
        --response_length 32 --run_eval                                 # one process, CPU is fine

Policy and reference both start from the SFT checkpoint; the reference is frozen (eval mode, no
gradients, no dropout), as a DeepSpeed inference engine under DeepSpeed like PPO's frozen models.
The log-probability of a response is the sum over its tokens, EOS included, read with the
`query_{chosen,rejected}_token_response_label` columns (query and padding masked); chosen and
rejected go through one forward. With h = (log pi(c) - log pi(r)) - (log ref(c) - log ref(r)), the
loss is -logsigmoid(beta h) (label smoothing and IPO behind flags), summed over the pairs and
divided by the global batch, so micro-batch size, gradient accumulation and process count never
change the update. Each pair is seen once per epoch across all ranks (one global order).

The implicit rewards beta * (log pi - log ref) are logged under the reward model's metric names
(`train/rm/accuracy`, `eval/rm/<split>/accuracy` by split, batch and confidence), so eval/ plots
DPO next to reward.py. `--run_eval` also generates for the SFT validation and test queries at
`temperature` and saves `<split>_table.csv`, the table eval/ judges. Only the policy is saved.

Where this file deliberately differs from the paper's dpo.py (N_PLUS_DETAILS section 7): the loss
is a mean over the global batch (the paper passed a per-pair vector to backward, which only works
at micro-batch 1), one global data order (the paper shuffled per rank; `--rank_dependent_shuffle`
brings that back), the reference in eval mode and in the training precision (the paper left it in
train mode, in fp32), eval generation of `response_length` tokens (the paper: 128), and the
response-label mask of tldr_dataset.py (no CNN/DM off-by-one).
"""

import contextlib
import copy
import json
import os
import platform
import random
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs, broadcast
from datasets import load_dataset, load_from_disk
from rich.console import Console
from rich.progress import track
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from transformers import (AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, GenerationConfig,
                          get_scheduler)


@dataclass
class Args:
    # common
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    seed: int = 1
    run_name: Optional[str] = None
    """defaults to `{exp_name}__{seed}__{unix time of rank 0}`"""
    deepspeed: bool = False
    """assert that accelerate runs DeepSpeed and give it our micro-batch size"""
    offload: bool = False
    """DeepSpeed only: the frozen reference as a ZeRO-3 engine with its parameters offloaded to CPU"""
    run_eval: bool = False
    """after training: implicit-reward accuracy on `validation` and `validation_cnndm` (by split, batch
    and confidence), and generation for the SFT validation and test queries, saved as tables"""

    # optimizer
    lr: float = 3e-6
    eps: float = 1e-5
    weight_decay: float = 0.01
    """AdamW weight decay (the paper's runs got 0.01 silently from torch's default)"""
    max_grad_norm: Optional[float] = None
    """clip the global gradient norm at this value, the same way with and without DeepSpeed; unset or
    <= 0: no clipping, which is what the paper's runs did (DESIGN section 4)"""
    optimizer: Literal["adamw", "adam"] = "adamw"
    scheduler: str = "cosine"
    warm_up_steps: int = 0

    # batch sizes (in preference pairs); local_batch_size = local_micro_batch_size *
    # gradient_accumulation_steps, batch_size = local_batch_size * world_size
    num_train_epochs: int = 1
    gradient_accumulation_steps: int = 8
    local_micro_batch_size: int = 1
    batch_size: Optional[int] = None
    """global batch: if given, gradient_accumulation_steps is derived from it (must divide exactly)"""
    local_eval_batch_size: int = 1
    """pairs (implicit-reward eval) or queries (generation) per process in the final eval"""
    total_episodes: Optional[int] = None
    """defaults to len(train split) * num_train_epochs"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, about a third more compute, the same update"""

    # LoRA and 4-bit base weights (DESIGN.md section 18)
    use_peft: bool = False
    """train LoRA adapters (peft) instead of every weight. <output_dir> gets the adapter merged in
    (plain transformers loads it; every later stage reads it) and <output_dir>/adapter the adapter alone"""
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    """dropout on the adapters' input. The stages run without dropout (N+ detail); > 0 makes the
    training forwards differ from the rollouts', so PPO's first ratio is no longer 1"""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """module names to adapt (e.g. query_key_value dense); all-linear: every linear layer but the LM head"""
    load_in_4bit: bool = False
    """with --use_peft: the frozen base weights of the trained models in 4-bit NF4 (bitsandbytes; a CUDA
    GPU or an x86-64 CPU with AVX2; not under DeepSpeed). The saved merged model puts the adapter on the
    full-precision base (QLoRA's usual export)"""
    rank_dependent_shuffle: bool = False
    """the paper's data order: every rank shuffles the pairs with its own seed before accelerate
    shards them, so ranks overlap and miss pairs (about 66% unique pairs per epoch on 8 GPUs)"""

    # DPO
    beta: float = 0.05
    """inverse temperature of the implicit reward beta * (log pi - log ref)"""
    label_smoothing: float = 0.0
    """conservative DPO: the label is taken to be wrong with this probability"""
    ipo: bool = False
    """the IPO loss (h - 1 / (2 beta))^2 instead of DPO's"""

    # model and data
    base_model: str = "EleutherAI/pythia-1b-deduped"
    """the tokenizer (and the hub repo name with --push_to_hub)"""
    sft_model_path: str = "models/sft_model"
    """policy and reference (a causal-LM checkpoint from sft.py)"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """the SFT dataset (hub name or local folder); its validation and test queries for --run_eval"""
    label_dataset: str = "vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144"
    """the preference dataset (hub name or a local `save_to_disk` folder from tldr_dataset.py)"""
    response_length: int = 53
    """new tokens generated in the final eval"""
    temperature: float = 0.01
    """sampling temperature of the final eval's generation (the paper's 0.01)"""

    # checkpoints (DESIGN section 15): in `<output_dir>/checkpoints`
    checkpoint_every: int = 0
    """also save a checkpoint every this many updates (0: only on SIGTERM / SIGUSR1)"""
    keep_checkpoints: int = 1
    """the newest checkpoints to keep"""
    resume: bool = False
    """continue from the newest checkpoint (the same stage, seed and batch arithmetic; any process count)"""

    # tracking and output
    track: bool = False
    wandb_project_name: str = "tldr_summarize"
    wandb_entity: Optional[str] = None
    push_to_hub: bool = False
    hf_entity: Optional[str] = None
    output_dir: str = "models/dpo_model"

    # filled in at run time
    world_size: Optional[int] = None
    local_batch_size: Optional[int] = None
    num_updates: Optional[int] = None


TRAIN_COLUMNS = ("query_chosen_token", "query_rejected_token", "query_chosen_token_response_label",
                 "query_rejected_token_response_label")
# kept next to the implicit rewards in the eval table (the columns of reward.py's table)
EVAL_COLUMNS = ("query", "chosen", "rejected", "batch", "split", "extra", "choice", "policies", "chosen_policy",
                "rejected_policy")
QUERY_COLUMNS = ("query_token", "reference_response_token")


# ---------------------------------------------------------------------------------------------
# helpers (pure functions; tests import them)
# ---------------------------------------------------------------------------------------------


def derive_batch_sizes(args: Args, world_size: int, dataset_len: int) -> None:
    """Fills the derived batch fields; inexact divisions are errors."""
    for name in ("local_micro_batch_size", "gradient_accumulation_steps", "local_eval_batch_size", "num_train_epochs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    args.world_size = world_size
    if args.batch_size is not None:
        per_step = args.local_micro_batch_size * world_size
        if args.batch_size % per_step:
            raise ValueError(f"--batch_size {args.batch_size} is not divisible by local_micro_batch_size "
                             f"{args.local_micro_batch_size} x world_size {world_size}")
        args.gradient_accumulation_steps = args.batch_size // per_step
    args.local_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    args.batch_size = args.local_batch_size * world_size
    if args.total_episodes is None:
        args.total_episodes = dataset_len * args.num_train_epochs
    args.num_updates = args.total_episodes // args.batch_size
    if args.num_updates < 1:
        raise ValueError(f"total_episodes {args.total_episodes} < batch_size {args.batch_size}: no update possible")


def clipping_norm(max_grad_norm: Optional[float]) -> Optional[float]:
    """The gradient norm to clip at, or None for no clipping (unset or <= 0). torch's
    clip_grad_norm_ at 0 would zero every gradient, and DeepSpeed reads 0 as "off": this makes both
    backends agree."""
    return max_grad_norm if max_grad_norm is not None and max_grad_norm > 0 else None


def epoch_permutations(n: int, epochs: int, seed: int) -> list:
    """A fresh permutation of range(n) per epoch, from the global seed only (identical on all ranks)."""
    generator = torch.Generator().manual_seed(seed)
    return [i for _ in range(epochs) for i in torch.randperm(n, generator=generator).tolist()]


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Index of the first True of each row, or the row length when there is none."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def truncate_response(responses: torch.Tensor, eos_id: int, pad_id: int) -> torch.Tensor:
    """Tokens strictly after the first EOS become pad; the EOS itself stays."""
    eos_index = first_true_indices(responses == eos_id).unsqueeze(-1)
    after = torch.arange(responses.shape[1], device=responses.device).view(1, -1) > eos_index
    return torch.masked_fill(responses, after, pad_id)


def forward(model, input_ids: torch.Tensor, pad_id: int, logits_to_keep: int = 0):
    """Pad ids become a valid id and are masked out; positions count real tokens only (so left
    padding changes nothing, also for models with absolute positions). No KV cache: nothing
    generates from this pass, and a cache would hold every layer's keys and values.
    `logits_to_keep` N > 0: logits of the last N positions only (the LM head runs on those alone)."""
    attention_mask = input_ids != pad_id
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return model(input_ids=torch.masked_fill(input_ids, ~attention_mask, 0), attention_mask=attention_mask,
                 position_ids=position_ids, use_cache=False, logits_to_keep=logits_to_keep, return_dict=True)


def generation_config(response_length: int, temperature: float, pad_id: int) -> GenerationConfig:
    """Exactly `response_length` new tokens: no EOS/pad stopping, no top-k/top-p; `[PAD]` can never
    be sampled (its logit is suppressed)."""
    return GenerationConfig(
        max_new_tokens=response_length, min_new_tokens=response_length, temperature=temperature + 1e-7,
        top_k=0, top_p=1.0, do_sample=True, eos_token_id=None, pad_token_id=None, bos_token_id=None,
        suppress_tokens=[pad_id],
    )


@contextlib.contextmanager
def without_stop_ids(model):
    """generate() fills unset fields from the model's own generation config: an EOS id there would
    make min_new_tokens suppress EOS at every step, so the policy could never emit it. Cleared for
    the call only, so a saved model's plain generate() still stops at EOS."""
    saved = model.generation_config.eos_token_id, model.generation_config.pad_token_id
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    try:
        yield
    finally:
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = saved


@torch.no_grad()
def generate(model, queries: torch.Tensor, pad_id: int, config: GenerationConfig) -> torch.Tensor:
    """Left-padded queries -> responses of exactly max_new_tokens tokens."""
    attention_mask = queries != pad_id
    with without_stop_ids(model):
        output = model.generate(input_ids=torch.masked_fill(queries, ~attention_mask, 0),
                                attention_mask=attention_mask, generation_config=config)
    responses = output[:, queries.shape[1]:]
    assert responses.shape[1] == config.max_new_tokens, "generation stopped early"
    return responses


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Each row's summed log-probability of the tokens of `labels` that are not pad, each given the
    tokens before it. With the response-label columns, query and padding are pad: exactly the
    response counts, EOS included, with no length normalisation (as the paper)."""
    targets = labels[:, 1:]
    mask = targets != pad_id
    token_logprobs = -F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets.masked_fill(~mask, 0),
                                      reduction="none")
    return (token_logprobs * mask).sum(1)


def pair_logprobs(model, chosen: torch.Tensor, rejected: torch.Tensor, chosen_labels: torch.Tensor,
                  rejected_labels: torch.Tensor, pad_id: int) -> tuple:
    """Summed response log-probs of the chosen and the rejected rows, in ONE forward pass
    (concatenated along the batch)."""
    logits = forward(model, torch.cat([chosen, rejected]), pad_id).logits
    logprobs = sequence_logprobs(logits, torch.cat([chosen_labels, rejected_labels]), pad_id)
    return logprobs[: len(chosen)], logprobs[len(chosen):]


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
               ref_rejected: torch.Tensor, beta: float, label_smoothing: float, ipo: bool) -> torch.Tensor:
    """Per-pair losses from summed log-probs, with h = (log pi(c) - log pi(r)) - (log ref(c) - log ref(r)):
    DPO -logsigmoid(beta h) (1 - ls) - logsigmoid(-beta h) ls; IPO (h - 1 / (2 beta))^2."""
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if ipo:
        return (h - 1 / (2 * beta)) ** 2
    return -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing


def implicit_rewards(policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's implicit reward of a response, beta * (log pi - log ref): what the policy learned to prefer."""
    return beta * (policy_logprobs - ref_logprobs)


def pair_table(dataset, indices: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> pd.DataFrame:
    """The eval table of a preference split: each pair's text and labeller metadata (rows `indices`
    of `dataset`) next to the rewards of its chosen and rejected response."""
    rows = dataset.select(indices.tolist())
    return pd.DataFrame({
        "query": list(rows["query"]), "chosen": list(rows["chosen"]), "rejected": list(rows["rejected"]),
        "batch": list(rows["batch"]), "split": list(rows["split"]),
        # real data has rows without a confidence: keep them as their own "None" group
        "confidence": [str(e["confidence"]) for e in rows["extra"]],
        "choice": list(rows["choice"]), "policies": list(rows["policies"]),
        "chosen_policy": list(rows["chosen_policy"]), "rejected_policy": list(rows["rejected_policy"]),
        "accuracy": (chosen > rejected).float().numpy(),
        "chosen_rewards": chosen.numpy(), "rejected_rewards": rejected.numpy(),
    })


def accuracy_breakdown(table: pd.DataFrame, split: str) -> dict:
    """eval/rm/<split>/accuracy overall and by labeller split, batch and confidence."""
    metrics = {f"eval/rm/{split}/accuracy": float(table["accuracy"].mean())}
    for column in ("split", "batch", "confidence"):
        for value, group in table.groupby(column, dropna=False, sort=True):
            metrics[f"eval/rm/{split}/accuracy/{column}/{value}"] = float(group["accuracy"].mean())
    return metrics


# ---------------------------------------------------------------------------------------------
# setup helpers
# ---------------------------------------------------------------------------------------------


def looks_local(path: str) -> bool:
    return os.path.exists(path) or path.startswith((".", "/", "~")) or path.count("/") > 1


def load_tokenizer(name: str):
    if looks_local(name) and not os.path.isdir(name):
        raise FileNotFoundError(f"model path {name} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(name, padding_side="right")
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # Pythia: a dedicated pad, never EOS
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(f"tokenizer {name}: pad token equals EOS ({tokenizer.eos_token!r}); EOS would never be "
                         "learned. Use a dedicated pad token such as [PAD].")
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


def enable_gradient_checkpointing(model) -> None:
    """Activation checkpointing of every layer, non-reentrant: the backward recomputes exactly the
    forward it replaces (dropout is off), and no input needs requires_grad. transformers 5.23 renamed
    the method; older 5.x only has the first name."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


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
    """A plain transformers model: `model`'s LoRA adapter (peft) merged into a copy of its weights,
    `model` untouched (peft's merge_and_unload rewrites the model it is given). Over 4-bit base
    weights the adapter goes onto the full-precision base, `load_base()`: merging into 4-bit
    weights would round most of it away."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    if getattr(model.get_base_model(), "is_loaded_in_4bit", False):
        full = get_peft_model(load_base(), model.peft_config["default"])
        set_peft_model_state_dict(full, get_peft_model_state_dict(model))
        return full.merge_and_unload()
    return copy.deepcopy(model).merge_and_unload()


def saved_form(model, state_dict: dict, output_dir: str, load_base, use_peft: bool) -> tuple:
    """What `output_dir` gets, as (model, state dict): a model as it is, or a LoRA model (peft) as
    its merged model, after the adapter alone is written to `output_dir`/adapter."""
    if not use_peft:
        return model, state_dict
    model.save_pretrained(os.path.join(output_dir, "adapter"))
    merged = merged_model(model, load_base)
    return merged, merged.state_dict()


def check_model_path(path: str) -> None:
    if looks_local(path) and not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path} does not exist")


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


@contextlib.contextmanager
def reference_policy(policy, ref_policy):
    """The model of a reference forward: `ref_policy`, or with LoRA (`ref_policy` None) the policy
    itself with its adapter disabled, which computes exactly the SFT model's logits."""
    if ref_policy is not None:
        yield ref_policy
    else:
        with policy.disable_adapter():
            yield policy


def prepare_frozen(model, args: Args, accelerator: Accelerator):
    """Reference policy and reward model: no gradients, eval mode. Under DeepSpeed they become
    inference engines in the trainable model's precision (as the paper); with --offload, ZeRO-3
    engines whose parameters live on the CPU and are gathered layer by layer for each forward."""
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
    put it)."""
    dtype = next(model.parameters()).dtype
    if not hasattr(model, "zero_optimization_stage"):
        return f"plain module on {next(model.parameters()).device}, {dtype}"
    offload = model.zero_offload_param()
    device = getattr(offload.device, "value", offload.device) if offload is not None else "none"
    local = sum(p.numel() for p in model.module.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.module.parameters())
    return (f"DeepSpeed ZeRO-{model.zero_optimization_stage()} engine, {dtype}, parameter offload {device}, "
            f"{local} of {total} parameters resident on this rank")


class Logger:
    """TensorBoard + metrics.jsonl (+ wandb: scalars via TensorBoard sync, and the eval tables) on the
    main process only. `resume` (the `state()` a checkpoint kept) continues a run where it stood:
    metrics.jsonl is cut back to its length then, TensorBoard hides the events logged after it, and
    wandb continues the same run."""

    def __init__(self, args: Args, accelerator: Accelerator, resume: Optional[dict] = None):
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
    stand, the stage's `records`, and the `identity` a resume must match. It is written aside and
    renamed into place, so a run killed while writing keeps the previous one; the newest `keep` stay.
    SIGTERM and SIGUSR1 (what Slurm sends before a preemption or the time limit) ask for a checkpoint
    at the end of the current update, after which the run exits with CHECKPOINT_EXIT_CODE."""

    def __init__(self, args, accelerator: Accelerator, model, optimizer, objects: list, identity: dict):
        self.folder = os.path.join(args.output_dir, "checkpoints") if args.output_dir else None
        self.every, self.keep, self.identity = args.checkpoint_every, args.keep_checkpoints, identity
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
                json.dump({"identity": self.identity, "update": update, "run_name": run_name,
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


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_pairs(args: Args, accelerator: Accelerator, model, ref_policy, pad_id: int, dataloader, dataset) -> tuple:
    """Implicit rewards of every pair of `dataset`, gathered without the duplicates that sharding
    pads the last batch with; returns (metrics without prefix, eval table with reward.py's columns)."""
    gathered = {k: [] for k in ("index", "policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected")}
    for batch in dataloader:
        columns = [batch[c] for c in TRAIN_COLUMNS]
        policy_chosen, policy_rejected = pair_logprobs(model, *columns, pad_id)
        with accelerator.autocast(), reference_policy(accelerator.unwrap_model(model), ref_policy) as reference:
            ref_chosen, ref_rejected = pair_logprobs(reference, *columns, pad_id)
        values = accelerator.gather_for_metrics((batch["row_index"], policy_chosen, policy_rejected, ref_chosen,
                                                 ref_rejected))
        for key, value in zip(gathered, values):
            gathered[key].append(value.cpu())
    index, *logprobs = (torch.cat(v) for v in gathered.values())
    losses = dpo_losses(*logprobs, args.beta, args.label_smoothing, args.ipo)
    chosen, rejected = implicit_rewards(logprobs[0], logprobs[2], args.beta), implicit_rewards(logprobs[1], logprobs[3], args.beta)
    table = pair_table(dataset, index, chosen, rejected)
    return {"loss": losses.mean().item(), "chosen_rewards": chosen.mean().item(),
            "rejected_rewards": rejected.mean().item(), "reward_margin": (chosen - rejected).mean().item()}, table


@torch.no_grad()
def generation_table(accelerator: Accelerator, model, tokenizer, dataloader, gen_config) -> pd.DataFrame:
    """The policy's response to every query of a split, truncated after EOS, next to the reference:
    the table eval/ judges. Gathered without the duplicates that sharding pads the last batch with."""
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    unwrapped = accelerator.unwrap_model(model)
    rows = []
    for batch in dataloader:
        responses = truncate_response(generate(unwrapped, batch["query_token"], pad_id, gen_config), eos_id, pad_id)
        rows += accelerator.gather_for_metrics([
            {"query": q, "postprocessed_response": r, "reference_responses": ref}
            for q, r, ref in zip(
                tokenizer.batch_decode(batch["query_token"], skip_special_tokens=True),
                tokenizer.batch_decode(responses, skip_special_tokens=True),
                tokenizer.batch_decode(batch["reference_response_token"], skip_special_tokens=True),
            )
        ], use_gather_object=True)
    return pd.DataFrame(rows, columns=["query", "postprocessed_response", "reference_responses"])


# ---------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    # `batch_size` may set the accumulation steps: derive them before the Accelerator exists
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # CPU processes (tests, laptops) talk over gloo; a single plain process needs no group at all
    distributed_cpu = "WORLD_SIZE" in os.environ and not torch.cuda.is_available()
    kwargs_handlers = [InitProcessGroupKwargs(backend="gloo")] if distributed_cpu else []
    label_dataset = load_split_dataset(args.label_dataset, TRAIN_COLUMNS + EVAL_COLUMNS, kind="preference")
    if "train" not in label_dataset:
        raise ValueError(f"{args.label_dataset} needs a `train` split")
    query_dataset = load_split_dataset(args.query_dataset, QUERY_COLUMNS) if args.run_eval else {}
    derive_batch_sizes(args, world_size, len(label_dataset["train"]))
    if args.beta <= 0:
        raise ValueError(f"--beta must be > 0, got {args.beta}")
    if not 0 <= args.label_smoothing < 0.5:
        raise ValueError(f"--label_smoothing must be in [0, 0.5), got {args.label_smoothing}")
    accelerator = Accelerator(
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False),
        kwargs_handlers=kwargs_handlers,
    )
    assert accelerator.num_processes == world_size, (accelerator.num_processes, world_size)
    console = Console()
    deepspeed_plugin = accelerator.state.deepspeed_plugin
    if args.deepspeed and deepspeed_plugin is None:
        raise ValueError("--deepspeed given, but accelerate is not configured for DeepSpeed "
                         "(accelerate launch --config_file deepspeed.yaml ...)")
    if args.offload and args.use_peft:
        raise ValueError("--offload moves the frozen reference to the CPU; with --use_peft there is none (the "
                         "reference is the policy with its adapter disabled)")
    if args.offload and deepspeed_plugin is None:
        raise ValueError("--offload puts the frozen reference on DeepSpeed ZeRO-3: launch with a DeepSpeed "
                         "accelerate config (accelerate launch --config_file deepspeed.yaml ...)")
    check_peft_args(args, deepspeed_plugin is not None)
    clip_norm = clipping_norm(args.max_grad_norm)
    if deepspeed_plugin is not None:
        # our loader yields whole local batches: tell DeepSpeed the real micro-batch and clipping
        # (accelerate would fill in 1.0 where nothing is set; DeepSpeed reads 0 as "off")
        deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.local_micro_batch_size
        deepspeed_plugin.deepspeed_config["gradient_clipping"] = clip_norm or 0.0
    # a checkpoint continues on any process count, for the same stage, seed and batch arithmetic
    # (with the paper's per-rank shuffle the data order also depends on the process count)
    identity = {"stage": "dpo", "seed": args.seed, "batch_size": args.batch_size,
                "total_episodes": args.total_episodes, "num_updates": args.num_updates,
                "order": f"per rank of {world_size}" if args.rank_dependent_shuffle else "global",
                # adapters over frozen weights resume only with the same LoRA settings
                "lora": ([args.lora_r, args.lora_alpha, args.lora_target_modules, args.load_in_4bit]
                         if args.use_peft else None)}
    if (args.resume or args.checkpoint_every) and not args.output_dir:
        raise ValueError("--resume and --checkpoint_every keep checkpoints in <output_dir>/checkpoints: set --output_dir")
    resumed = find_checkpoint(args.output_dir, identity, world_size, deepspeed_plugin is not None) if args.resume else None
    start_update = resumed[1]["update"] if resumed else 0

    # run name: rank 0's clock, broadcast so every rank logs under one name (a resumed run keeps its own)
    stamp = broadcast(torch.tensor(int(time.time()), device=accelerator.device), 0).item()
    args.run_name = resumed[1]["run_name"] if resumed else args.run_name or f"{args.exp_name}__{args.seed}__{stamp}"
    local_seed = args.seed + accelerator.process_index * 100003
    random.seed(local_seed)
    np.random.seed(local_seed)
    torch.manual_seed(local_seed)
    torch.backends.cudnn.deterministic = True
    if accelerator.is_main_process:
        console.print(f"world_size {world_size} x local_micro_batch_size {args.local_micro_batch_size} x "
                      f"gradient_accumulation_steps {args.gradient_accumulation_steps} = batch_size {args.batch_size} "
                      f"pairs; {args.num_updates} updates over {args.total_episodes} episodes "
                      f"({args.total_episodes - args.num_updates * args.batch_size} left over); "
                      f"weight_decay {args.weight_decay}; gradient clipping {clip_norm or 'off'}; "
                      f"{'IPO' if args.ipo else 'DPO'} loss, beta {args.beta}, label smoothing {args.label_smoothing}")

    tokenizer = load_tokenizer(args.base_model)
    pad_id = tokenizer.pad_token_id
    model = load_policy(args.sft_model_path, tokenizer, **quantization(args, accelerator.device))
    if args.use_peft:  # the reference is the policy with its adapter disabled: no second copy of the weights
        model, ref_policy = with_lora(model, args), None
    else:
        ref_policy = load_policy(args.sft_model_path, tokenizer, frozen_dtype(accelerator.mixed_precision))
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    optimizer_class = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
    if accelerator.is_main_process:
        console.print(f"policy: {trainable_parameters(model)}")
    optimizer = optimizer_class([p for p in model.parameters() if p.requires_grad], lr=args.lr, eps=args.eps,
                                weight_decay=args.weight_decay)
    scheduler = get_scheduler(args.scheduler, optimizer=optimizer, num_warmup_steps=args.warm_up_steps,
                              num_training_steps=args.num_updates)

    train = label_dataset["train"]
    train = train.add_column("row_index", list(range(len(train)))).with_format(
        "torch", columns=list(TRAIN_COLUMNS) + ["row_index"])
    # One explicit order for every rank and world size; accelerate hands rank r the local batches
    # r, r + world_size, ..., so global batch k is always order[k * batch_size : (k + 1) * batch_size]
    # and every pair is seen once per epoch across all ranks (the original shuffled per rank, so
    # ranks overlapped and missed pairs; --rank_dependent_shuffle brings that back).
    order_seed = local_seed if args.rank_dependent_shuffle else args.seed
    order = epoch_permutations(len(train), -(-args.total_episodes // len(train)), order_seed)
    order = order[start_update * args.batch_size:]  # a resumed run starts at its first unseen global batch
    # its own generator: each iterator over a DataLoader draws a seed from it, which would otherwise
    # come from the global torch stream and shift it in a resumed run (it restores that stream)
    train_loader = DataLoader(train, batch_size=args.local_batch_size, sampler=order, drop_last=True,
                              generator=torch.Generator())
    eval_sets = {s: label_dataset[s] for s in ("validation", "validation_cnndm") if s in label_dataset}
    eval_loaders = {
        s: DataLoader(ds.add_column("row_index", list(range(len(ds)))).with_format(
            "torch", columns=list(TRAIN_COLUMNS) + ["row_index"]), batch_size=args.local_eval_batch_size)
        for s, ds in eval_sets.items()
    }
    query_loaders = {s: DataLoader(query_dataset[s].with_format("torch", columns=list(QUERY_COLUMNS)),
                                   batch_size=args.local_eval_batch_size)
                     for s in ("validation", "test") if s in query_dataset}
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    eval_loaders = {s: accelerator.prepare(dl) for s, dl in eval_loaders.items()}
    query_loaders = {s: accelerator.prepare(dl) for s, dl in query_loaders.items()}
    if ref_policy is not None:
        ref_policy = prepare_frozen(ref_policy, args, accelerator)
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        if deepspeed_plugin is not None:  # what the engine really got
            console.print(f"DeepSpeed engine: ZeRO-{model.zero_optimization_stage()}, "
                          f"gradient_clipping {model.gradient_clipping()}")
        reference = describe_frozen(ref_policy) if ref_policy is not None else "the policy, its LoRA adapter disabled"
        console.print(f"reference policy: {reference}", soft_wrap=True)
    checkpoints = Checkpoints(args, accelerator, model, optimizer, [scheduler], identity)
    if resumed:
        checkpoints.load(*resumed)
        if accelerator.is_main_process:
            console.print(f"resumed run {args.run_name} from {resumed[0]} at update {start_update}")
    logger = Logger(args, accelerator, resume=resumed[1]["logger"] if resumed else None)

    model.train()
    update = start_update
    # (update, row index) of every pair trained on, over all ranks: train_pairs.csv
    trained_pairs = [tuple(pair) for pair in resumed[1]["records"]] if resumed else []
    start = time.time()
    for batch in track(train_loader, total=args.num_updates - start_update, description="dpo",
                       disable=not accelerator.is_main_process):
        if update == args.num_updates:
            break
        update += 1
        update_start = time.perf_counter()
        lr = scheduler.get_last_lr()[0]  # the learning rate of this update
        # sums over this rank's pairs: loss share, correct pairs, chosen and rejected implicit
        # rewards, policy and reference log-probs of chosen and rejected
        stats = torch.zeros(8, device=accelerator.device)
        for micro_start in range(0, args.local_batch_size, args.local_micro_batch_size):
            columns = [batch[c][micro_start: micro_start + args.local_micro_batch_size] for c in TRAIN_COLUMNS]
            with torch.no_grad(), accelerator.autocast(), reference_policy(unwrapped, ref_policy) as reference:
                ref_chosen, ref_rejected = pair_logprobs(reference, *columns, pad_id)
            with accelerator.accumulate(model):
                policy_chosen, policy_rejected = pair_logprobs(model, *columns, pad_id)
                losses = dpo_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, args.beta,
                                    args.label_smoothing, args.ipo)
                # this micro-batch's share of the mean over the global batch of pairs
                loss = losses.sum() / args.batch_size
                # accelerate divides by the accumulation steps and DDP averages over ranks: undo
                # both so the gradient is exactly that of the global-batch mean loss
                accelerator.backward(loss * args.gradient_accumulation_steps * accelerator.num_processes)
                if accelerator.sync_gradients and clip_norm is not None:  # (DeepSpeed clips inside its step)
                    accelerator.clip_grad_norm_(model.parameters(), clip_norm)
                optimizer.step()
                optimizer.zero_grad()
            with torch.no_grad():
                chosen = implicit_rewards(policy_chosen, ref_chosen, args.beta)
                rejected = implicit_rewards(policy_rejected, ref_rejected, args.beta)
                stats += torch.stack([loss, (chosen > rejected).sum(), chosen.sum(), rejected.sum(), policy_chosen.sum(),
                                      policy_rejected.sum(), ref_chosen.sum(), ref_rejected.sum()]).float()
        scheduler.step()
        stats = (accelerator.reduce(stats, "sum") / args.batch_size).tolist()
        trained_pairs += [(update, i) for i in accelerator.gather(batch["row_index"]).tolist()]
        global_step = update * args.batch_size  # x-axis: episodes (pairs) seen so far
        update_seconds = time.perf_counter() - update_start
        # positions of the global batch's chosen and rejected sequences (padding included)
        tokens = args.batch_size * (batch["query_chosen_token"].shape[1] + batch["query_rejected_token"].shape[1])
        logger.log({
            "train/rm/loss": stats[0] * args.batch_size,
            "train/rm/accuracy": stats[1],
            "train/rm/chosen_rewards": stats[2],
            "train/rm/rejected_rewards": stats[3],
            "train/rm/reward_margin": stats[2] - stats[3],
            "train/dpo/logps_chosen": stats[4],
            "train/dpo/logps_rejected": stats[5],
            "train/dpo/ref_logps_chosen": stats[6],
            "train/dpo/ref_logps_rejected": stats[7],
            "train/rm/lr": lr,
            "train/rm/eps": (update - start_update) * args.batch_size / (time.time() - start),
            "time/update": update_seconds,
            "throughput/tokens_per_second": tokens / update_seconds,
        }, global_step)
        checkpoints.after_update(update, args.run_name, logger, records=trained_pairs)
    global_step = update * args.batch_size
    logger.table("train_pairs", pd.DataFrame(trained_pairs, columns=["update", "row_index"]))

    if args.run_eval:
        model.eval()
        for split, loader in eval_loaders.items():
            metrics, table = evaluate_pairs(args, accelerator, model, ref_policy, pad_id, loader, eval_sets[split])
            logger.table(f"eval_{split}_table", table)
            metrics = {**accuracy_breakdown(table, split), **{f"eval/rm/{split}/{k}": v for k, v in metrics.items()}}
            logger.log(metrics, global_step)
            if accelerator.is_main_process:
                console.print(f"{split}: implicit-reward accuracy {metrics[f'eval/rm/{split}/accuracy']:.4f} over "
                              f"{len(table)} pairs")
        gen_config = generation_config(args.response_length, args.temperature, pad_id)
        for split, loader in query_loaders.items():
            table = generation_table(accelerator, model, tokenizer, loader, gen_config)
            logger.table(f"{split}_table", table)
            if accelerator.is_main_process:
                console.print(f"{split}: {len(table)} responses, e.g. {table.iloc[0]['postprocessed_response']!r}")

    if args.output_dir:
        accelerator.wait_for_everyone()
        state_dict = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(args.output_dir)
            saved, state_dict = saved_form(unwrapped, state_dict, args.output_dir,
                                           lambda: load_policy(args.sft_model_path, tokenizer), args.use_peft)
            saved.save_pretrained(args.output_dir, state_dict=state_dict)
            if args.push_to_hub:
                push_to_hub(args, saved, tokenizer, state_dict)
    if torch.cuda.is_available() and accelerator.is_main_process:
        console.print(f"peak GPU memory of rank 0: {torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB")
    logger.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()


def push_to_hub(args: Args, model, tokenizer, state_dict) -> None:
    from huggingface_hub import HfApi

    entity = args.hf_entity or HfApi().whoami()["name"]
    repo_id = f"{entity}/{args.base_model.replace('/', '_')}__{args.exp_name}__tldr"
    tokenizer.push_to_hub(repo_id, revision=args.run_name)
    model.push_to_hub(repo_id, revision=args.run_name, state_dict=state_dict)
    print(f"pushed https://huggingface.co/{repo_id}/tree/{args.run_name}")


if __name__ == "__main__":
    main(tyro.cli(Args))
