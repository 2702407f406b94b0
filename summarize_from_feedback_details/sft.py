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

Carried out by the shared loaders (`infra/`), as in the paper's code: a dedicated `[PAD]` token (never EOS, so EOS
stays a learnable target), dropout off, and each process seeded with seed + rank x 100003.
"""

import functools
import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from rouge_score import rouge_scorer
from torch.utils.data import DataLoader

from summarize_from_feedback_details import packing
from summarize_from_feedback_details.evaluation import generation_rows
from summarize_from_feedback_details.infra.checkpoints import Resumable
from summarize_from_feedback_details.infra.flags import RunArgs, parse_args
from summarize_from_feedback_details.infra.launch import make_optimizer, quiet_libraries, start_run
from summarize_from_feedback_details.infra.loading import (enable_gradient_checkpointing, load_policy,
                                                           load_split_dataset, load_tokenizer, require_splits)
from summarize_from_feedback_details.infra.lora import quantization, trainable_parameters, with_lora
from summarize_from_feedback_details.infra.tracking import PhaseTimer
quiet_libraries()  # before transformers' optimization module, whose import of bitsandbytes (by peft) warns
from transformers import get_scheduler  # noqa: E402


@dataclass
class MethodArgs:
    """sft.py's flags that change what is learned, then (memory and speed) those that change only how the work
    is split and run"""

    # the loss
    response_only_loss: bool = False
    """train on response tokens only (the dataset's `_response_label` column)"""
    loss_normalization: Literal["sequence", "token"] = "sequence"
    """`sequence`: mean over the global batch of each sequence's token-mean loss (what the paper's
    runs computed, at micro-batch 1); `token`: mean over all target tokens of the global batch"""

    # seed, models and data
    seed: int = 1
    """global seed: the data order, and each process's python/numpy/torch seed (seed + rank * 100003)"""
    base_model: str = "EleutherAI/pythia-1b-deduped"
    """the model to fine-tune and its tokenizer (hub name or local folder); names the hub repo of --push_to_hub"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """hub name or a local `save_to_disk` folder from tldr_dataset.py"""

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

    # batches: batch_size = local_micro_batch_size * gradient_accumulation_steps * world_size (memory and speed, below)
    num_train_epochs: int = 1
    """passes over the train split, when --total_episodes is not given"""
    total_episodes: Optional[int] = None
    """defaults to len(train split) * num_train_epochs; more than one pass reshuffles per pass"""
    batch_size: Optional[int] = None
    """global batch: if given, gradient_accumulation_steps is derived from it (must divide exactly)"""

    # generation in the eval and the sample output
    response_length: int = 53
    """tokens generated per query in the eval and the sample generation (53 for TL;DR)"""
    temperature: float = 0.01
    """sampling temperature of the eval and the sample generation (the paper's 0.01, nearly greedy)"""

    # memory and speed: how the work is split and run (each help says what, if anything, it changes)
    local_micro_batch_size: Resumable[int] = 1
    """sequences per forward/backward on each process: a memory knob, the update does not change"""
    gradient_accumulation_steps: Resumable[int] = 16
    """micro-batches per update on each process (derived from --batch_size when that is given)"""
    local_eval_batch_size: Resumable[int] = 4
    """queries per process in each batch of the eval (loss, generation, ROUGE) and of the sample generation"""
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
    """after training: validation/test loss, generation at `temperature`, ROUGE, sample tables"""
    print_sample_output_freq: Resumable[int] = 0
    """every this many updates, generate for a few validation queries and log them (0: never)"""
    output_dir: Resumable[str] = "models/sft_model"
    """where the trained model and tokenizer are saved, with checkpoints/ inside ("" saves nothing)"""

    # filled in at run time, not flags: a value given for one would be overwritten without a word
    world_size: Resumable[tyro.conf.Suppress[Optional[int]]] = None
    """derived: the number of processes"""
    local_batch_size: Resumable[tyro.conf.Suppress[Optional[int]]] = None
    """derived: local_micro_batch_size x gradient_accumulation_steps"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """derived: total_episodes // batch_size"""


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


def response_window(labels: torch.Tensor, pad_id: int) -> int:
    """How many trailing columns a loss over the non-pad `labels` reads: from the column before the
    first one where any row has a label. The LM head runs on those only: with response labels (queries
    left-padded to one length) the response positions, not a 512-token query's (at a 50k vocabulary,
    most of a micro-batch's logits memory)."""
    first_label = int((labels != pad_id).any(0).int().argmax())
    return min(labels.shape[1] - first_label + 1, labels.shape[1])


def sequence_losses(logits: torch.Tensor, labels: torch.Tensor, pad_id: int) -> tuple:
    """Per-sequence sum of next-token cross-entropy over non-pad labels, and the target counts."""
    targets = labels[:, 1:]
    mask = targets != pad_id
    token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets.masked_fill(~mask, 0), reduction="none")
    return (token_loss * mask).sum(1), mask.sum(1)


def label_losses(model, input_ids: torch.Tensor, labels: torch.Tensor, pad_id: int) -> tuple:
    """`sequence_losses` of `labels` with logits only where a label is read (`response_window`)."""
    keep = response_window(labels, pad_id)
    return sequence_losses(forward(model, input_ids, pad_id, logits_to_keep=keep), labels[:, -keep:], pad_id)


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
# evaluation
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(args: Args, accelerator: Accelerator, model, tokenizer, dataloader, max_batches: Optional[int] = None) -> tuple:
    """Loss on query+reference, generation (at `args.temperature`, through the rollout engine: evaluation.py's
    generation_rows) truncated after EOS, ROUGE; gathered without the duplicates that sharding pads the last batch
    with."""
    pad_id, unwrapped = tokenizer.pad_token_id, accelerator.unwrap_model(model)
    loss_sums, counts, rows = [], [], []
    for i, batch in enumerate(dataloader):
        if max_batches is not None and i >= max_batches:
            break
        qr = batch["query_reference_response_token"]
        labels = batch["query_reference_response_token_response_label"] if args.response_only_loss else qr
        loss_sum, count = label_losses(model, qr, labels, pad_id)
        loss_sum, count = accelerator.gather_for_metrics((loss_sum, count))
        loss_sums.append(loss_sum.cpu())
        counts.append(count.cpu())
        rows += generation_rows(accelerator, unwrapped, tokenizer, batch, args.temperature, args.response_length,
                                args.seed, i)
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
    dataset = load_split_dataset(args.query_dataset, TRAIN_COLUMNS + EVAL_COLUMNS)
    derive_batch_sizes(args, int(os.environ.get("WORLD_SIZE", "1")), len(dataset["train"]))
    if args.run_eval or args.print_sample_output_freq:
        require_splits(dataset, args.query_dataset, ("validation",), "--run_eval (or --print_sample_output_freq)")
    # a checkpoint continues on any process count, for the same stage, seed and batch arithmetic
    run = start_run(args, {"stage": "sft", "seed": args.seed, "batch_size": args.batch_size,
                           "total_episodes": args.total_episodes, "num_updates": args.num_updates})
    accelerator, start_update = run.accelerator, run.start_update
    run.print_batch_arithmetic("sequences", f"loss over {'response' if args.response_only_loss else 'all non-pad'} "
                                            f"tokens, {args.loss_normalization}-normalised")

    tokenizer = load_tokenizer(args.base_model, args.query_dataset)
    pad_id = tokenizer.pad_token_id
    load_base = functools.partial(load_policy, args.base_model, tokenizer)  # (the saved LoRA model merges onto it)
    model = load_base(**quantization(args, accelerator.device))
    if args.use_peft:
        model = with_lora(model, args)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    packing.enable(args.packing, model)
    run.print(f"model: {trainable_parameters(model)}")
    optimizer = make_optimizer(args, model)
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
    checkpoints, logger = run.checkpoints_and_logger(model, optimizer, [scheduler])
    label_column = TRAIN_COLUMNS[1] if args.response_only_loss else TRAIN_COLUMNS[0]

    model.train()
    update = start_update
    start = time.time()
    for batch in run.progress(train_loader, args.num_updates - start_update, "sft", ("train/sft/loss",)):
        if update == args.num_updates:
            break
        update += 1
        timer = PhaseTimer(accelerator.device)  # time/ and throughput/ metrics
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
                loss_sum, count = label_losses(model, queries_responses[micro], labels[micro], pad_id)
                loss = normalized_loss(loss_sum, count, args.loss_normalization, normalizer)
                # accelerate divides by the accumulation steps and DDP averages over ranks: undo
                # both so the gradient is exactly that of the global-batch objective
                accelerator.backward(loss * args.gradient_accumulation_steps * accelerator.num_processes)
                run.optimizer_step(model, optimizer, update, loss)  # (clipping; --on_nonfinite)
            loss_total += loss.detach()
        scheduler.step()
        loss_total = accelerator.reduce(loss_total, "sum").item()
        metrics = {
            "train/sft/loss": loss_total,
            "train/sft/lr": lr,
            "train/sft/episode": update * args.batch_size,
            "train/sft/eps": (update - start_update) * args.batch_size / (time.time() - start),
            **timer.metrics(tokens=args.batch_size * queries_responses.shape[1]),
        }
        logger.log(metrics, update)
        if args.print_sample_output_freq and update % args.print_sample_output_freq == 0 and "validation" in eval_loaders:
            model.eval()
            sample_metrics, table = evaluate(args, accelerator, model, tokenizer, eval_loaders["validation"],
                                             max_batches=1)
            model.train()
            logger.table(f"samples_{update}", table)
            run.print(f"update {update}: loss {metrics['train/sft/loss']:.4f}; "
                      f"{table.iloc[0]['postprocessed_response']!r}")
        checkpoints.after_update(update, args.run_name, logger)

    if args.run_eval:
        model.eval()
        for split, loader in eval_loaders.items():
            eval_metrics, table = evaluate(args, accelerator, model, tokenizer, run.progress(
                loader, len(loader), f"eval {split}", stoppable=True))
            logger.log({f"{split}/sft/{'rouge/' if k.startswith('rouge') else ''}{k}": v
                        for k, v in eval_metrics.items()}, update)
            logger.table(f"{split}_table", table)
            run.print(f"{split}: " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
    run.save(model, tokenizer, accelerator.unwrap_model(model), load_base)
    run.finish(logger)


if __name__ == "__main__":
    main(parse_args(Args))  # tyro.cli, knowing other codebases' flags
