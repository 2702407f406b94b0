"""Reward-model training on TL;DR preference pairs (stage 2 of the paper's pipeline).

    accelerate launch [--config_file deepspeed.yaml] summarize_from_feedback_details/reward.py \\
        --base_model EleutherAI/pythia-1b-deduped --sft_model_path models/sft_model --run_eval
    python summarize_from_feedback_details/reward.py --base_model models/tiny/pythia-tiny-s \\
        --sft_model_path models/tiny/pythia-tiny-s --label_dataset data/tldr/preference \\
        --query_dataset data/tldr/sft --run_eval                          # one process, CPU is fine

The reward model is the SFT backbone plus a scalar head, read at the last non-pad token of a right-padded
query+response row, which is the response's EOS. Loss `-logsigmoid(r_chosen - r_rejected)`, averaged over the
global batch of pairs, so micro-batch size, gradient accumulation and process count never change the update.
After training the rewards of the SFT train references are shifted to mean 0.

The saved model is a plain `AutoModelForSequenceClassification` (num_labels=1, `config.pad_token_id`
= [PAD]), loadable offline without trust_remote_code:

    model = AutoModelForSequenceClassification.from_pretrained("models/reward_model")
    reward = model(input_ids, attention_mask=input_ids != pad_id).logits[:, 0]   # normalised (GPT-NeoX)
    reward += getattr(model.config, "reward_offset", 0.0)                       # any architecture

HF picks the rightmost non-pad token, i.e. the EOS of a right-padded row, so that line gives the
same reward as training. With LEFT padding it also picks the right token, but plain HF then counts
positions from the first pad: rotary models (Pythia) are unaffected up to float noise, models with
absolute positions (GPT-2) are not; pass `position_ids = cumsum(mask) - 1` as `get_reward` does.

Where the normalisation lives: HF's `score` layer has no bias, so "reward - mean" cannot be a head
bias. Where the final norm has a bias (LayerNorm: GPT-NeoX/Pythia, GPT-2), it is folded, exactly,
into that bias (whose output is what `score` reads): adding `-mean * w / |w|^2` to it adds `-mean`
to `w . h` at every position. No extra line is needed when loading, and a critic initialised from
this model inherits the shift at every token, like the original's `config.bias`. Where it has none
(RMSNorm: Llama, Qwen, Gemma, OLMo-2, SmolLM), the shift is saved as `config.reward_offset`, which
every stage adds to the head's output at every position when it loads the model
(`infra.loading.add_reward_offset`); plain transformers gives the raw score, to which a user adds it.

Carried out by the shared loaders (`infra/`), as in the paper's code: the `[PAD]` token and the reward read at
the EOS above, dropout off, and each process seeded with seed + rank x 100003.
"""

import contextlib
import math
import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

import pandas as pd
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from torch.utils.data import DataLoader

from summarize_from_feedback_details import packing
from summarize_from_feedback_details.infra.checkpoints import Resumable
from summarize_from_feedback_details.infra.flags import RunArgs, parse_args
from summarize_from_feedback_details.infra.launch import make_optimizer, quiet_libraries, start_run
from summarize_from_feedback_details.infra.loading import (add_reward_offset, enable_gradient_checkpointing,
                                                           load_reward_model, load_split_dataset, load_tokenizer,
                                                           require_splits)
from summarize_from_feedback_details.infra.lora import quantization, trainable_parameters, with_lora
from summarize_from_feedback_details.infra.tracking import PhaseTimer
quiet_libraries()  # before transformers' optimization module, whose import of bitsandbytes (by peft) warns
from transformers import get_scheduler  # noqa: E402


@dataclass
class MethodArgs:
    """reward.py's flags that change what is learned, then (memory and speed) those that change only how the
    work is split and run"""

    # seed, models and data
    seed: int = 1
    """global seed: the data order, the reward head's initialisation, and each process's python/numpy/torch
    seed (seed + rank * 100003)"""
    base_model: str = "EleutherAI/pythia-1b-deduped"
    """the tokenizer (and the hub repo name with --push_to_hub)"""
    sft_model_path: str = "models/sft_model"
    """the backbone of the reward model (a causal-LM checkpoint; its LM head is dropped)"""
    reward_model_path: str = ""
    """continue from a saved reward model (head included); "" starts from the SFT checkpoint"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """the SFT dataset (hub name or local folder); only its train references are used, to normalise"""
    label_dataset: str = "vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144"
    """the preference dataset (hub name or a local `save_to_disk` folder from tldr_dataset.py)"""

    # optimizer
    lr: float = 3e-6
    """peak learning rate (the paper's 3e-6), decayed by --scheduler over the updates"""
    eps: float = 1e-5
    """epsilon of Adam(W)'s denominator (the paper's 1e-5; torch's default is 1e-8)"""
    weight_decay: float = 0.01
    """AdamW weight decay (the paper's runs got 0.01 silently from torch's default)"""
    max_grad_norm: Optional[float] = None
    """clip the global gradient norm at this value, the same way with and without DeepSpeed; unset or
    <= 0: no clipping, which is what the paper's runs did (DESIGN section 4)"""
    optimizer: Literal["adamw", "adam"] = "adamw"
    """`adamw`: decoupled weight decay; `adam`: torch's Adam, which adds --weight_decay to the gradient (L2)"""
    scheduler: str = "cosine"
    """learning-rate schedule over the updates, by transformers' get_scheduler name (cosine, linear, constant, ...)"""
    warm_up_steps: int = 0
    """updates of warm-up at the start of the schedule (0: none, as in the paper)"""

    # batches, in preference pairs: batch_size = local_micro_batch_size * gradient_accumulation_steps * world_size
    # (memory and speed, below)
    num_train_epochs: int = 1
    """passes over the preference pairs, when --total_episodes is not given"""
    total_episodes: Optional[int] = None
    """defaults to len(train split) * num_train_epochs; 0 trains nothing: the SFT backbone under its seeded
    random head, normalised as usual (the reward model that knows nothing, `make compare`'s control)"""
    batch_size: Optional[int] = None
    """global batch: if given, gradient_accumulation_steps is derived from it (must divide exactly)"""
    rank_dependent_shuffle: bool = False
    """the paper's data order: every rank shuffles the pairs with its own seed before accelerate
    shards them, so ranks overlap and miss pairs (about 66% unique pairs per epoch on 8 GPUs)"""

    # memory and speed: how the work is split and run (each help says what, if anything, it changes)
    local_micro_batch_size: Resumable[int] = 1
    """pairs per forward/backward on each process (chosen and rejected in one pass): a memory knob, the update
    does not change"""
    gradient_accumulation_steps: Resumable[int] = 8
    """micro-batches per update on each process (derived from --batch_size when that is given)"""
    local_eval_batch_size: Resumable[int] = 1
    """pairs per process in eval and rows per process in the normalisation pass"""
    gradient_checkpointing: Resumable[bool] = False
    """recompute activations in the backward pass: less memory, about a third more compute, the same update"""
    packing: bool = True
    """forwards on real tokens only (packing.py; the same result to float noise); --no_packing: padded"""
    deepspeed: Resumable[bool] = False
    """assert that accelerate runs DeepSpeed and give it our micro-batch size"""


@dataclass
class Args(RunArgs, MethodArgs):
    """Every flag of the stage: MethodArgs' (above), RunArgs' (infra/flags.py: naming, checkpoints, tracking,
    LoRA), then this stage's own plumbing"""

    # this stage's run
    exp_name: Resumable[str] = os.path.basename(__file__)[: -len(".py")]
    """name of the experiment: the start of the run name and, with --push_to_hub, part of the repo name"""
    run_eval: Resumable[bool] = False
    """after training: accuracy on `validation` and `validation_cnndm`, by split, batch and confidence"""
    output_dir: Resumable[str] = "models/reward_model"
    """where the normalised reward model and tokenizer are saved, with checkpoints/ inside ("" saves nothing)"""

    # filled in at run time, not flags: a value given for one would be overwritten without a word
    world_size: Resumable[tyro.conf.Suppress[Optional[int]]] = None
    """derived: the number of processes"""
    local_batch_size: Resumable[tyro.conf.Suppress[Optional[int]]] = None
    """derived: local_micro_batch_size x gradient_accumulation_steps"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """derived: total_episodes // batch_size"""


TRAIN_COLUMNS = ("query_chosen_token", "query_rejected_token")
# kept next to the rewards in the eval table
EVAL_COLUMNS = ("query", "chosen", "rejected", "batch", "split", "extra", "choice", "policies", "chosen_policy",
                "rejected_policy")
REFERENCE_COLUMNS = ("query_reference_response_token", "query_token", "reference_response_token")
CONSISTENCY_TOLERANCE = 1e-2


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


def derive_reward_batch_sizes(args: Args, world_size: int, dataset_len: int) -> None:
    """derive_batch_sizes, where --total_episodes 0 is allowed: no update (make compare's control)."""
    untrained = args.total_episodes == 0
    if untrained:
        args.total_episodes = None  # the batch arithmetic of a full pass, then none of its updates
    derive_batch_sizes(args, world_size, dataset_len)
    if untrained:
        args.total_episodes = args.num_updates = 0


def epoch_permutations(n: int, epochs: int, seed: int) -> list:
    """A fresh permutation of range(n) per epoch, from the global seed only (identical on all ranks)."""
    generator = torch.Generator().manual_seed(seed)
    return [i for _ in range(epochs) for i in torch.randperm(n, generator=generator).tolist()]


def last_non_pad_index(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Index of the rightmost non-pad token of each row: the EOS of a query+response row, whether
    the query is left-padded or not. The same rule as HF's sequence-classification pooling."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return ((input_ids != pad_id) * positions).argmax(1)


def get_reward(model, query_responses: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Reward of each row, read at its last non-pad token (the EOS), shape [batch].

    Pad tokens are masked out of attention and positions count real tokens only, so the amount of
    left or right padding changes nothing, also for models with absolute positions. Unlike the
    causal-LM `forward` of sft.py, pad ids are NOT replaced by 0 here: HF's sequence-classification
    head finds the token to read by looking for `config.pad_token_id`, and [PAD] is a valid row of
    the (resized) embedding whose value is masked out anyway. --packing: real tokens only (packing.py)."""
    attention_mask = query_responses != pad_id
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    if packing.is_on(model):
        return packing.last_token_scores(model, query_responses, attention_mask, position_ids)
    output = model(input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False, return_dict=True)
    return output.logits.squeeze(-1)


def pair_rewards(model, chosen: torch.Tensor, rejected: torch.Tensor, pad_id: int) -> tuple:
    """Chosen and rejected rows in ONE forward pass (concatenated along the batch)."""
    rewards = get_reward(model, torch.cat([chosen, rejected]), pad_id)
    return rewards[: len(chosen)], rewards[len(chosen):]


def preference_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, normalizer: float) -> torch.Tensor:
    """This micro-batch's share of the global objective mean(-logsigmoid(r_chosen - r_rejected)):
    the sum over its pairs divided by the number of pairs in the whole global batch."""
    return -F.logsigmoid(chosen_rewards - rejected_rewards).sum() / normalizer


def init_score_head(model, seed: int) -> None:
    """Head weight ~ N(0, 1/sqrt(hidden+1)), bias 0 (HF's `score` has none), as in the paper.
    Its own generator, seeded with the global seed: every rank starts from the same head."""
    weight = model.score.weight
    generator = torch.Generator().manual_seed(seed)
    std = 1 / math.sqrt(model.config.hidden_size + 1)
    with torch.no_grad():
        weight.copy_(torch.normal(0.0, std, size=tuple(weight.shape), generator=generator))
        if getattr(model.score, "bias", None) is not None:
            model.score.bias.zero_()


def final_norm_bias(model) -> Optional[torch.nn.Parameter]:
    """The bias of the norm whose output the `score` head reads (GPT-NeoX, GPT-2, Llama-like names):
    where the reward normalisation is folded; None where there is none (RMSNorm) or no such norm."""
    for name in ("final_layer_norm", "ln_f", "norm"):
        module = getattr(model.base_model, name, None)
        if module is not None:
            return getattr(module, "bias", None)
    return None


def full_parameters(params: list):
    """A context in which `params` hold their full values and in-place changes are kept. ZeRO-3
    leaves each rank a shard (also at load time, through transformers' zero.Init): gather them,
    and keep rank 0's changes (every rank computes the same ones)."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    return contextlib.nullcontext()


@torch.no_grad()
def shift_rewards(model, offset: float) -> None:
    """Adds `offset` to the reward at every position, exactly: score(h) = w . h, so moving the final
    norm's bias by `offset * w / |w|^2` moves w . h by `offset` (HF's score layer has no bias).
    Without such a bias (RMSNorm), `config.reward_offset` grows by `offset` (infra.loading.add_reward_offset
    adds it to the head's output)."""
    bias = final_norm_bias(model)
    if bias is None:
        model.config.reward_offset = getattr(model.config, "reward_offset", 0.0) + offset
        add_reward_offset(model)
        return
    weight = model.score.weight.double()[0]
    bias.add_((offset * weight / weight.dot(weight)).to(bias.dtype))


def same_real_tokens(a: torch.Tensor, b: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Per row: do `a` and `b` hold the same non-pad tokens in the same order (pads anywhere)?"""
    width = max(a.shape[1], b.shape[1])

    def compact(x):  # non-pad tokens to the front, in order, then pads up to `width`
        order = torch.argsort((x == pad_id).int(), dim=1, stable=True)
        x = x.gather(1, order)
        return F.pad(x, (0, width - x.shape[1]), value=pad_id)

    return (compact(a) == compact(b)).all(1)


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


def reward_model_to_train(path: str, tokenizer, head_seed: Optional[int], **quantized):
    """The reward model to train, from `path` (fp32 master weights whatever the checkpoint's dtype;
    mixed precision is accelerate's job). From an SFT (causal-LM) checkpoint the LM head is dropped
    and a fresh head is initialised (`head_seed`); from a saved reward model (`head_seed=None`) the
    head is kept. `quantized`: from `quantization`."""
    model = load_reward_model(path, tokenizer, new_head=head_seed is not None, **quantized)
    if head_seed is not None:
        with full_parameters([model.score.weight]):
            init_score_head(model, head_seed)
    return model


# ---------------------------------------------------------------------------------------------
# evaluation and normalisation
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(accelerator: Accelerator, model, pad_id: int, dataloader, dataset) -> tuple:
    """Rewards of every pair of `dataset`, gathered without the duplicates that sharding pads the
    last batch with; returns (metrics without prefix, eval table)."""
    indices, chosen, rejected = [], [], []
    for batch in dataloader:
        c, r = pair_rewards(model, batch["query_chosen_token"], batch["query_rejected_token"], pad_id)
        index, c, r = accelerator.gather_for_metrics((batch["row_index"], c, r))
        indices.append(index.cpu())
        chosen.append(c.float().cpu())
        rejected.append(r.float().cpu())
    indices, chosen, rejected = torch.cat(indices), torch.cat(chosen), torch.cat(rejected)
    table = pair_table(dataset, indices, chosen, rejected)
    loss = -F.logsigmoid(chosen - rejected).mean().item()
    return {"loss": loss, "chosen_rewards": chosen.mean().item(), "rejected_rewards": rejected.mean().item()}, table


@torch.no_grad()
def score_references(accelerator: Accelerator, model, pad_id: int, dataloader, concatenated: bool,
                     max_batches: Optional[int] = None) -> dict:
    """Rewards of the SFT references as the RM saw pairs in training (the re-encoded, right-padded
    query+reference); with `concatenated`, also as PPO will score them ([left-padded query |
    right-padded response]) and whether both hold the same tokens."""
    out = {"reward": [], "reward_concatenated": [], "same_tokens": []}
    for i, batch in enumerate(dataloader):
        if max_batches is not None and i >= max_batches:
            break
        query_reference = batch["query_reference_response_token"]
        values = [get_reward(model, query_reference, pad_id).float()]
        if concatenated:
            concat = torch.cat([batch["query_token"], batch["reference_response_token"]], 1)
            # (gloo cannot gather bools: the flag travels as an int)
            values += [get_reward(model, concat, pad_id).float(), same_real_tokens(query_reference, concat, pad_id).long()]
        for key, value in zip(out, accelerator.gather_for_metrics(tuple(values))):
            out[key].append(value.cpu())
    return {k: torch.cat(v) for k, v in out.items() if v}


def normalize_rewards(run, model, pad_id: int, reference_loader, logger, global_step: int) -> int:
    """Shifts the rewards so that the SFT train references score 0 on average (every rank gathers the
    same rewards and shifts its own copy of the model identically), logs the rewards before and after
    and the consistency check: the re-encoded row and [left-padded query | right-padded reference]
    must agree. Returns the number of references with identical tokens whose two rewards differ by
    more than CONSISTENCY_TOLERANCE."""
    accelerator, unwrapped = run.accelerator, run.accelerator.unwrap_model(model)
    scores = score_references(accelerator, model, pad_id, run.progress(
        reference_loader, len(reference_loader), "rewards of the SFT references", stoppable=True), concatenated=True)
    before = scores["reward"].double()
    with full_parameters([p for p in (unwrapped.score.weight, final_norm_bias(unwrapped)) if p is not None]):
        shift_rewards(unwrapped, -before.mean().item())
    # the shift is exact in fp32; re-score the first batch to measure it (bf16 weights round it)
    check = score_references(accelerator, model, pad_id, reference_loader, concatenated=False, max_batches=1)
    fold_error = (check["reward"].double() - (before[: len(check["reward"])] - before.mean())).abs().max()
    reward = before - before.mean()
    abs_diff = (before - scores["reward_concatenated"].double()).abs()
    same = scores["same_tokens"].bool()
    metrics = {
        "eval/rm/reference_mean_before_normalization": before.mean().item(),
        "eval/rm/reference_std_before_normalization": before.std().item(),
        "eval/rm/reference_mean_after_normalization": reward.mean().item(),
        "eval/rm/reference_std_after_normalization": reward.std().item(),
        "eval/rm/normalization_offset": -before.mean().item(),
        "eval/rm/normalization_max_error": fold_error.item(),
        "eval/rm/consistency/max_abs_diff": abs_diff.max().item(),
        "eval/rm/consistency/mean_abs_diff": abs_diff.mean().item(),
        "eval/rm/consistency/frac_gt_tolerance": (abs_diff > CONSISTENCY_TOLERANCE).double().mean().item(),
        "eval/rm/consistency/frac_same_tokens": same.double().mean().item(),
    }
    logger.log(metrics, global_step)
    logger.table("reference_rewards", pd.DataFrame({
        "reward_before_normalization": before.numpy(), "reward": reward.numpy(),
        "reward_concatenated": scores["reward_concatenated"].numpy() - before.mean().item(),
        "abs_diff": abs_diff.numpy(), "same_tokens": same.numpy(),
    }))
    # rows with identical tokens may differ only by float noise; rows that tokenize differently at
    # the query/response boundary are a property of the data, reported but not an error
    inconsistent = int(((abs_diff > CONSISTENCY_TOLERANCE) & same).sum())
    run.print(f"reference rewards over {len(reward)} rows: mean {before.mean().item():.4f} -> {reward.mean().item():.2e}, "
              f"std {reward.std().item():.4f}; consistency max |diff| {abs_diff.max().item():.2e}, "
              f"{int((~same).sum())} rows tokenized differently")
    if inconsistent:
        run.print(f"[bold red]WARNING: {inconsistent} references with identical tokens get rewards that differ by "
                  f"more than {CONSISTENCY_TOLERANCE} between [query | response] and the re-encoded row: "
                  "padding or position handling is wrong for this model")
    return inconsistent


# ---------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    label_dataset = load_split_dataset(args.label_dataset, TRAIN_COLUMNS + EVAL_COLUMNS, kind="preference")
    query_dataset = load_split_dataset(args.query_dataset, REFERENCE_COLUMNS, kind="SFT")
    if "train" not in label_dataset or "train" not in query_dataset:
        raise ValueError(f"{args.label_dataset} and {args.query_dataset} both need a `train` split")
    if args.run_eval:
        require_splits(label_dataset, args.label_dataset, ("validation",), "--run_eval")
    # `batch_size` may set the accumulation steps: derive them before the Accelerator exists
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    derive_reward_batch_sizes(args, world_size, len(label_dataset["train"]))
    # a checkpoint continues on any process count, for the same stage, seed and batch arithmetic
    # (with the paper's per-rank shuffle the data order also depends on the process count)
    run = start_run(args, {"stage": "reward", "seed": args.seed, "batch_size": args.batch_size,
                           "total_episodes": args.total_episodes, "num_updates": args.num_updates,
                           "order": f"per rank of {world_size}" if args.rank_dependent_shuffle else "global"})
    accelerator, start_update = run.accelerator, run.start_update
    run.print_batch_arithmetic("pairs")

    tokenizer = load_tokenizer(args.base_model, args.label_dataset, args.query_dataset)
    pad_id = tokenizer.pad_token_id
    def load_base(**quantized):  # an RM to continue training, or the SFT model under a fresh head
        if args.reward_model_path:
            return reward_model_to_train(args.reward_model_path, tokenizer, head_seed=None, **quantized)
        return reward_model_to_train(args.sft_model_path, tokenizer, head_seed=args.seed, **quantized)

    model = load_base(**quantization(args, accelerator.device))
    if args.use_peft:
        model = with_lora(model, args, head="score")
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    packing.enable(args.packing, model)
    run.print(f"model: {trainable_parameters(model)}")
    optimizer = make_optimizer(args, model)
    scheduler = get_scheduler(args.scheduler, optimizer=optimizer, num_warmup_steps=args.warm_up_steps,
                              num_training_steps=args.num_updates)

    train = label_dataset["train"]
    train = train.add_column("row_index", list(range(len(train)))).with_format(
        "torch", columns=list(TRAIN_COLUMNS) + ["row_index"])
    # One explicit order for every rank and world size; accelerate hands rank r the local batches
    # r, r + world_size, ..., so global batch k is always order[k * batch_size : (k + 1) * batch_size]
    # and every pair is seen once per epoch across all ranks (the original shuffled per rank, so
    # ranks overlapped and missed pairs; --rank_dependent_shuffle brings that back).
    order_seed = run.local_seed if args.rank_dependent_shuffle else args.seed
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
    reference_loader = DataLoader(query_dataset["train"].with_format("torch", columns=list(REFERENCE_COLUMNS)),
                                  batch_size=args.local_eval_batch_size)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    eval_loaders = {s: accelerator.prepare(dl) for s, dl in eval_loaders.items()}
    reference_loader = accelerator.prepare(reference_loader)
    checkpoints, logger = run.checkpoints_and_logger(model, optimizer, [scheduler])

    model.train()
    update = start_update
    # (update, row index) of every pair trained on, over all ranks: train_pairs.csv
    trained_pairs = [tuple(pair) for pair in run.records] if run.records else []
    start = time.time()
    for batch in run.progress(train_loader, args.num_updates - start_update, "reward",
                              ("train/rm/loss", "train/rm/accuracy")):
        if update == args.num_updates:
            break
        update += 1
        timer = PhaseTimer(accelerator.device)  # time/ and throughput/ metrics
        lr = scheduler.get_last_lr()[0]  # the learning rate of this update
        # sums over this rank's pairs: loss share, correct pairs, chosen rewards, rejected rewards
        stats = torch.zeros(4, device=accelerator.device)
        for micro_start in range(0, args.local_batch_size, args.local_micro_batch_size):
            micro = slice(micro_start, micro_start + args.local_micro_batch_size)
            with accelerator.accumulate(model):
                chosen, rejected = pair_rewards(model, batch["query_chosen_token"][micro],
                                                batch["query_rejected_token"][micro], pad_id)
                loss = preference_loss(chosen, rejected, args.batch_size)
                # accelerate divides by the accumulation steps and DDP averages over ranks: undo
                # both so the gradient is exactly that of the global-batch mean loss
                accelerator.backward(loss * args.gradient_accumulation_steps * accelerator.num_processes)
                run.optimizer_step(model, optimizer, update, loss)  # (clipping; --on_nonfinite)
            stats += torch.stack([loss.detach(), (chosen > rejected).sum().float(), chosen.detach().sum(),
                                  rejected.detach().sum()]).float()
        scheduler.step()
        stats = accelerator.reduce(stats, "sum")
        trained_pairs += [(update, i) for i in accelerator.gather(batch["row_index"]).tolist()]
        global_step = update * args.batch_size  # x-axis: episodes (pairs) seen so far
        # positions of the global batch's chosen and rejected sequences (padding included)
        tokens = args.batch_size * (batch["query_chosen_token"].shape[1] + batch["query_rejected_token"].shape[1])
        logger.log({
            "train/rm/loss": stats[0].item(),
            "train/rm/accuracy": stats[1].item() / args.batch_size,
            "train/rm/chosen_rewards": stats[2].item() / args.batch_size,
            "train/rm/rejected_rewards": stats[3].item() / args.batch_size,
            "train/rm/lr": lr,
            "train/rm/eps": (update - start_update) * args.batch_size / (time.time() - start),
            **timer.metrics(tokens=tokens),
        }, global_step)
        checkpoints.after_update(update, args.run_name, logger, records=trained_pairs)
    global_step = update * args.batch_size
    logger.table("train_pairs", pd.DataFrame(trained_pairs, columns=["update", "row_index"]))
    model.eval()

    if args.run_eval:
        for split, loader in eval_loaders.items():
            metrics, table = evaluate(accelerator, model, pad_id, run.progress(
                loader, len(loader), f"eval {split}", stoppable=True), eval_sets[split])
            logger.table(f"eval_{split}_table", table)
            metrics = {**accuracy_breakdown(table, split), **{f"eval/rm/{split}/{k}": v for k, v in metrics.items()}}
            logger.log(metrics, global_step)
            run.print(f"{split}: accuracy {metrics[f'eval/rm/{split}/accuracy']:.4f} over {len(table)} pairs")

    if args.use_peft:
        # the normalisation goes into the final norm, which the adapter does not own: from here on
        # (scoring, normalising, saving) the merged model; the adapter alone is saved as trained
        model = run.merged_lora_model(model, load_base)
    inconsistent = normalize_rewards(run, model, pad_id, reference_loader, logger, global_step)
    run.save(model, tokenizer, accelerator.unwrap_model(model))
    run.finish(logger)
    if inconsistent and accelerator.mixed_precision == "no":
        # in fp32 this is a bug, not noise (the model is saved; the run still fails loudly)
        raise RuntimeError(f"consistency check failed for {inconsistent} references (see "
                           f"runs/{args.run_name}/reference_rewards.csv)")


if __name__ == "__main__":
    main(parse_args(Args))  # tyro.cli, knowing other codebases' flags
