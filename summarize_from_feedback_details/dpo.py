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

Carried out by the shared loaders (`infra/`), as in the paper's code: a dedicated `[PAD]` token (never
EOS), dropout off in the policy and the reference, and each process seeded with seed + rank x 100003.
"""

import functools
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
from summarize_from_feedback_details.evaluation import GENERATION_COLUMNS, generation_rows
from summarize_from_feedback_details.infra.checkpoints import Resumable
from summarize_from_feedback_details.infra.flags import RunArgs, parse_args
from summarize_from_feedback_details.infra.launch import make_optimizer, quiet_libraries, start_run
from summarize_from_feedback_details.infra.loading import (describe_frozen, enable_gradient_checkpointing, frozen_dtype,
                                                           load_policy, load_split_dataset, load_tokenizer,
                                                           prepare_frozen, require_splits)
from summarize_from_feedback_details.infra.lora import quantization, reference_policy, trainable_parameters, with_lora
from summarize_from_feedback_details.infra.tracking import PhaseTimer
quiet_libraries()  # before transformers' optimization module, whose import of bitsandbytes (by peft) warns
from transformers import get_scheduler  # noqa: E402


@dataclass
class MethodArgs:
    """dpo.py's flags that change what is learned, then (memory and speed) those that change only how the work
    is split and run"""

    # DPO
    beta: float = 0.05
    """inverse temperature of the implicit reward beta * (log pi - log ref)"""
    label_smoothing: float = 0.0
    """conservative DPO: the label is taken to be wrong with this probability"""
    ipo: bool = False
    """the IPO loss (h - 1 / (2 beta))^2 instead of DPO's"""

    # seed, models and data
    seed: int = 1
    """global seed: the data order, and each process's python/numpy/torch seed (seed + rank * 100003)"""
    base_model: str = "EleutherAI/pythia-1b-deduped"
    """the tokenizer (and the hub repo name with --push_to_hub)"""
    sft_model_path: str = "models/sft_model"
    """policy and reference (a causal-LM checkpoint from sft.py)"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """the SFT dataset (hub name or local folder); its validation and test queries for --run_eval"""
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
    """defaults to len(train split) * num_train_epochs"""
    batch_size: Optional[int] = None
    """global batch: if given, gradient_accumulation_steps is derived from it (must divide exactly)"""
    rank_dependent_shuffle: bool = False
    """the paper's data order: every rank shuffles the pairs with its own seed before accelerate
    shards them, so ranks overlap and miss pairs (about 66% unique pairs per epoch on 8 GPUs)"""

    # generation in the eval
    response_length: int = 53
    """new tokens generated in the final eval"""
    temperature: float = 0.01
    """sampling temperature of the final eval's generation (the paper's 0.01)"""

    # memory and speed: how the work is split and run (each help says what, if anything, it changes)
    local_micro_batch_size: Resumable[int] = 1
    """pairs per forward/backward on each process (chosen and rejected in one pass): a memory knob, the update
    does not change"""
    gradient_accumulation_steps: Resumable[int] = 8
    """micro-batches per update on each process (derived from --batch_size when that is given)"""
    local_eval_batch_size: Resumable[int] = 1
    """pairs (implicit-reward eval) or queries (generation) per process in the final eval"""
    gradient_checkpointing: Resumable[bool] = False
    """recompute activations in the backward pass: less memory, about a third more compute, the same update"""
    packing: bool = True
    """forwards on real tokens only (packing.py; the same result to float noise); --no_packing: padded"""
    deepspeed: Resumable[bool] = False
    """assert that accelerate runs DeepSpeed and give it our micro-batch size"""
    offload: Resumable[bool] = False
    """DeepSpeed only: the frozen reference as a ZeRO-3 engine with its parameters offloaded to CPU"""


@dataclass
class Args(RunArgs, MethodArgs):
    """Every flag of the stage: MethodArgs' (above), RunArgs' (infra/flags.py: naming, checkpoints, tracking,
    LoRA), then this stage's own plumbing"""

    # this stage's run
    exp_name: Resumable[str] = os.path.basename(__file__)[: -len(".py")]
    """name of the experiment: the start of the run name and, with --push_to_hub, part of the repo name"""
    run_eval: Resumable[bool] = False
    """after training: implicit-reward accuracy on `validation` and `validation_cnndm` (by split, batch
    and confidence), and generation for the SFT validation and test queries, saved as tables"""
    output_dir: Resumable[str] = "models/dpo_model"
    """where the trained policy and tokenizer are saved, with checkpoints/ inside ("" saves nothing)"""

    # filled in at run time, not flags: a value given for one would be overwritten without a word
    world_size: Resumable[tyro.conf.Suppress[Optional[int]]] = None
    """derived: the number of processes"""
    local_batch_size: Resumable[tyro.conf.Suppress[Optional[int]]] = None
    """derived: local_micro_batch_size x gradient_accumulation_steps"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """derived: total_episodes // batch_size"""


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


def epoch_permutations(n: int, epochs: int, seed: int) -> list:
    """A fresh permutation of range(n) per epoch, from the global seed only (identical on all ranks)."""
    generator = torch.Generator().manual_seed(seed)
    return [i for _ in range(epochs) for i in torch.randperm(n, generator=generator).tolist()]


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Index of the first True of each row, or the row length when there is none."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def forward(model, input_ids: torch.Tensor, pad_id: int, logits_to_keep: int = 0) -> torch.Tensor:
    """Logits. Pad ids become a valid id and are masked out; positions count real tokens only (so left
    padding changes nothing, also for models with absolute positions). No KV cache: nothing generates
    from this pass. `logits_to_keep` N > 0: the last N positions only (the LM head runs on those alone).
    --packing: real tokens only (packing.py; zeros at padding)."""
    attention_mask = input_ids != pad_id
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    input_ids = torch.masked_fill(input_ids, ~attention_mask, 0)
    if packing.is_on(model):
        return packing.lm_logits(model, input_ids, attention_mask, position_ids, logits_to_keep)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                 logits_to_keep=logits_to_keep, return_dict=True).logits


def check_dpo_args(args: Args) -> None:
    """Stops on DPO settings that cannot work, before any model is loaded."""
    if args.beta <= 0:
        raise ValueError(f"--beta must be > 0, got {args.beta}")
    if not 0 <= args.label_smoothing < 0.5:
        raise ValueError(f"--label_smoothing must be in [0, 0.5), got {args.label_smoothing}")
    if args.offload and args.use_peft:
        raise ValueError("--offload moves the frozen reference to the CPU; with --use_peft there is none (the "
                         "reference is the policy with its adapter disabled)")


def response_window(labels: torch.Tensor, pad_id: int) -> int:
    """How many trailing columns a loss over the non-pad `labels` reads: from the column before the
    first one where any row has a label. The LM head runs on those only: with response labels (queries
    left-padded to one length) the response positions, not a 512-token query's (at a 50k vocabulary,
    most of a micro-batch's logits memory)."""
    first_label = int((labels != pad_id).any(0).int().argmax())
    return min(labels.shape[1] - first_label + 1, labels.shape[1])


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Each row's summed log-probability of the tokens of `labels` that are not pad, each given the
    tokens before it. With the response-label columns, query and padding are pad: exactly the
    response counts, EOS included, with no length normalisation (as the paper)."""
    targets = labels[:, 1:]
    mask = targets != pad_id
    token_logprobs = -F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets.masked_fill(~mask, 0),
                                      reduction="none")
    return (token_logprobs * mask).sum(1)


def left_aligned(input_ids: torch.Tensor, labels: torch.Tensor, pad_id: int) -> tuple:
    """Each row's trailing padding moved to its front, in `input_ids` and `labels` alike. The pair rows
    are the paper's query + response + padding, so each response starts at the column where its own
    query ends; left-aligned, every response ends in the last column and `response_window` spans the
    longest response (54 of 565 columns at the paper's lengths) instead of nearly the whole row. The
    forward's positions count real tokens only, so the model sees the same sequences (to float noise)."""
    width = input_ids.shape[1]
    trailing = first_true_indices((input_ids != pad_id).flip(1))  # (an all-pad row: its width, no move)
    source = (torch.arange(width, device=input_ids.device)[None] - trailing[:, None]) % width
    return input_ids.gather(1, source), labels.gather(1, source)


def pair_logprobs(model, chosen: torch.Tensor, rejected: torch.Tensor, chosen_labels: torch.Tensor,
                  rejected_labels: torch.Tensor, pad_id: int) -> tuple:
    """Summed response log-probs of the chosen and the rejected rows, in ONE forward pass
    (concatenated along the batch), the LM head at the response window only (`left_aligned`)."""
    input_ids, labels = left_aligned(torch.cat([chosen, rejected]), torch.cat([chosen_labels, rejected_labels]), pad_id)
    keep = response_window(labels, pad_id)
    logits = forward(model, input_ids, pad_id, logits_to_keep=keep)
    logprobs = sequence_logprobs(logits, labels[:, -keep:], pad_id)
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


def generation_table(args: Args, accelerator: Accelerator, model, tokenizer, dataloader) -> pd.DataFrame:
    """The policy's response (at `args.temperature`, through the rollout engine: evaluation.py's generation_rows) to
    every query of a split, truncated after EOS, next to the reference: the table eval/ judges."""
    rows, unwrapped = [], accelerator.unwrap_model(model)
    for i, batch in enumerate(dataloader):
        rows += generation_rows(accelerator, unwrapped, tokenizer, batch, args.temperature, args.response_length,
                                args.seed, i)
    return pd.DataFrame(rows, columns=GENERATION_COLUMNS)


# ---------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    label_dataset = load_split_dataset(args.label_dataset, TRAIN_COLUMNS + EVAL_COLUMNS, kind="preference")
    if "train" not in label_dataset:
        raise ValueError(f"{args.label_dataset} needs a `train` split")
    query_dataset = load_split_dataset(args.query_dataset, QUERY_COLUMNS) if args.run_eval else {}
    if args.run_eval:
        require_splits(label_dataset, args.label_dataset, ("validation",), "--run_eval")
        require_splits(query_dataset, args.query_dataset, ("validation",), "--run_eval")
    # `batch_size` may set the accumulation steps: derive them before the Accelerator exists
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    derive_batch_sizes(args, world_size, len(label_dataset["train"]))
    check_dpo_args(args)
    # a checkpoint continues on any process count, for the same stage, seed and batch arithmetic
    # (with the paper's per-rank shuffle the data order also depends on the process count)
    run = start_run(args, {"stage": "dpo", "seed": args.seed, "batch_size": args.batch_size,
                           "total_episodes": args.total_episodes, "num_updates": args.num_updates,
                           "order": f"per rank of {world_size}" if args.rank_dependent_shuffle else "global"})
    accelerator, start_update = run.accelerator, run.start_update
    run.print_batch_arithmetic("pairs", f"{'IPO' if args.ipo else 'DPO'} loss, beta {args.beta}, "
                                        f"label smoothing {args.label_smoothing}")

    tokenizer = load_tokenizer(args.base_model, args.label_dataset, args.query_dataset)
    pad_id = tokenizer.pad_token_id
    model = load_policy(args.sft_model_path, tokenizer, **quantization(args, accelerator.device))
    if args.use_peft:  # the reference is the policy with its adapter disabled: no second copy of the weights
        model, ref_policy = with_lora(model, args), None
    else:
        ref_policy = load_policy(args.sft_model_path, tokenizer, frozen_dtype(accelerator.mixed_precision))
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    packing.enable(args.packing, model, ref_policy)
    run.print(f"policy: {trainable_parameters(model)}")
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
    query_loaders = {s: DataLoader(query_dataset[s].with_format("torch", columns=list(QUERY_COLUMNS)),
                                   batch_size=args.local_eval_batch_size)
                     for s in ("validation", "test") if s in query_dataset}
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    eval_loaders = {s: accelerator.prepare(dl) for s, dl in eval_loaders.items()}
    query_loaders = {s: accelerator.prepare(dl) for s, dl in query_loaders.items()}
    ref_policy = prepare_frozen(ref_policy, args, accelerator)
    unwrapped = accelerator.unwrap_model(model)
    checkpoints, logger = run.checkpoints_and_logger(model, optimizer, [scheduler])
    run.print(f"reference policy: {describe_frozen(ref_policy)}")

    model.train()
    update = start_update
    # (update, row index) of every pair trained on, over all ranks: train_pairs.csv
    trained_pairs = [tuple(pair) for pair in run.records] if run.records else []
    start = time.time()
    for batch in run.progress(train_loader, args.num_updates - start_update, "dpo",
                              ("train/rm/loss", "train/rm/accuracy")):
        if update == args.num_updates:
            break
        update += 1
        timer = PhaseTimer(accelerator.device)  # time/ and throughput/ metrics
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
                run.optimizer_step(model, optimizer, update, loss)  # (clipping; --on_nonfinite)
            with torch.no_grad():
                chosen = implicit_rewards(policy_chosen, ref_chosen, args.beta)
                rejected = implicit_rewards(policy_rejected, ref_rejected, args.beta)
                stats += torch.stack([loss, (chosen > rejected).sum(), chosen.sum(), rejected.sum(), policy_chosen.sum(),
                                      policy_rejected.sum(), ref_chosen.sum(), ref_rejected.sum()]).float()
        scheduler.step()
        stats = (accelerator.reduce(stats, "sum") / args.batch_size).tolist()
        trained_pairs += [(update, i) for i in accelerator.gather(batch["row_index"]).tolist()]
        global_step = update * args.batch_size  # x-axis: episodes (pairs) seen so far
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
            **timer.metrics(tokens=tokens),
        }, global_step)
        checkpoints.after_update(update, args.run_name, logger, records=trained_pairs)
    global_step = update * args.batch_size
    logger.table("train_pairs", pd.DataFrame(trained_pairs, columns=["update", "row_index"]))

    if args.run_eval:
        model.eval()
        for split, loader in eval_loaders.items():
            metrics, table = evaluate_pairs(args, accelerator, model, ref_policy, pad_id, run.progress(
                loader, len(loader), f"eval {split}", stoppable=True), eval_sets[split])
            logger.table(f"eval_{split}_table", table)
            metrics = {**accuracy_breakdown(table, split), **{f"eval/rm/{split}/{k}": v for k, v in metrics.items()}}
            logger.log(metrics, global_step)
            run.print(f"{split}: implicit-reward accuracy {metrics[f'eval/rm/{split}/accuracy']:.4f} over "
                      f"{len(table)} pairs")
        for split, loader in query_loaders.items():
            table = generation_table(args, accelerator, model, tokenizer, run.progress(
                loader, len(loader), f"generation {split}", stoppable=True))
            logger.table(f"{split}_table", table)
            run.print(f"{split}: {len(table)} responses, e.g. {table.iloc[0]['postprocessed_response']!r}")
    run.save(model, tokenizer, unwrapped, functools.partial(load_policy, args.sft_model_path, tokenizer))
    run.finish(logger)


if __name__ == "__main__":
    main(parse_args(Args))  # tyro.cli, knowing other codebases' flags
