"""Online DPO on TL;DR: the current policy samples two summaries per post, the reward model picks one.

    accelerate launch --config_file deepspeed.yaml summarize_from_feedback_details/online_dpo.py \\
        --base_model EleutherAI/pythia-1b-deduped --sft_model_path models/sft_model \\
        --reward_model_path models/reward_model --local_micro_batch_size 16 --gradient_accumulation_steps 4 \\
        --deepspeed --run_eval            # 8 GPUs: 512 episodes (256 posts x 2 samples) x 1953 updates
    python summarize_from_feedback_details/online_dpo.py --base_model models/tiny/pythia-tiny-s \\
        --sft_model_path <sft.py output> --reward_model_path <reward.py output> --query_dataset data/tldr/sft \\
        --response_length 32 --total_episodes 1920 --local_micro_batch_size 16 --gradient_accumulation_steps 4 \\
        --local_rollout_forward_batch_size 32 --local_eval_batch_size 16 --lr 1e-4 --run_eval  # tiny default, CPU

Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback") with the
reward model as the annotator: the setting of Noukhovitch et al. (Asynchronous RLHF, ICLR 2025, whose
Pythia TL;DR code is github.com/mnoukhov/async_rlhf, `src/online_dpo_trainer.py`) and of TRL's
OnlineDPOTrainer. Every update takes `batch_size / 2` posts from one global order (as PPO) and samples
two responses to each from the CURRENT policy at T 0.7; the reward model scores both at their EOS
after truncating after the EOS, a response without EOS scoring `--penalty_reward_value` (the EOS trick,
as PPO); the higher score is chosen, the lower rejected (a tie chooses the first sample, as the Async
RLHF code's `first_half >= second_half`). Then ONE optimizer step on the DPO loss of these pairs
against the frozen SFT reference: with h = (log pi(c) - log pi(r)) - (log ref(c) - log ref(r)) over
the response tokens up to and including the EOS, -logsigmoid(beta h) (`--loss_type ipo`, `--label_smoothing` as
dpo.py), summed over the pairs and divided by the global number of pairs, so micro-batch size,
accumulation and process count never change the update.

Choices, with their sources:
- beta 0.1: the Async RLHF code's OnlineDPOConfig default (its TL;DR configs keep it) and TRL's
  OnlineDPOConfig default (dpo.py's 0.05 is the N+ paper's offline DPO);
- lr 3e-6 annealed linearly to lr / num_updates, T 0.7, 53 tokens: the N+ paper's PPO, and the Async
  RLHF TL;DR configs (lr 3e-6 under TRL's linear decay stepped per update: the same schedule; T 0.7
  from TRL's OnPolicyConfig default);
- batch 512 episodes = 256 posts x 2 samples (the defaults on 8 processes), 1M episodes: PPO's (DESIGN
  sections 12 and 19), so the two compare episode for episode. The Async RLHF TL;DR runs took 128
  posts x 2 per update for 131072 posts: a global batch of 256 episodes with `--total_episodes 262144`;
- log-probabilities of the response tokens under the SAMPLING distribution, logits / (T + 1e-7) with
  `[PAD]` impossible, for policy and reference alike, as the Async RLHF code (and PPO here): the loss
  trains the distribution that draws the samples, and `objective/kl` is PPO's quantity (the sequence
  KL of the samples to the reference at the same T). TRL's OnlineDPOTrainer reads them at T 1 instead
  (and samples at its default T 0.9);
- the reference's log-probs come from a forward of the same micro-batch as the policy's, so before the
  first step (and with LoRA, whose reference is the policy with its adapter disabled) h is exactly 0.

Where this file differs from the Async RLHF code: each generation chunk's sampling noise is seeded from
(seed, update, position in the global batch, sample), so one process and N draw the same responses
(theirs: each rank's global torch stream); `[PAD]` and the ids past `len(tokenizer)` are never sampled; statistics
cover real tokens of the global batch (their `objective/entropy` counted -1 per position after the EOS, `num_eos_tokens`
counted rank 0's EOS tokens, junk after the first included); one step per batch is the only choice (their
`num_ppo_epochs` / `num_mini_batches` allowed more). The loss normalisation is theirs in effect: their
mean per micro-batch, averaged by accelerate, is the global mean, every micro-batch holding as many pairs.
Per update it logs PPO's `objective/` metrics (`objective/validation_score` on new held-out posts each
update), `online_dpo/loss`, `online_dpo/accuracy` (the implicit reward beta (log pi - log ref) of the
chosen above the rejected's, before the step), `online_dpo/{chosen,rejected}_rewards` and
`online_dpo/score_margin` (the reward model's chosen minus rejected). `--run_eval` writes PPO's tables.
Only the policy is saved: a plain causal LM plus tokenizer (LoRA: merged, the adapter in `adapter/`).

Carried out by the shared loaders (`infra/`), as in the paper's code: a dedicated `[PAD]` token (never EOS),
dropout off in every model, the reward read at the response's EOS (the reward model's `config.pad_token_id`
is `[PAD]`), and each process seeded with seed + rank x 100003.
"""

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
import torch.nn.functional as F
import tyro
from torch.utils.data import DataLoader

from summarize_from_feedback_details import packing
from summarize_from_feedback_details.evaluation import ValidationQueries, final_evaluation, validate
from summarize_from_feedback_details.infra.checkpoints import Resumable
from summarize_from_feedback_details.infra.flags import EngineArgs, RunArgs, parse_args
from summarize_from_feedback_details.infra.launch import make_optimizer, start_run
from summarize_from_feedback_details.infra.loading import (describe_frozen, load_policy, load_policy_reference_reward,
                                                           load_split_dataset, load_tokenizer, prepare_frozen,
                                                           require_splits)
from summarize_from_feedback_details.infra.lora import reference_policy
from summarize_from_feedback_details.infra.tracking import PhaseTimer
from summarize_from_feedback_details.rollout import (RolloutChunks, StalePolicy, compiled_step_for, decode_update,
                                                     staleness_metrics, with_next)


@dataclass
class MethodArgs:
    """online_dpo.py's flags that change what is learned, then (memory and speed) those that change only how the
    work is split and run"""

    # the DPO loss (as dpo.py), and the score of a response without EOS
    beta: float = 0.1
    """inverse temperature of the implicit reward beta * (log pi - log ref) (the Async RLHF code's and TRL's 0.1)"""
    label_smoothing: float = 0.0
    """conservative DPO: the reward model's ranking is taken to be wrong with this probability"""
    loss_type: Literal["dpo", "ipo"] = "dpo"
    """`dpo`: -logsigmoid(beta h) (Rafailov et al. 2023; with --label_smoothing, conservative DPO); `ipo`:
    (h - 1 / (2 beta))^2 (Azar et al. 2023), h the policy's minus the reference's chosen-rejected log-ratio"""
    truncate_token: Literal["eos"] = "eos"
    """responses are cut after their first EOS (the only choice, as in the paper's runs)"""
    penalty_reward_value: float = -1.0
    """the score of a response without EOS (with --non_eos_penalty)"""
    non_eos_penalty: bool = True
    """the EOS trick: a rollout response without EOS scores --penalty_reward_value when the pair is
    ranked (eval is unpenalised)"""

    # seed, models and data
    seed: int = 1
    """global seed: query order, sampling, and each process's seeds (seed + rank * 100003)"""
    base_model: str = "EleutherAI/pythia-1b-deduped"
    """the tokenizer (and the hub repo name with --push_to_hub)"""
    sft_model_path: str = "models/sft_model"
    """policy and reference policy (a causal-LM checkpoint from sft.py)"""
    reward_model_path: str = "models/reward_model"
    """the annotator that picks chosen and rejected (a sequence-classification checkpoint from reward.py)"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """hub name or a local `save_to_disk` folder from tldr_dataset.py (the SFT dataset)"""

    # sampling
    response_length: int = 53
    """tokens sampled per query in rollouts, validation and eval (53 for TL;DR)"""
    temperature: float = 0.7
    """rollout sampling temperature; the policy's and reference's log-probs in the loss are read at it too"""
    eval_temperature: float = 0.01
    """sampling temperature of the validation score and the final eval (the paper's 0.01)"""
    async_steps: int = 0
    """asynchronous RLHF: the pairs of update t are sampled by the policy of update t - N (the first N updates: the
    SFT policy); the DPO loss reads the learner's log-probabilities, as always (docs/async.md)"""

    # optimizer
    lr: float = 3e-6
    """initial learning rate, annealed linearly to lr / num_updates at the last update (as PPO)"""
    eps: float = 1e-5
    """epsilon of Adam(W)'s denominator (the paper's 1e-5; torch's default is 1e-8)"""
    weight_decay: float = 0.01
    """AdamW weight decay (the paper's runs got 0.01 silently from torch's default)"""
    max_grad_norm: Optional[float] = None
    """clip the global gradient norm at this value, the same way with and without DeepSpeed; unset or
    <= 0: no clipping, as the paper's runs (DESIGN section 4)"""
    optimizer: Literal["adamw", "adam"] = "adamw"
    """`adamw`: decoupled weight decay; `adam`: torch's Adam, which adds --weight_decay to the gradient (L2)"""

    # batches, in episodes (a post and one sampled response; each post gives two): batch_size =
    # local_micro_batch_size * gradient_accumulation_steps * world_size (both under memory and speed)
    total_episodes: int = 1_000_000
    """episodes of the whole run (PPO's budget: 1M); num_updates = this // batch_size"""

    # memory and speed: how the work is split and run (each help says what, if anything, it changes)
    local_micro_batch_size: Resumable[int] = 2
    """episodes per forward/backward on each process, an even number: the two samples of a post (the
    chosen and the rejected) go through one forward. A memory knob: the update does not change"""
    gradient_accumulation_steps: Resumable[int] = 32
    """micro-batches per update on each process (one optimizer step per update)"""
    local_rollout_forward_batch_size: int = 32
    """queries per generation chunk (each sampled twice, from two seeded generators) and per reward
    forward (of its 2 x this responses); must divide the local_batch_size / 2 queries of an update.
    Each chunk's sampling noise is seeded by its position in the global batch, so the process count
    does not change the samples, but this knob changes which responses are drawn (not their
    distribution): keep it fixed when comparing runs sample for sample"""
    local_generation_batch_size: Resumable[Optional[int]] = None
    """rows per batched decode: the update's validation chunks and rollout chunks, packed whole in that
    order (default: the validation queries plus one chunk's two samples). A memory knob: each chunk
    samples from its own seeded generator, so it changes no sample"""
    local_eval_batch_size: Resumable[int] = 2
    """queries per process for the per-update validation score and in the final eval"""
    gradient_checkpointing: Resumable[bool] = False
    """recompute the policy's activations in the backward pass: less memory, more compute, the same update"""
    deepspeed: Resumable[bool] = False
    """assert that accelerate runs DeepSpeed (ZeRO-2 for the policy) and give it our batch sizes"""
    offload: Resumable[bool] = False
    """DeepSpeed only: the frozen reference policy and reward model as ZeRO-3 engines with their
    parameters offloaded to CPU"""


@dataclass
class Args(RunArgs, EngineArgs, MethodArgs):
    """Every flag of the stage: MethodArgs' (above), EngineArgs' (infra/flags.py: the rollout engine's and packing's
    memory and speed), RunArgs' (infra/flags.py: naming, checkpoints, tracking, LoRA), then this stage's own plumbing"""

    # this stage's run
    exp_name: Resumable[str] = os.path.basename(__file__)[: -len(".py")]
    """name of the experiment: the start of the run name and, with --push_to_hub, part of the repo name"""
    run_eval: Resumable[bool] = False
    """after training: every validation and test query sampled through the rollout engine at
    `eval_temperature`, scored against the references (evaluation.py), saved as `<split>_table.csv`"""
    print_sample_output_freq: Resumable[int] = 220
    """every this many updates (starting with the first), save the validation samples of the update as
    `samples_<update>.csv` (0: never)"""
    warn: Resumable[list[str]] = field(default_factory=list)
    """early warnings, off unless named (NAME=THRESHOLD each; one printed warning with the update, at the first
    crossing): kl=X objective/kl above X, entropy=X objective/entropy below X, length_change=F the mean response
    length off the first update's by more than the fraction F"""
    output_dir: Resumable[str] = "models/online_dpo_model"
    """where the trained policy goes, with checkpoints/ inside ("" saves nothing)"""

    # filled in at run time, not flags: a value given for one would be overwritten without a word
    world_size: Resumable[tyro.conf.Suppress[Optional[int]]] = None
    """derived: the number of processes"""
    local_batch_size: Resumable[tyro.conf.Suppress[Optional[int]]] = None
    """derived: local_micro_batch_size x gradient_accumulation_steps, episodes per process and update"""
    batch_size: tyro.conf.Suppress[Optional[int]] = None
    """derived: local_batch_size x world_size, episodes per update (the defaults on 8 processes: 512 =
    256 posts x 2 samples, as PPO's)"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """derived: total_episodes // batch_size"""


QUERY_COLUMNS = ("query_token", "reference_response_token")
# sums over this process's pairs and samples (the DPO step's, then the rollout's), reduced over
# processes once per update (online_dpo_metrics)
STAT_NAMES = ("loss", "correct", "chosen_rewards", "rejected_rewards", "logprobs", "kl", "scores", "score_margin",
              "eos", "response_length")


# ---------------------------------------------------------------------------------------------
# helpers (pure functions; tests import them)
# ---------------------------------------------------------------------------------------------


def derive_batch_sizes(args: Args, world_size: int) -> None:
    """Fills the derived batch fields; inexact divisions are errors."""
    for name in ("local_micro_batch_size", "gradient_accumulation_steps", "local_eval_batch_size",
                 "local_rollout_forward_batch_size", "total_episodes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.local_micro_batch_size % 2:
        raise ValueError(f"--local_micro_batch_size {args.local_micro_batch_size} must be even: a micro-batch "
                         "holds both samples of each of its queries")
    args.world_size = world_size
    args.local_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    args.batch_size = args.local_batch_size * world_size
    if args.local_generation_batch_size is None:
        args.local_generation_batch_size = args.local_eval_batch_size + 2 * args.local_rollout_forward_batch_size
    if args.local_generation_batch_size < 1:
        raise ValueError(f"--local_generation_batch_size must be >= 1, got {args.local_generation_batch_size}")
    if (args.local_batch_size // 2) % args.local_rollout_forward_batch_size:
        raise ValueError(f"the {args.local_batch_size // 2} queries of local_batch_size {args.local_batch_size} are "
                         f"not divisible by --local_rollout_forward_batch_size {args.local_rollout_forward_batch_size}")
    args.num_updates = args.total_episodes // args.batch_size
    if args.num_updates < 1:
        raise ValueError(f"total_episodes {args.total_episodes} < batch_size {args.batch_size}: no update possible")


def check_loss_args(args: Args) -> None:
    """Stops on loss settings that cannot work, before any model is loaded."""
    if args.beta <= 0:
        raise ValueError(f"--beta must be > 0, got {args.beta}")
    if not 0 <= args.label_smoothing < 0.5:
        raise ValueError(f"--label_smoothing must be in [0, 0.5), got {args.label_smoothing}")
    if args.loss_type == "ipo" and args.label_smoothing:
        raise ValueError("--label_smoothing does nothing under --loss_type ipo (IPO's loss has no label noise)")


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


def scaled_logits(logits: torch.Tensor, temperature: float, pad_id: int, vocab_end: int) -> torch.Tensor:
    """The sampling distribution's logits: fp32 logits / (T + 1e-7) with `[PAD]` and the ids from `vocab_end`
    (len(tokenizer): rows no token has) impossible, HF's temperature and suppress-tokens processors in
    generation. The lowest float instead of -inf gives the same softmax and keeps the entropy finite."""
    logits = logits.float() / (temperature + 1e-7)
    ids = torch.arange(logits.shape[-1], device=logits.device)
    return logits.masked_fill((ids == pad_id) | (ids >= vocab_end), torch.finfo(logits.dtype).min)


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def response_logits(model, query_responses: torch.Tensor, pad_id: int, response_length: int) -> torch.Tensor:
    """The logits that predict the response tokens, [batch, response_length, vocab]: the LM head
    runs on those positions only (at a 50k vocabulary, the largest matrix of a small model); padding is
    not computed (packed, or with --no_packing the columns every row pads)."""
    query_responses = packing.without_shared_padding(query_responses, pad_id)
    return forward(model, query_responses, pad_id, logits_to_keep=response_length + 1)[:, :-1]


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


def penalize_missing_eos(scores: torch.Tensor, postprocessed_responses: torch.Tensor, eos_id: int,
                         penalty: float) -> torch.Tensor:
    """The EOS trick: a response that never ends gets `penalty` instead of its reward-model score."""
    contain_eos = (postprocessed_responses == eos_id).any(-1)
    return torch.where(contain_eos, scores, torch.full_like(scores, penalty))


def chosen_samples(scores: torch.Tensor) -> torch.Tensor:
    """Which of each query's two samples is chosen (0 or 1), from their scores [queries, 2] (EOS penalty
    applied): the higher one; a tie chooses the first, as the Async RLHF code (`first_half >= second_half`)."""
    return (scores[:, 1] > scores[:, 0]).long()


def response_logprob_sums(model, query_responses: torch.Tensor, responses: torch.Tensor, temperature: float,
                          eos_id: int, pad_id: int, vocab_end: int) -> torch.Tensor:
    """Each row's log-probability of its response under `model` at `temperature` (`scaled_logits`): summed
    over the tokens up to and including the first EOS (every token where there is none), as DPO sums
    over the response and EOS of a preference pair."""
    logits = response_logits(model, query_responses, pad_id, responses.shape[1])
    return masked_sums(gather_logprobs(scaled_logits(logits, temperature, pad_id, vocab_end), responses), responses, eos_id)


def masked_sums(values: torch.Tensor, responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per-token `values` [rows, response_length] summed over each response's real tokens: up to and
    including its first EOS, all of them without one (entries after the EOS are dropped, not
    multiplied by 0). The sequence KL of the samples is masked_sums(logprob - ref_logprob)."""
    eos_index = first_true_indices(responses == eos_id)  # (the row length where there is none)
    after_eos = torch.arange(responses.shape[1], device=responses.device) > eos_index[:, None]
    return values.masked_fill(after_eos, 0).sum(1)


def sigmoid_losses(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """DPO's -logsigmoid(beta h), the ranking wrong with probability `label_smoothing` (conservative DPO)."""
    return -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing


def ipo_losses(h: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO's (h - 1 / (2 beta))^2: h regressed to a finite margin instead of pushed without bound."""
    return (h - 1 / (2 * beta)) ** 2


def preference_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                      ref_rejected: torch.Tensor, loss_type: str, beta: float, label_smoothing: float) -> torch.Tensor:
    """Per-pair losses from summed log-probs, h = (log pi(c) - log pi(r)) - (log ref(c) - log ref(r)), under
    --loss_type; a value without an arm here is refused, not run as another loss."""
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    match loss_type:
        case "dpo":
            return sigmoid_losses(h, beta, label_smoothing)
        case "ipo":
            return ipo_losses(h, beta)
        case _:
            raise ValueError(f"--loss_type {loss_type}: no preference loss for it")


def implicit_rewards(policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's implicit reward of a response, beta * (log pi - log ref): what the policy learned to prefer."""
    return beta * (policy_logprobs - ref_logprobs)


def online_dpo_metrics(accelerator, stats: torch.Tensor, batch_size: int) -> dict:
    """The objective/ and online_dpo/ metrics of an update from this process's sums `stats`
    (STAT_NAMES), reduced over processes: means over the global batch's samples or pairs."""
    stat = dict(zip(STAT_NAMES, accelerator.reduce(stats, "sum").tolist()))
    pairs = batch_size // 2
    return {
        "objective/kl": stat["kl"] / batch_size,  # the mean sequence KL (k1) of the samples to the reference
        "objective/entropy": -stat["logprobs"] / batch_size,  # estimated: -log pi of the sampled tokens, summed
        "objective/scores": stat["scores"] / batch_size,
        "online_dpo/loss": stat["loss"],  # (each pair's share is already divided by the global pairs)
        "online_dpo/accuracy": stat["correct"] / pairs,
        "online_dpo/chosen_rewards": stat["chosen_rewards"] / pairs,
        "online_dpo/rejected_rewards": stat["rejected_rewards"] / pairs,
        "online_dpo/score_margin": stat["score_margin"] / pairs,
        "ppo/val/num_eos_tokens": stat["eos"],  # responses that end (with the EOS), over all processes
        "ppo/val/response_length": stat["response_length"] / batch_size,
    }


# ---------------------------------------------------------------------------------------------
# the run (evaluation.py measures the policy: per-update validation and --run_eval)
# ---------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    dataset = load_split_dataset(args.query_dataset, QUERY_COLUMNS)
    require_splits(dataset, args.query_dataset, ("train", "validation"), "online DPO")
    derive_batch_sizes(args, int(os.environ.get("WORLD_SIZE", "1")))
    check_loss_args(args)
    # a checkpoint continues on any process count, for the same stage, seed and batch arithmetic
    # (and rollout chunk, which fixes where each chunk's sampling noise comes from)
    run = start_run(args, {"stage": "online_dpo", "seed": args.seed, "batch_size": args.batch_size,
                           "total_episodes": args.total_episodes, "num_updates": args.num_updates,
                           "local_rollout_forward_batch_size": args.local_rollout_forward_batch_size},
                    generates=True)
    accelerator, start_update = run.accelerator, run.start_update
    run.print_batch_arithmetic("episodes", f"{args.batch_size // 2} queries x 2 samples",
                               f"{args.loss_type.upper()} loss, beta {args.beta}, label smoothing "
                               f"{args.label_smoothing}", f"offload {args.offload}")

    tokenizer = load_tokenizer(args.base_model, args.query_dataset)
    pad_id, eos_id, vocab_end = tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)
    model, _, ref_policy, reward_model = load_policy_reference_reward(run, tokenizer)
    optimizer = make_optimizer(args, model)

    # One explicit query order for every rank and world size; accelerate hands rank r the local
    # batches r, r + world_size, ..., so the queries of update k are always order[k * Q : (k + 1) * Q]
    # (Q = batch_size / 2). More queries than the split holds: reshuffled passes.
    queries_per_update, local_queries = args.batch_size // 2, args.local_batch_size // 2
    train = dataset["train"].with_format("torch", columns=["query_token"])
    order = epoch_permutations(len(train), -(-args.total_episodes // (2 * len(train))), args.seed)
    order = order[start_update * queries_per_update:]  # a resumed run starts at its first unseen queries
    # its own generator: each iterator over a DataLoader draws a seed from it, which would otherwise
    # come from the global torch stream and shift it in a resumed run (it restores that stream)
    train_loader = DataLoader(train, batch_size=local_queries, sampler=order, drop_last=True,
                              generator=torch.Generator())
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    ref_policy = prepare_frozen(ref_policy, args, accelerator)
    reward_model = prepare_frozen(reward_model, args, accelerator)
    unwrapped = accelerator.unwrap_model(model)
    compiled_step = compiled_step_for(unwrapped, args.compile_decode, accelerator.device, accelerator.native_amp,
                                      run.print, keep_caches=not args.free_decode_cache)
    validation = ValidationQueries(dataset["validation"], QUERY_COLUMNS, args, accelerator)
    stale = StalePolicy(unwrapped, args.async_steps, args.async_worker, args.async_worker_threads)
    checkpoints, logger = run.checkpoints_and_logger(model, optimizer, [stale])
    run.print(f"reference policy: {describe_frozen(ref_policy)}; reward model: {describe_frozen(reward_model)}")
    device = accelerator.device
    temperature, fwd_batch = args.temperature, args.local_rollout_forward_batch_size
    pairs_per_micro = args.local_micro_batch_size // 2  # (a micro-batch holds both samples of its queries)
    ga, num_processes, rank = args.gradient_accumulation_steps, accelerator.num_processes, accelerator.process_index

    # dropout is off in every model; the mode switches gradient checkpointing: eval for rollouts, train for the step
    batches = with_next(iter(train_loader))
    rollout_chunks = RolloutChunks(temperature, args.seed, rank * local_queries, fwd_batch, samples=2)
    start = time.time()
    for update in run.progress(range(start_update + 1, args.num_updates + 1), args.num_updates - start_update,
                               "online_dpo", ("online_dpo/loss", "objective/scores")):
        data, next_data = next(batches)
        timer = PhaseTimer(device)  # time/ and throughput/ metrics: seconds of this update by phase (rank 0's)
        # linear annealing from lr (first update) to lr / num_updates (last update), as PPO
        lr_now = (1.0 - (update - 1.0) / args.num_updates) * args.lr
        for group in optimizer.param_groups:
            group["lr"] = lr_now

        model.eval()
        validation_batch = validation.batch(update, device)  # (new held-out queries every update)
        queries = data["query_token"]

        # ---- generation: the validation chunks, then two samples of every rollout chunk --------
        # (RolloutChunks: a query's two samples are seeded by its global row, on one rank at any process count)
        validation_groups = validation.groups(validation_batch, update, fwd_batch)
        rollout_groups = rollout_chunks.groups(data, update)
        stale.start_update()
        with timer("generation"), accelerator.autocast():
            validation_generated, rollout_generated = decode_update(
                unwrapped, stale, validation_groups, rollout_groups, pad_id, vocab_end, args.response_length,
                args.local_generation_batch_size, compiled_step, rollout_chunks.groups(next_data, update + 1))

        with timer("validation"):  # the current policy's score on the held-out queries
            validation_metrics = validate(run, reward_model, tokenizer, validation_batch, validation_generated, logger,
                                        update)

        # ---- the reward model ranks each query's two samples ----------------------------------
        # rows 2q and 2q + 1 hold query q's samples 0 and 1
        responses, sampled_logprobs = (torch.cat([torch.stack([first, second], 1).flatten(0, 1) for first, second in
                                                  zip(part[::2], part[1::2])]) for part in zip(*rollout_generated))
        repeated_queries = queries.repeat_interleave(2, 0)
        query_responses = torch.cat([repeated_queries, responses], 1)
        postprocessed = truncate_response(responses, eos_id, pad_id)
        with torch.no_grad(), timer("reward_forward"), accelerator.autocast():
            # the reward model scores the EOS-truncated responses at their EOS, a rollout chunk at a time
            scored = torch.cat([repeated_queries, postprocessed], 1)
            scores = torch.cat([get_reward(reward_model, scored[i: i + 2 * fwd_batch], pad_id).float()
                                for i in range(0, 2 * local_queries, 2 * fwd_batch)])
        if args.non_eos_penalty:
            scores = penalize_missing_eos(scores, postprocessed, eos_id, args.penalty_reward_value)
        if not run.all_finite(update, "rollout", scores=scores):
            checkpoints.after_update(update, args.run_name, logger)  # (--on_nonfinite skip: no step on it)
            continue
        chosen = chosen_samples(scores.view(-1, 2))
        chosen_rows = 2 * torch.arange(local_queries, device=device) + chosen
        rejected_rows = 2 * torch.arange(local_queries, device=device) + 1 - chosen
        lengths = (first_true_indices(responses == eos_id) + 1).clamp(max=responses.shape[1])  # (EOS included)
        rollout_stats = torch.stack([scores.sum(), (scores[chosen_rows] - scores[rejected_rows]).sum(),
                                     (responses == eos_id).any(-1).sum(), lengths.sum()]).float()

        # ---- ONE optimizer step on the DPO loss of the batch's pairs --------------------------
        model.train()
        step_stats = torch.zeros(6, device=device)
        learner_sums = torch.zeros(len(responses), device=device)  # (each sample's, before the step)
        for micro_start in range(0, local_queries, pairs_per_micro):
            # chosen then rejected in one forward; the reference reads the same rows in the same shape
            micro = torch.cat([chosen_rows[micro_start: micro_start + pairs_per_micro],
                               rejected_rows[micro_start: micro_start + pairs_per_micro]])
            inputs = (query_responses[micro], responses[micro], temperature, eos_id, pad_id, vocab_end)
            with torch.no_grad(), timer("reference_forward"), accelerator.autocast(), \
                    reference_policy(unwrapped, ref_policy) as reference:
                ref_chosen, ref_rejected = response_logprob_sums(reference, *inputs).chunk(2)
            with timer("training"), accelerator.accumulate(model):
                policy_chosen, policy_rejected = response_logprob_sums(model, *inputs).chunk(2)
                losses = preference_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, args.loss_type,
                                           args.beta, args.label_smoothing)
                # this micro-batch's share of the mean over the global batch of pairs
                loss = losses.sum() / queries_per_update
                # accelerate divides by the accumulation steps and DDP averages over ranks: undo
                # both so the gradient is exactly that of the global-batch mean loss
                accelerator.backward(loss * ga * num_processes)
                run.optimizer_step(model, optimizer, update, loss)  # (clipping; --on_nonfinite)
            with torch.no_grad():
                chosen_rewards = implicit_rewards(policy_chosen, ref_chosen, args.beta)
                rejected_rewards = implicit_rewards(policy_rejected, ref_rejected, args.beta)
                policy_sums = torch.cat([policy_chosen, policy_rejected])
                learner_sums[micro] = policy_sums
                ref_sums = torch.cat([ref_chosen, ref_rejected])
                step_stats += torch.stack([loss, (chosen_rewards > rejected_rewards).sum(), chosen_rewards.sum(),
                                           rejected_rewards.sum(), policy_sums.sum(), (policy_sums - ref_sums).sum()])

        # ---- logging ------------------------------------------------------------------------
        metrics = {
            **online_dpo_metrics(accelerator, torch.cat([step_stats, rollout_stats]), args.batch_size),
            **validation_metrics,
            "ppo/lr": lr_now,
            "ppo/episode": update * args.batch_size,
            "ppo/eps": (update - start_update) * args.batch_size / (time.time() - start),
            # the global batch's query + response positions, and the tokens generated (the validation
            # queries' responses come from the same decodes)
            **timer.metrics(tokens=args.batch_size * query_responses.shape[1], generated_tokens=(
                args.batch_size + args.local_eval_batch_size * num_processes) * responses.shape[1]),
            **(compiled_step.counters() if compiled_step is not None else {}),
            **staleness_metrics(stale, accelerator.gather(learner_sums - masked_sums(sampled_logprobs, responses, eos_id)),
                                unit="sequence"),
        }
        logger.log(metrics, update)
        del responses, query_responses, postprocessed, scores
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        checkpoints.after_update(update, args.run_name, logger)

    model.eval()
    final_evaluation(run, unwrapped, reward_model, tokenizer, dataset, logger)

    # only the policy is saved: a plain causal LM, loadable offline with transformers
    run.save(model, tokenizer, unwrapped, functools.partial(load_policy, args.sft_model_path, tokenizer))
    run.finish(logger)


if __name__ == "__main__":
    main(parse_args(Args))  # tyro.cli, knowing other codebases' flags
