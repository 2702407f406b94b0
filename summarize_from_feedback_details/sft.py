"""Supervised fine-tuning on TL;DR reference summaries (stage 1 of the paper's pipeline).

    accelerate launch [--config_file deepspeed.yaml] summarize_from_feedback_details/sft.py \\
        --base_model EleutherAI/pythia-1b-deduped --output_dir models/sft_model --run_eval
    python summarize_from_feedback_details/sft.py --base_model models/tiny/pythia-tiny-s \\
        --query_dataset data/tldr/sft --response_length 32 ...            # one process, CPU is fine

The loss covers every non-pad token of `query_reference_response_token`, query included: this is
what the paper's released checkpoints were trained with (`--response_only_loss` restricts it to the
response). EOS is a real target. One update sees `batch_size` sequences; its loss is normalised
over the whole global batch, so micro-batch size, gradient accumulation and process count never
change the update.
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
from rouge_score import rouge_scorer
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
    run_eval: bool = False
    """after training: validation/test loss, generation at `temperature`, ROUGE, sample tables"""
    print_sample_output_freq: int = 0
    """every this many updates, generate for a few validation queries and log them (0: never)"""

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

    # batch sizes; local_batch_size = local_micro_batch_size * gradient_accumulation_steps,
    # batch_size = local_batch_size * world_size
    num_train_epochs: int = 1
    gradient_accumulation_steps: int = 16
    local_micro_batch_size: int = 1
    batch_size: Optional[int] = None
    """global batch: if given, gradient_accumulation_steps is derived from it (must divide exactly)"""
    local_eval_batch_size: int = 4
    total_episodes: Optional[int] = None
    """defaults to len(train split) * num_train_epochs; more than one pass reshuffles per pass"""
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
    loss_normalization: Literal["sequence", "token"] = "sequence"
    """`sequence`: mean over the global batch of each sequence's token-mean loss (what the paper's
    runs computed, at micro-batch 1); `token`: mean over all target tokens of the global batch"""
    response_only_loss: bool = False
    """train on response tokens only (the dataset's `_response_label` column)"""

    # model and data
    base_model: str = "EleutherAI/pythia-1b-deduped"
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """hub name or a local `save_to_disk` folder from tldr_dataset.py"""
    response_length: int = 53
    temperature: float = 0.01

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
    output_dir: str = "models/sft_model"

    # filled in at run time
    world_size: Optional[int] = None
    local_batch_size: Optional[int] = None
    num_updates: Optional[int] = None


TRAIN_COLUMNS = ("query_reference_response_token", "query_reference_response_token_response_label")
EVAL_COLUMNS = ("query_token", "reference_response_token")


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


def epoch_permutations(n: int, epochs: int, seed: int) -> list:
    """A fresh permutation of range(n) per epoch, from the global seed only (identical on all ranks)."""
    generator = torch.Generator().manual_seed(seed)
    return [i for _ in range(epochs) for i in torch.randperm(n, generator=generator).tolist()]


def clipping_norm(max_grad_norm: Optional[float]) -> Optional[float]:
    """The gradient norm to clip at, or None for no clipping (unset or <= 0). torch's
    clip_grad_norm_ at 0 would zero every gradient, and DeepSpeed reads 0 as "off": this makes both
    backends agree."""
    return max_grad_norm if max_grad_norm is not None and max_grad_norm > 0 else None


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


def sequence_losses(logits: torch.Tensor, labels: torch.Tensor, pad_id: int) -> tuple:
    """Per-sequence sum of next-token cross-entropy over non-pad labels, and the target counts."""
    targets = labels[:, 1:]
    mask = targets != pad_id
    token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets.masked_fill(~mask, 0), reduction="none")
    return (token_loss * mask).sum(1), mask.sum(1)


def normalized_loss(loss_sums: torch.Tensor, counts: torch.Tensor, normalization: str, normalizer: float):
    """Contribution of a micro-batch to the global objective. `normalizer` is the number of
    sequences (`sequence`) or target tokens (`token`) of the whole global batch."""
    if normalization == "sequence":
        return (loss_sums / counts.clamp(min=1)).sum() / normalizer
    return loss_sums.sum() / normalizer


def rouge_scores(predictions: list, references: list) -> dict:
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    scores = [scorer.score(ref, pred) for pred, ref in zip(predictions, references)]
    return {k: float(np.mean([s[k].fmeasure for s in scores])) if scores else 0.0 for k in ("rouge1", "rouge2", "rougeL")}


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
def evaluate(args: Args, accelerator: Accelerator, model, tokenizer, dataloader, gen_config,
             max_batches: Optional[int] = None) -> tuple:
    """Loss on query+reference, generation truncated after EOS, ROUGE; gathered without the
    duplicates that sharding pads the last batch with."""
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    unwrapped = accelerator.unwrap_model(model)
    loss_sums, counts, rows = [], [], []
    for i, batch in enumerate(dataloader):
        if max_batches is not None and i >= max_batches:
            break
        qr = batch["query_reference_response_token"]
        labels = batch["query_reference_response_token_response_label"] if args.response_only_loss else qr
        loss_sum, count = sequence_losses(forward(model, qr, pad_id).logits, labels, pad_id)
        responses = truncate_response(generate(unwrapped, batch["query_token"], pad_id, gen_config), eos_id, pad_id)
        loss_sum, count = accelerator.gather_for_metrics((loss_sum, count))
        loss_sums.append(loss_sum.cpu())
        counts.append(count.cpu())
        rows += accelerator.gather_for_metrics([
            {"query": q, "postprocessed_response": r, "reference_responses": ref}
            for q, r, ref in zip(
                tokenizer.batch_decode(batch["query_token"], skip_special_tokens=True),
                tokenizer.batch_decode(responses, skip_special_tokens=True),
                tokenizer.batch_decode(batch["reference_response_token"], skip_special_tokens=True),
            )
        ], use_gather_object=True)
    loss_sums, counts = torch.cat(loss_sums), torch.cat(counts)
    loss = normalized_loss(loss_sums, counts, args.loss_normalization,
                           len(counts) if args.loss_normalization == "sequence" else counts.sum().item())
    table = pd.DataFrame(rows)
    metrics = {"loss": loss.item(), **rouge_scores(list(table["postprocessed_response"]),
                                                    list(table["reference_responses"]))}
    return metrics, table


# ---------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    # `batch_size` may set the accumulation steps: derive them before the Accelerator exists
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # CPU processes (tests, laptops) talk over gloo; a single plain process needs no group at all
    distributed_cpu = "WORLD_SIZE" in os.environ and not torch.cuda.is_available()
    kwargs_handlers = [InitProcessGroupKwargs(backend="gloo")] if distributed_cpu else []
    dataset = load_split_dataset(args.query_dataset, TRAIN_COLUMNS + EVAL_COLUMNS)
    derive_batch_sizes(args, world_size, len(dataset["train"]))
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
    check_peft_args(args, deepspeed_plugin is not None)
    clip_norm = clipping_norm(args.max_grad_norm)
    if deepspeed_plugin is not None:
        # our loader yields whole local batches: tell DeepSpeed the real micro-batch and clipping
        # (accelerate would fill in 1.0 where nothing is set; DeepSpeed reads 0 as "off")
        deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.local_micro_batch_size
        deepspeed_plugin.deepspeed_config["gradient_clipping"] = clip_norm or 0.0
    # a checkpoint continues on any process count, for the same stage, seed and batch arithmetic
    identity = {"stage": "sft", "seed": args.seed, "batch_size": args.batch_size,
                "total_episodes": args.total_episodes, "num_updates": args.num_updates,
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
                      f"gradient_accumulation_steps {args.gradient_accumulation_steps} = batch_size {args.batch_size}; "
                      f"{args.num_updates} updates over {args.total_episodes} episodes "
                      f"({args.total_episodes - args.num_updates * args.batch_size} left over); "
                      f"weight_decay {args.weight_decay}; gradient clipping {clip_norm or 'off'}; loss over "
                      f"{'response' if args.response_only_loss else 'all non-pad'} tokens, {args.loss_normalization}-normalised")

    tokenizer = load_tokenizer(args.base_model)
    pad_id = tokenizer.pad_token_id
    # fp32 master weights whatever the checkpoint's dtype (transformers 5 keeps the hub Pythia
    # checkpoints' fp16); mixed precision is accelerate's job
    def load_base(**quantized):
        model = AutoModelForCausalLM.from_pretrained(args.base_model, dtype=torch.float32, **quantized)
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer))
        disable_dropout(model)
        return model

    model = load_base(**quantization(args, accelerator.device))
    if args.use_peft:
        model = with_lora(model, args)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if accelerator.is_main_process:
        console.print(f"model: {trainable_parameters(model)}")
    optimizer_class = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
    optimizer = optimizer_class([p for p in model.parameters() if p.requires_grad], lr=args.lr, eps=args.eps,
                                weight_decay=args.weight_decay)
    scheduler = get_scheduler(args.scheduler, optimizer=optimizer, num_warmup_steps=args.warm_up_steps,
                              num_training_steps=args.num_updates)

    train = dataset["train"].with_format("torch", columns=list(TRAIN_COLUMNS))
    eval_sets = {s: dataset[s].with_format("torch", columns=list(TRAIN_COLUMNS + EVAL_COLUMNS))
                 for s in ("validation", "test") if s in dataset}
    # one explicit order for every rank and world size; accelerate hands rank r the local batches
    # r, r + world_size, ..., so global batch k is always order[k * batch_size : (k + 1) * batch_size]
    # (and a resumed run starts at its first unseen global batch)
    order = epoch_permutations(len(train), -(-args.total_episodes // len(train)), args.seed)
    order = order[start_update * args.batch_size:]
    # its own generator: each iterator over a DataLoader draws a seed from it, which would otherwise
    # come from the global torch stream and shift it in a resumed run (it restores that stream)
    train_loader = DataLoader(train, batch_size=args.local_batch_size, sampler=order, drop_last=True,
                              generator=torch.Generator())
    eval_loaders = {s: DataLoader(ds, batch_size=args.local_eval_batch_size) for s, ds in eval_sets.items()}
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    eval_loaders = {s: accelerator.prepare(dl) for s, dl in eval_loaders.items()}
    if deepspeed_plugin is not None and accelerator.is_main_process:  # what the engine really got
        console.print(f"DeepSpeed engine: ZeRO-{model.zero_optimization_stage()}, "
                      f"gradient_clipping {model.gradient_clipping()}")
    checkpoints = Checkpoints(args, accelerator, model, optimizer, [scheduler], identity)
    if resumed:
        checkpoints.load(*resumed)
        if accelerator.is_main_process:
            console.print(f"resumed run {args.run_name} from {resumed[0]} at update {start_update}")
    gen_config = generation_config(args.response_length, args.temperature, pad_id)
    logger = Logger(args, accelerator, resume=resumed[1]["logger"] if resumed else None)
    label_column = TRAIN_COLUMNS[1] if args.response_only_loss else TRAIN_COLUMNS[0]

    model.train()
    update = start_update
    start = time.time()
    for batch in track(train_loader, total=args.num_updates - start_update, description="sft",
                       disable=not accelerator.is_main_process):
        if update == args.num_updates:
            break
        update += 1
        update_start = time.perf_counter()
        lr = scheduler.get_last_lr()[0]  # the learning rate of this update
        queries_responses, labels = batch[TRAIN_COLUMNS[0]], batch[label_column]
        # normaliser of the global batch, known before the first micro-batch's backward
        if args.loss_normalization == "sequence":
            normalizer = float(args.batch_size)
        else:
            normalizer = accelerator.reduce((labels[:, 1:] != pad_id).sum(), "sum").item()
        loss_total = torch.zeros((), device=accelerator.device)
        for micro_start in range(0, args.local_batch_size, args.local_micro_batch_size):
            micro = slice(micro_start, micro_start + args.local_micro_batch_size)
            with accelerator.accumulate(model):
                loss_sum, count = sequence_losses(forward(model, queries_responses[micro], pad_id).logits,
                                                  labels[micro], pad_id)
                loss = normalized_loss(loss_sum, count, args.loss_normalization, normalizer)
                # accelerate divides by the accumulation steps and DDP averages over ranks: undo
                # both so the gradient is exactly that of the global-batch objective
                accelerator.backward(loss * args.gradient_accumulation_steps * accelerator.num_processes)
                if accelerator.sync_gradients and clip_norm is not None:  # (DeepSpeed clips inside its step)
                    accelerator.clip_grad_norm_(model.parameters(), clip_norm)
                optimizer.step()
                optimizer.zero_grad()
            loss_total += loss.detach()
        scheduler.step()
        loss_total = accelerator.reduce(loss_total, "sum").item()
        update_seconds = time.perf_counter() - update_start
        metrics = {
            "train/sft/loss": loss_total,
            "train/sft/lr": lr,
            "train/sft/episode": update * args.batch_size,
            "train/sft/eps": (update - start_update) * args.batch_size / (time.time() - start),
            "time/update": update_seconds,
            # positions of the global batch (padding included) per second of this update
            "throughput/tokens_per_second": args.batch_size * queries_responses.shape[1] / update_seconds,
        }
        logger.log(metrics, update)
        if args.print_sample_output_freq and update % args.print_sample_output_freq == 0 and "validation" in eval_loaders:
            model.eval()
            sample_metrics, table = evaluate(args, accelerator, model, tokenizer, eval_loaders["validation"],
                                             gen_config, max_batches=1)
            model.train()
            logger.table(f"samples_{update}", table)
            if accelerator.is_main_process:
                console.print(f"update {update}: loss {metrics['train/sft/loss']:.4f}; "
                              f"{table.iloc[0]['postprocessed_response']!r}")
        checkpoints.after_update(update, args.run_name, logger)

    if args.run_eval:
        model.eval()
        for split, loader in eval_loaders.items():
            eval_metrics, table = evaluate(args, accelerator, model, tokenizer, loader, gen_config)
            logger.log({f"{split}/sft/{'rouge/' if k.startswith('rouge') else ''}{k}": v
                        for k, v in eval_metrics.items()}, update)
            logger.table(f"{split}_table", table)
            if accelerator.is_main_process:
                console.print(f"{split}: " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))

    if args.output_dir:
        accelerator.wait_for_everyone()
        state_dict = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(args.output_dir)
            saved, state_dict = saved_form(accelerator.unwrap_model(model), state_dict, args.output_dir, load_base,
                                           args.use_peft)
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
