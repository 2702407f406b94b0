"""PPO on TL;DR summaries against the reward model of reward.py (stage 3 of the paper's pipeline).

    accelerate launch --config_file deepspeed.yaml summarize_from_feedback_details/ppo_left_padding.py \\
        --base_model EleutherAI/pythia-1b-deduped --sft_model_path models/sft_model \\
        --reward_model_path models/reward_model --deepspeed --run_eval          # the paper: 512 x 1953 updates
    python summarize_from_feedback_details/ppo_left_padding.py --base_model models/tiny/pythia-tiny-s \\
        --sft_model_path <sft.py output> --reward_model_path <reward.py output> --query_dataset data/tldr/sft \\
        --response_length 32 --total_episodes 1920 --local_micro_batch_size 16 --gradient_accumulation_steps 4 \\
        --local_rollout_forward_batch_size 64 --local_eval_batch_size 16 --lr 1e-4    # tiny default, CPU

This is the algorithm the paper released (its `ppo.py`, DESIGN section 9): policy and reference from
the SFT checkpoint, critic (head included) and reward model from the reward-model checkpoint, one
AdamW over policy + critic. Each update: rollouts at T=0.7 whose logprobs come from the generation
logits, the reference's logprobs with the same temperature, the EOS trick (-1 for a response without
EOS), INVALID_LOGPROB after the EOS, a per-token k1 KL penalty with the score at EOS+1, GAE
(gamma 1, lambda 0.95), whitened advantages, then 4 epochs of clipped policy and value losses.

Where this file deliberately differs from the paper's code (N_PLUS_DETAILS section 13; the paper's
behaviour stays reachable where it changes results):
- advantage (and optional reward) whitening is global across processes (`--ppo.whiten_per_rank`
  gives the paper's per-rank statistics);
- the losses are token means over the whole minibatch of all processes, so micro-batch size,
  accumulation and process count do not change the update (`--ppo.loss_normalization micro_batch`
  gives the paper's token mean per micro-batch, averaged over micro-batches and processes);
- every logged statistic is computed over real tokens only (the paper averaged several over the
  padding after EOS, and `objective/entropy` counted -1 per padded position);
- the per-update validation score walks through the whole validation split instead of scoring the
  same first batch every update;
- the sampling noise of each generation chunk (`local_rollout_forward_batch_size` queries, rollout
  and validation) is seeded from (seed, update, position in the global batch), so one process and
  N processes with the same global batch draw the same responses;
- each PPO epoch permutes the global batch from (seed, update, epoch) and every process trains on
  its share of each minibatch (the paper permuted each rank's own rollouts with the rank's numpy
  stream, so with --nminibatches > 1 a minibatch held other rows on another process count);
- `[PAD]` and the ids past `len(tokenizer)` (rows no token has, which RL can make likely: NeMo-RL#237) are never
  sampled: masked in generation and, identically, in every logprob forward, so ratio and KL are the sampler's.

Only the policy is saved (`--output_dir`): a plain causal LM plus tokenizer. With DeepSpeed, policy
+ critic train under the accelerate config (ZeRO-2); the frozen reference and reward model become
DeepSpeed inference engines, ZeRO-3 with parameters offloaded to CPU under `--offload` (also on CPU).

Carried out by the shared loaders (`infra/`), as in the paper's code: a dedicated `[PAD]` token (never EOS),
dropout off in all four models, the reward read at the response's EOS (the reward model's `config.pad_token_id`
is `[PAD]`), and each process seeded with seed + rank x 100003.
"""

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch
import tyro
from torch.utils.data import DataLoader

from summarize_from_feedback_details import packing
from summarize_from_feedback_details.evaluation import ValidationQueries, final_evaluation, validate
from summarize_from_feedback_details.infra.checkpoints import Resumable
from summarize_from_feedback_details.infra.flags import EngineArgs, RunArgs, parse_args
from summarize_from_feedback_details.infra.launch import gather_global, make_optimizer, start_run
from summarize_from_feedback_details.infra.loading import (describe_frozen, load_policy, load_policy_reference_reward,
                                                           load_split_dataset, load_tokenizer, prepare_frozen,
                                                           require_splits)
from summarize_from_feedback_details.infra.lora import reference_policy
from summarize_from_feedback_details.infra.tracking import PhaseTimer, explained_variance
from summarize_from_feedback_details.rollout import (RolloutChunks, StalePolicy, compiled_step_for, decode_update,
                                                     derived_seed, staleness_metrics, with_next)


@dataclass
class PpoHParams:
    noptepochs: int = 4
    """PPO epochs over each rollout batch"""
    vf_coef: float = 0.1
    """weight of the value loss in the joint loss of policy and critic"""
    cliprange: float = 0.2
    """clip range of the policy ratio in the surrogate loss"""
    cliprange_value: float = 0.2
    """clip range of the new values around the rollout's values in the value loss"""
    vf_lr: Optional[float] = None
    """the critic's learning rate, annealed as the policy's (None: --lr, the paper's one rate for both)"""
    critic_warmup_updates: int = 0
    """first updates that train the critic alone, on rollouts of the unchanged policy (0: the paper)"""
    gamma: float = 1.0
    """discount factor of the returns and GAE (1: none)"""
    lam: float = 0.95
    """GAE lambda"""
    whiten_rewards: bool = False
    """whiten the per-token rewards (masked, mean kept) before GAE; off in the released runs"""
    kl_coef: float = 0.05
    """coefficient of the per-token KL penalty (the initial value with --ppo.use_adaptive_kl)"""
    use_adaptive_kl: bool = False
    """adapt kl_coef towards `target` (the controller of the paper's ppo_left_padding.py; off in its runs)"""
    target: float = 6.0
    """adaptive KL: target KL per response (nats)"""
    horizon: int = 10000
    """adaptive KL: horizon in episodes"""
    whiten_per_rank: bool = False
    """whiten advantages (and rewards) with each process's own statistics, as the paper's code did;
    by default the statistics cover the global batch, so the process count does not change them"""
    loss_normalization: Literal["minibatch", "micro_batch"] = "minibatch"
    """`minibatch`: policy and value losses are token means over the whole minibatch of all
    processes (split-invariant); `micro_batch`: the paper's token mean per micro-batch, averaged over
    micro-batches and processes (changes with local_micro_batch_size and the process count)"""


@dataclass
class MethodArgs:
    """ppo_left_padding.py's flags that change what is learned, then (memory and speed) those that change only
    how the work is split and run"""

    # the algorithm: --ppo.* (the paper's PPO hyperparameters), and the score of a response without EOS
    ppo: PpoHParams = field(default_factory=PpoHParams)
    truncate_token: Literal["eos"] = "eos"
    """responses are cut after their first EOS (the only choice, as in the paper's runs)"""
    penalty_reward_value: float = -1.0
    """the score of a response without EOS (with --non_eos_penalty)"""
    non_eos_penalty: bool = True
    """the EOS trick: a rollout response without EOS gets --penalty_reward_value as its score (eval is unpenalised)"""
    negative_control: Literal["none", "reward", "reward_and_critic"] = "none"
    """what PPO is denied of the reward model (docs/compare.md): `reward` deals each update's scores to its responses
    at random; `reward_and_critic` also holds the critic's values at 0 (its head 0, frozen): no information at all"""

    # seed, models and data
    seed: int = 1
    """global seed: query order, sampling, minibatches, and each process's seeds (seed + rank * 100003)"""
    base_model: str = "EleutherAI/pythia-1b-deduped"
    """the tokenizer (and the hub repo name with --push_to_hub)"""
    sft_model_path: str = "models/sft_model"
    """policy and reference policy (a causal-LM checkpoint from sft.py)"""
    reward_model_path: str = "models/reward_model"
    """reward model and critic initialisation (a sequence-classification checkpoint from reward.py)"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """hub name or a local `save_to_disk` folder from tldr_dataset.py (the SFT dataset)"""

    # sampling
    response_length: int = 53
    """tokens sampled per query in rollouts, validation and eval (53 for TL;DR)"""
    temperature: float = 0.7
    """rollout sampling temperature; the policy's and reference's logits are divided by it too"""
    eval_temperature: float = 0.01
    """sampling temperature of the validation score and the final eval (the paper's 0.01)"""
    async_steps: int = 0
    """asynchronous RLHF: the rollouts of update t are sampled by the policy of update t - N (the first N updates:
    the SFT policy), their log-probs recomputed by the learner's policy for the ratio and the KL (docs/async.md)"""

    # optimizer
    lr: float = 3e-6
    """initial learning rate, annealed linearly to lr / num_updates at the last update"""
    eps: float = 1e-5
    """epsilon of Adam(W)'s denominator (the paper's 1e-5; torch's default is 1e-8)"""
    weight_decay: float = 0.01
    """AdamW weight decay (the paper's runs got 0.01 silently from torch's default)"""
    max_grad_norm: Optional[float] = None
    """clip the global gradient norm (policy and critic together) at this value, the same way with and
    without DeepSpeed; unset or <= 0: no clipping, which is what the paper's runs did (DESIGN section 4)"""
    optimizer: Literal["adamw", "adam"] = "adamw"
    """`adamw`: decoupled weight decay; `adam`: torch's Adam, which adds --weight_decay to the gradient (L2)"""

    # batches, in episodes (queries): batch_size = local_micro_batch_size * gradient_accumulation_steps *
    # nminibatches * world_size (the first two under memory and speed, below)
    total_episodes: int = 1_000_000
    """episodes (query + sampled response) of the whole run, the paper's 1M; num_updates = this // batch_size"""
    nminibatches: int = 1
    """minibatches (optimizer steps) per PPO epoch"""

    # memory and speed: how the work is split and run (each help says what, if anything, it changes)
    local_micro_batch_size: Resumable[int] = 1
    """episodes per forward/backward in the PPO epochs on each process: a memory knob (with the default
    --ppo.loss_normalization the update does not change)"""
    gradient_accumulation_steps: Resumable[int] = 64
    """micro-batches per minibatch (one optimizer step per minibatch)"""
    local_rollout_forward_batch_size: int = 64
    """queries per generation / no-grad forward chunk in the rollout and the validation score (must
    divide local_batch_size). Each chunk's sampling noise is seeded by its position in the global
    batch, so the process count does not change the samples, but this knob changes which responses
    are drawn (not their distribution): keep it fixed when comparing runs sample for sample"""
    local_generation_batch_size: Resumable[Optional[int]] = None
    """queries per batched decode: the update's validation chunks and rollout chunks, packed whole in
    that order (default: the validation queries plus one rollout chunk). A memory knob: each chunk
    samples from its own seeded generator, so it changes no sample"""
    local_eval_batch_size: Resumable[int] = 2
    """queries per process for the per-update validation score and in the final eval"""
    gradient_checkpointing: Resumable[bool] = False
    """recompute the policy's and critic's activations in the backward pass: less memory, about a third
    more compute in the PPO epochs, the same update"""
    deepspeed: Resumable[bool] = False
    """assert that accelerate runs DeepSpeed (ZeRO-2 for policy + critic) and give it our batch sizes"""
    offload: Resumable[bool] = False
    """DeepSpeed only: the frozen reference policy and reward model as ZeRO-3 engines with their
    parameters offloaded to CPU (the paper did this for 6.9B)"""


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
    output_dir: Resumable[str] = "models/ppo_model"
    """where the trained policy goes ("" saves nothing)"""

    # filled in at run time, not flags: a value given for one would be overwritten without a word
    world_size: Resumable[tyro.conf.Suppress[Optional[int]]] = None
    """derived: the number of processes"""
    local_mini_batch_size: Resumable[tyro.conf.Suppress[Optional[int]]] = None
    """derived: local_micro_batch_size x gradient_accumulation_steps"""
    local_batch_size: Resumable[tyro.conf.Suppress[Optional[int]]] = None
    """derived: local_mini_batch_size x nminibatches, episodes per process and update"""
    mini_batch_size: tyro.conf.Suppress[Optional[int]] = None
    """derived: local_mini_batch_size x world_size"""
    batch_size: tyro.conf.Suppress[Optional[int]] = None
    """derived: local_batch_size x world_size, episodes per update, the paper's 512"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """derived: total_episodes // batch_size"""


QUERY_COLUMNS = ("query_token", "reference_response_token")
# a logprob value for positions after the EOS: policy and reference both get it, so their KL there is 0
INVALID_LOGPROB = 1.0
# per (epoch, minibatch) sums accumulated during the PPO epochs, reduced over processes once per update
STAT_NAMES = ("pg_loss", "vf_loss", "approxkl", "pg_clipfrac", "entropy", "ratio", "ratio_deviation_sq",
              "policy_tokens", "vf_clipfrac", "value_tokens")


# ---- helpers (pure functions; tests import them) -------------------------------------------


def derive_batch_sizes(args: Args, world_size: int) -> None:
    """Fills the derived batch fields; inexact divisions are errors."""
    if args.local_generation_batch_size is None:
        args.local_generation_batch_size = args.local_eval_batch_size + args.local_rollout_forward_batch_size
    for name in ("local_micro_batch_size", "gradient_accumulation_steps", "nminibatches", "local_eval_batch_size",
                 "local_rollout_forward_batch_size", "total_episodes", "local_generation_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.ppo.noptepochs < 1:
        raise ValueError(f"--ppo.noptepochs must be >= 1, got {args.ppo.noptepochs}")
    args.world_size = world_size
    args.local_mini_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    args.local_batch_size = args.local_mini_batch_size * args.nminibatches
    args.mini_batch_size = args.local_mini_batch_size * world_size
    args.batch_size = args.local_batch_size * world_size
    if args.local_batch_size % args.local_rollout_forward_batch_size:
        raise ValueError(f"local_batch_size {args.local_batch_size} is not divisible by "
                         f"--local_rollout_forward_batch_size {args.local_rollout_forward_batch_size}")
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


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, -1)
    return torch.logsumexp(logits, -1) - (probs * logits).sum(-1)


def response_logits(model, query_responses: torch.Tensor, pad_id: int, response_length: int) -> torch.Tensor:
    """The logits that predict the response tokens, [batch, response_length, vocab]: the LM head
    runs on those positions only (at a 50k vocabulary, the largest matrix of a small model); padding is
    not computed (packed, or with --no_packing the columns every row pads)."""
    query_responses = packing.without_shared_padding(query_responses, pad_id)
    return forward(model, query_responses, pad_id, logits_to_keep=response_length + 1)[:, :-1]


def learner_logprobs(policy, query_response: torch.Tensor, response: torch.Tensor, temperature: float, pad_id: int,
                     vocab_end: int) -> torch.Tensor:
    """A stale rollout's log-probs under the learner's policy, which the ratio and the KL read (as mnoukhov/async_rlhf
    src/ppo_single_vllm_trainer.py does): PPO's first ratio is 1, the clip bounds the step from the learner's."""
    logits = response_logits(policy, query_response, pad_id, response.shape[1])
    return gather_logprobs(scaled_logits(logits, temperature, pad_id, vocab_end), response)


def response_values(critic, query_responses: torch.Tensor, pad_id: int, response_length: int) -> torch.Tensor:
    """values[:, t] = V(query + response[:t]), [batch, response_length], without shared padding."""
    query_responses = packing.without_shared_padding(query_responses, pad_id)
    return get_values(critic, query_responses, pad_id)[:, -response_length - 1: -1]


def get_values(critic, query_responses: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The critic's value at every position, shape [batch, length]: the reward model's head applied
    to each hidden state (not only the last). Same padding/position handling as `get_reward`."""
    attention_mask = query_responses != pad_id
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    if packing.is_on(critic):
        return packing.token_scores(critic, query_responses, attention_mask, position_ids)
    hidden = packing.transformer_body(critic)(input_ids=query_responses, attention_mask=attention_mask,
                                              position_ids=position_ids, use_cache=False).last_hidden_state
    return critic.score(hidden).squeeze(-1)


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


def response_masks(postprocessed_responses: torch.Tensor, pad_id: int) -> tuple:
    """(sequence_lengths, padding_mask, padding_mask_p1) of EOS-truncated responses.

    `sequence_lengths` is the index of the EOS, or the last index when there is none (the paper's
    "first pad - 1"). `padding_mask` marks positions strictly after the EOS (no policy loss, KL 0);
    `padding_mask_p1` those after EOS+1 (no value loss): the step after the EOS is where the score
    is paid, and its value is read at the EOS token, where the reward model reads the score."""
    sequence_lengths = first_true_indices(postprocessed_responses == pad_id) - 1
    positions = torch.arange(postprocessed_responses.shape[1], device=postprocessed_responses.device)
    padding_mask = positions.view(1, -1) > sequence_lengths.view(-1, 1)
    padding_mask_p1 = positions.view(1, -1) > (sequence_lengths + 1).view(-1, 1)
    return sequence_lengths, padding_mask, padding_mask_p1


def penalize_missing_eos(scores: torch.Tensor, postprocessed_responses: torch.Tensor, eos_id: int,
                         penalty: float) -> torch.Tensor:
    """The EOS trick: a response that never ends gets `penalty` instead of its reward-model score."""
    contain_eos = (postprocessed_responses == eos_id).any(-1)
    return torch.where(contain_eos, scores, torch.full_like(scores, penalty))


def shuffled_scores(scores: torch.Tensor, seed: int, update: int, accelerator) -> torch.Tensor:
    """The global batch's scores permuted from (seed, 4, update), this process's share (any process count: one deal)."""
    every = accelerator.gather(scores)
    order = torch.randperm(len(every), generator=torch.Generator().manual_seed(derived_seed(seed, 4, update)))
    return every[order.to(every.device)].chunk(accelerator.num_processes)[accelerator.process_index]


def kl_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, scores: torch.Tensor,
               sequence_lengths: torch.Tensor, kl_coef: float) -> tuple:
    """Per-token rewards -kl_coef * (logprob - ref_logprob) (the k1 estimator on the sampled tokens), plus the score at
    EOS+1, or at the EOS when it is the last position (also: no EOS at all). Returns (rewards, kl, non_score_reward)."""
    kl = logprobs - ref_logprobs
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    length = rewards.shape[1]
    end = torch.where(sequence_lengths + 1 < length, sequence_lengths + 1, sequence_lengths)
    rewards[torch.arange(rewards.shape[0], device=rewards.device), end] += scores
    return rewards, kl, non_score_reward


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, reduce=None) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with mean and variance (no Bessel correction, as the paper)
    over the entries where `mask` is True. `reduce` sums a tensor over processes: with it the
    statistics are those of the global batch; without, of this process's entries. With
    `shift_mean=False` the mean is added back (only the scale changes)."""
    reduce = reduce or (lambda t: t)
    mask = mask.to(values.dtype)
    total, count = reduce(torch.stack([(values * mask).sum(), mask.sum()]))
    mean = total / count
    var = reduce(((values - mean) ** 2 * mask).sum()) / count
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def compute_advantages(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple:
    """GAE over all response positions, bootstrapping 0 after the last; returns (advantages, returns)."""
    length = rewards.shape[1]
    lastgaelam = torch.zeros_like(rewards[:, 0])
    advantages_reversed = []
    for t in reversed(range(length)):
        nextvalues = values[:, t + 1] if t < length - 1 else torch.zeros_like(values[:, t])
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], 1)
    return advantages, advantages + values


def clipped_surrogate(ratio: torch.Tensor, advantage: torch.Tensor, cliprange: float) -> tuple:
    """max(-A r, -A clip(r, 1 - c, 1 + c)) per ratio unit, and where the clipped term is the larger (PPO's surrogate)."""
    unclipped = -advantage * ratio
    clipped_losses = -advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.max(unclipped, clipped_losses), (clipped_losses > unclipped).float()


def policy_loss(new_logprobs: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor,
                cliprange: float) -> tuple:
    """The per-token clipped surrogate; returns (losses, clipped, ratio, logratio)."""
    logratio = new_logprobs - logprobs
    ratio = torch.exp(logratio)
    return (*clipped_surrogate(ratio, advantages, cliprange), ratio, logratio)


def value_loss(vpred: torch.Tensor, values: torch.Tensor, returns: torch.Tensor, cliprange_value: float) -> tuple:
    """Per-token clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2); returns (losses, clipped)."""
    vpredclipped = values + torch.clamp(vpred - values, -cliprange_value, cliprange_value)
    vf_losses1, vf_losses2 = (vpred - returns) ** 2, (vpredclipped - returns) ** 2
    return 0.5 * torch.max(vf_losses1, vf_losses2), (vf_losses2 > vf_losses1).float()


def token_stats(logratio, ratio, pg_clipped, entropy, policy_mask, vf_clipped, value_mask) -> torch.Tensor:
    """Sums over real tokens of the logged per-token statistics (STAT_NAMES[2:]); the loss entries
    are filled in by the caller. Masked entries are dropped, not multiplied by 0 (an inf stays out)."""

    def total(x, mask):
        return torch.where(mask, x, torch.zeros_like(x)).sum()

    return torch.stack([
        total(0.5 * logratio ** 2, policy_mask), total(pg_clipped, policy_mask), total(entropy, policy_mask),
        total(ratio, policy_mask), total((ratio - 1) ** 2, policy_mask), policy_mask.sum().float(),
        total(vf_clipped, value_mask), value_mask.sum().float(),
    ])


class AdaptiveKLController:
    """The adaptive KL coefficient of the paper's ppo_left_padding.py (Ziegler et al. 2019):
    kl_coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * episodes / horizon."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:  # (checkpoints keep the coefficient reached)
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def learning_rates(update: int, num_updates: int, lr: float, ppo: PpoHParams) -> tuple:
    """This update's (policy, critic) learning rates, each annealed linearly to 1 / num_updates of its start
    (the critic's: --ppo.vf_lr if set) as the paper. The policy's is 0 in the critic's warm-up, its loss left
    out (Adam's step count runs on, so its first steps after the warm-up are larger than a fresh Adam's)."""
    anneal = 1.0 - (update - 1.0) / num_updates
    policy_lr = 0.0 if update <= ppo.critic_warmup_updates else anneal * lr
    return policy_lr, anneal * (lr if ppo.vf_lr is None else ppo.vf_lr)


def minibatch_rows(seed: int, update: int, epoch: int, batch_size: int, nminibatches: int, rank: int,
                   world_size: int) -> list:
    """The rows of the global batch (rank r's rollouts at r * local_batch_size, ...) that this process
    trains on in each minibatch of `epoch`: a fresh permutation of the global batch drawn from
    (seed, update, epoch) alone, cut into `nminibatches` minibatches, each shared out evenly over the
    processes. One process and N processes train on the same minibatches (the paper's code permuted
    each rank's own rollouts with the rank's numpy stream: with nminibatches > 1 the composition of
    a minibatch depended on the process count)."""
    generator = torch.Generator().manual_seed(derived_seed(seed, 2, update, epoch))
    order = torch.randperm(batch_size, generator=generator)
    mini_batch_size = batch_size // nminibatches
    local = mini_batch_size // world_size
    return [order[m * mini_batch_size + rank * local: m * mini_batch_size + (rank + 1) * local]
            for m in range(nminibatches)]


class PolicyAndValueWrapper(torch.nn.Module):
    """Policy and critic as one module, so that one `accelerator.prepare` (one DDP / DeepSpeed
    engine) and one optimizer cover both."""

    def __init__(self, policy, critic, pad_id: int):
        super().__init__()
        self.policy, self.critic, self.pad_id = policy, critic, pad_id

    def forward(self, query_responses: torch.Tensor, response_length: int) -> tuple:
        """Logits and values at the response positions only."""
        return (response_logits(self.policy, query_responses, self.pad_id, response_length),
                response_values(self.critic, query_responses, self.pad_id, response_length))


def rollout_forwards(model: PolicyAndValueWrapper, ref_policy, reward_model, stale, chunks, timer, accelerator,
                     temperature: float, ids: tuple) -> tuple:
    """The no-grad forwards over the rollout's (group, (response, logprob)) chunks, concatenated: (responses,
    logprobs (the sampler's, or the learner's for stale samples), ref_logprobs, values, scores, log_ratios (learner
    minus sampler: 0 on fresh samples)). `ids`: (pad_id, eos_id, vocab_end)."""
    pad_id, eos_id, vocab_end = ids
    scored = []
    for group, (response, logprob) in chunks:
        query_response = torch.cat([group.queries, response], 1)
        sampled_logprob = logprob
        if stale.staleness():
            with timer("learner_forward"), accelerator.autocast():
                logprob = learner_logprobs(model.policy, query_response, response, temperature, pad_id, vocab_end)
        with timer("reference_forward"), accelerator.autocast():
            # the reference sees the raw response, with the same temperature scaling
            with reference_policy(model.policy, ref_policy) as reference:
                ref_logits = response_logits(reference, query_response, pad_id, response.shape[1])
            ref_logprob = gather_logprobs(scaled_logits(ref_logits, temperature, pad_id, vocab_end), response)
            del ref_logits
        with timer("value_forward"), accelerator.autocast():
            # values[t] = V(query + response[:t]), on the raw response
            value = response_values(model.critic, query_response, pad_id, response.shape[1]).float()
        with timer("reward_forward"), accelerator.autocast():
            # the reward model scores the EOS-truncated response at its EOS
            postprocessed = truncate_response(response, eos_id, pad_id)
            score = get_reward(reward_model, torch.cat([group.queries, postprocessed], 1), pad_id).float()
        scored.append((response, logprob, ref_logprob, value, score, logprob - sampled_logprob))
    return tuple(torch.cat(x) for x in zip(*scored))


def update_metrics(accelerator, stats: torch.Tensor, kl, non_score_reward, scores, logprobs, padding_mask,
                   contain_eos, sequence_lengths, values, returns, padding_mask_p1, validation_metrics: dict) -> dict:
    """An update's objective/ and ppo/ metrics: the rollout's over the global batch's real tokens (gathered; the
    critic's over those it is trained on), the PPO epochs' from their sums `stats` (STAT_NAMES) over processes."""
    stats = accelerator.reduce(stats, "sum")
    stat = dict(zip(STAT_NAMES, stats.unbind(-1)))
    totals = stats.sum((0, 1))
    mean_non_score_reward = non_score_reward.sum(1).mean().item()
    mean_score = scores.mean().item()
    return {
        "objective/kl": kl.sum(1).mean().item(),
        # estimated entropy (sum of -logprob of the sampled tokens) over real tokens only
        "objective/entropy": (-logprobs).masked_fill(padding_mask, 0).sum(1).mean().item(),
        "objective/non_score_reward": mean_non_score_reward,
        "objective/rlhf_reward": mean_non_score_reward + mean_score,
        "objective/score_total": mean_non_score_reward + mean_score,  # (the original's name for it)
        "objective/scores": mean_score,
        **validation_metrics,
        "ppo/policy/approxkl_avg": (stat["approxkl"] / stat["policy_tokens"]).mean().item(),
        "ppo/policy/clipfrac_avg": (stat["pg_clipfrac"] / stat["policy_tokens"]).mean().item(),
        "ppo/loss/policy_avg": stat["pg_loss"].mean().item(),
        "ppo/loss/value_avg": stat["vf_loss"].mean().item(),
        "ppo/val/clipfrac_avg": (stat["vf_clipfrac"] / stat["value_tokens"]).mean().item(),
        "ppo/policy/entropy_avg": (stat["entropy"] / stat["policy_tokens"]).mean().item(),
        "ppo/val/ratio": (stat["ratio"] / stat["policy_tokens"]).mean().item(),
        "ppo/val/explained_variance": explained_variance(values, returns, ~padding_mask_p1),  # (the rollout's)
        # the ratio's variance over all epochs and minibatches, from r - 1 (E[r^2] - E[r]^2 cancels in float32)
        "ppo/val/ratio_var": (totals[6] / totals[7] - (totals[5] / totals[7] - 1) ** 2).item(),
        # the sanity check of the N+ paper: before any step the ratio is 1 and approxkl 0
        "ppo/val/ratio_first_minibatch": (stat["ratio"][0, 0] / stat["policy_tokens"][0, 0]).item(),
        "ppo/policy/approxkl_first_minibatch": (stat["approxkl"][0, 0] / stat["policy_tokens"][0, 0]).item(),
        "ppo/policy/clipfrac_first_minibatch": (stat["pg_clipfrac"][0, 0] / stat["policy_tokens"][0, 0]).item(),
        # responses that end (with the EOS), over all processes (the paper counted the EOS
        # tokens of rank 0's raw responses, junk after the first EOS included)
        "ppo/val/num_eos_tokens": contain_eos.long().sum().item(),
        "ppo/val/response_length": (sequence_lengths + 1).float().mean().item(),
    }


# ---------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    dataset = load_split_dataset(args.query_dataset, QUERY_COLUMNS)
    require_splits(dataset, args.query_dataset, ("train", "validation"), "ppo_left_padding.py")
    derive_batch_sizes(args, int(os.environ.get("WORLD_SIZE", "1")))
    # a checkpoint continues on any process count, for the same stage, seed and batch arithmetic
    # (and rollout chunk, which fixes where each chunk's sampling noise comes from)
    run = start_run(args, {"stage": "ppo_left_padding", "seed": args.seed, "batch_size": args.batch_size,
                           "mini_batch_size": args.mini_batch_size, "total_episodes": args.total_episodes,
                           "num_updates": args.num_updates,
                           "local_rollout_forward_batch_size": args.local_rollout_forward_batch_size}, generates=True)
    accelerator, start_update = run.accelerator, run.start_update
    run.print_batch_arithmetic("episodes", f"whitening {'per rank' if args.ppo.whiten_per_rank else 'global'}",
                               f"loss normalised per {args.ppo.loss_normalization.replace('_', '-')}",
                               f"offload {args.offload}")

    tokenizer = load_tokenizer(args.base_model, args.query_dataset)
    pad_id, eos_id, vocab_end = tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)
    policy, critic, ref_policy, reward_model = load_policy_reference_reward(run, tokenizer, with_critic=True,
                                                                          share_prefixes=False)  # (one sample a query)
    if args.negative_control == "reward_and_critic":  # the critic is a copy of the reward model: values 0
        critic.score.requires_grad_(False).weight.data.zero_()
    model = PolicyAndValueWrapper(policy, critic, pad_id)
    optimizer = make_optimizer(args, model, groups=(model.policy, model.critic))  # (learning_rates sets each)

    # One explicit query order for every rank and world size; accelerate hands rank r the local
    # batches r, r + world_size, ..., so global batch k is always order[k * batch_size : (k + 1) *
    # batch_size] and ranks roll out different queries. More episodes than queries: reshuffled passes.
    train = dataset["train"].with_format("torch", columns=["query_token"])
    order = epoch_permutations(len(train), -(-args.total_episodes // len(train)), args.seed)
    order = order[start_update * args.batch_size:]  # a resumed run starts at its first unseen global batch
    # its own generator: each iterator over a DataLoader draws a seed from it, which would otherwise
    # come from the global torch stream and shift it in a resumed run (it restores that stream)
    train_loader = DataLoader(train, batch_size=args.local_batch_size, sampler=order, drop_last=True,
                              generator=torch.Generator())
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    ref_policy = prepare_frozen(ref_policy, args, accelerator)
    reward_model = prepare_frozen(reward_model, args, accelerator)
    unwrapped = accelerator.unwrap_model(model)
    compiled_step = compiled_step_for(unwrapped.policy, args.compile_decode, accelerator.device, accelerator.native_amp,
                                      run.print, keep_caches=not args.free_decode_cache)
    validation = ValidationQueries(dataset["validation"], QUERY_COLUMNS, args, accelerator)
    kl_ctl = AdaptiveKLController(args.ppo.kl_coef, args.ppo.target, args.ppo.horizon)
    stale = StalePolicy(unwrapped.policy, args.async_steps, args.async_worker, args.async_worker_threads)
    checkpoints, logger = run.checkpoints_and_logger(model, optimizer, [kl_ctl, stale])
    run.print(f"reference policy: {describe_frozen(ref_policy)}; reward model: {describe_frozen(reward_model)}")
    # whitening statistics over the global batch (sums reduced over processes) unless per rank
    reduce = None if args.ppo.whiten_per_rank else (lambda t: accelerator.reduce(t, "sum"))
    device = accelerator.device
    temperature, fwd_batch = args.temperature, args.local_rollout_forward_batch_size
    ga, num_processes, rank = args.gradient_accumulation_steps, accelerator.num_processes, accelerator.process_index

    # Dropout is off in all four models; the mode only switches gradient checkpointing, which in
    # train mode would also switch off generation's KV cache: eval for rollouts, train for the epochs.
    batches = with_next(iter(train_loader))
    rollout_chunks = RolloutChunks(temperature, args.seed, rank * args.local_batch_size, fwd_batch)
    start = time.time()
    for update in run.progress(range(start_update + 1, args.num_updates + 1), args.num_updates - start_update, "ppo",
                               ("objective/scores", "objective/kl")):
        data, next_data = next(batches)
        timer = PhaseTimer(device)  # time/ and throughput/ metrics: seconds of this update by phase (rank 0's)
        policy_lr, critic_lr = learning_rates(update, args.num_updates, args.lr, args.ppo)
        for group, group_lr in zip(optimizer.param_groups, (policy_lr, critic_lr)):
            group["lr"] = group_lr

        model.eval()
        validation_batch = validation.batch(update, device)  # (new held-out queries every update)
        queries = data["query_token"]

        # ---- generation: the validation and rollout chunks in batched decodes ------------------
        validation_groups = validation.groups(validation_batch, update, fwd_batch)
        rollout_groups = rollout_chunks.groups(data, update)
        stale.start_update()
        with timer("generation"), accelerator.autocast():
            validation_generated, rollout_generated = decode_update(
                unwrapped.policy, stale, validation_groups, rollout_groups, pad_id, vocab_end, args.response_length,
                args.local_generation_batch_size, compiled_step, rollout_chunks.groups(next_data, update + 1))

        with timer("validation"):  # the current policy's score on the held-out queries
            validation_metrics = validate(run, reward_model, tokenizer, validation_batch, validation_generated, logger,
                                        update)

        # ---- rollout scoring: the reference's log-probs, the critic's values, the reward model's scores -----
        with torch.no_grad():
            responses, logprobs, ref_logprobs, values, scores, log_ratios = rollout_forwards(
                unwrapped, ref_policy, reward_model, stale, zip(rollout_groups, rollout_generated), timer, accelerator,
                temperature, (pad_id, eos_id, vocab_end))
            with timer("advantages"):
                query_responses = torch.cat([queries, responses], 1)
                postprocessed_responses = truncate_response(responses, eos_id, pad_id)
                contain_eos = (postprocessed_responses == eos_id).any(-1)
                if args.negative_control != "none":  # each score to a random response (the EOS trick reads its own)
                    scores = shuffled_scores(scores, args.seed, update, accelerator)
                if args.non_eos_penalty:
                    scores = penalize_missing_eos(scores, postprocessed_responses, eos_id, args.penalty_reward_value)
                sequence_lengths, padding_mask, padding_mask_p1 = response_masks(postprocessed_responses, pad_id)
                logprobs = logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
                ref_logprobs = ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
                values = values.masked_fill(padding_mask_p1, 0)
                rewards, kl, non_score_reward = kl_rewards(logprobs, ref_logprobs, scores, sequence_lengths,
                                                           kl_ctl.value)
                if args.ppo.whiten_rewards:
                    rewards = masked_whiten(rewards, ~padding_mask_p1, shift_mean=False, reduce=reduce)
                    rewards = rewards.masked_fill(padding_mask_p1, 0)
                advantages, returns = compute_advantages(rewards, values, args.ppo.gamma, args.ppo.lam)
                advantages = masked_whiten(advantages, ~padding_mask, reduce=reduce).masked_fill(padding_mask, 0)
            # the global batch on every process: a minibatch draws from all of it (minibatch_rows)
            (query_responses, responses, logprobs, values, advantages, returns, padding_mask, padding_mask_p1, kl,
             non_score_reward, scores, contain_eos, sequence_lengths, log_ratios) = gather_global(
                accelerator, query_responses, responses, logprobs, values, advantages, returns, padding_mask,
                padding_mask_p1, kl, non_score_reward, scores, contain_eos, sequence_lengths, log_ratios)

        if not run.all_finite(update, "rollout", scores=scores, values=values, advantages=advantages):
            checkpoints.after_update(update, args.run_name, logger)  # (--on_nonfinite skip: no training on it)
            continue

        # ---- PPO epochs -------------------------------------------------------------------
        model.train()
        with timer("ppo_epochs"):
            stats = torch.zeros(args.ppo.noptepochs, args.nminibatches, len(STAT_NAMES), device=device)
            for epoch in range(args.ppo.noptepochs):
                for minibatch, mb_indices in enumerate(minibatch_rows(args.seed, update, epoch, args.batch_size,
                                                                      args.nminibatches, rank, num_processes)):
                    if args.ppo.loss_normalization == "minibatch":
                        # real tokens of the whole global minibatch, known before the first backward
                        policy_tokens, value_tokens = accelerator.reduce(torch.stack([
                            (~padding_mask[mb_indices]).sum(), (~padding_mask_p1[mb_indices]).sum()]).float(), "sum")
                    for micro_start in range(0, args.local_mini_batch_size, args.local_micro_batch_size):
                        micro = mb_indices[micro_start: micro_start + args.local_micro_batch_size]
                        policy_mask, value_mask = ~padding_mask[micro], ~padding_mask_p1[micro]
                        with accelerator.accumulate(model):
                            logits, vpred = model(query_responses[micro], responses.shape[1])
                            new_logits = scaled_logits(logits, temperature, pad_id, vocab_end)
                            del logits
                            new_logprobs = gather_logprobs(new_logits, responses[micro]).masked_fill(
                                padding_mask[micro], INVALID_LOGPROB)
                            vpred = vpred.float().masked_fill(padding_mask_p1[micro], 0)
                            pg_losses, pg_clipped, ratio, logratio = policy_loss(
                                new_logprobs, logprobs[micro], advantages[micro], args.ppo.cliprange)
                            vf_losses, vf_clipped = value_loss(vpred, values[micro], returns[micro],
                                                               args.ppo.cliprange_value)
                            if args.ppo.loss_normalization == "micro_batch":
                                # the paper: a token mean per micro-batch; accelerate and DDP then average
                                # over micro-batches and processes (undone below, so divide here)
                                policy_tokens = policy_mask.sum() * ga * num_processes
                                value_tokens = value_mask.sum() * ga * num_processes
                            # this micro-batch's share of the minibatch objective
                            pg_loss = (pg_losses * policy_mask).sum() / policy_tokens
                            vf_loss = (vf_losses * value_mask).sum() / value_tokens
                            loss = pg_loss * (policy_lr > 0) + args.ppo.vf_coef * vf_loss  # (critic warm-up: 0)
                            # accelerate divides by the accumulation steps and DDP averages over ranks:
                            # undo both so the gradient is exactly that of the minibatch objective
                            accelerator.backward(loss * ga * num_processes)
                            run.optimizer_step(model, optimizer, update, loss)  # (clipping; --on_nonfinite)
                        with torch.no_grad():
                            stats[epoch, minibatch] += torch.cat([
                                torch.stack([pg_loss.detach(), vf_loss.detach()]),
                                token_stats(logratio, ratio, pg_clipped, entropy_from_logits(new_logits), policy_mask,
                                            vf_clipped, value_mask)])
                        del new_logits
                s = stats[epoch].sum(0)  # this epoch, this process
                run.print(f"update {update} epoch {epoch}: approxkl {s[2] / s[7]:.3e} "
                          f"clipfrac {s[3] / s[7]:.4f} ratio {s[5] / s[7]:.6f}", highlight=False)

        # ---- logging ------------------------------------------------------------------------
        with torch.no_grad():
            metrics = {
                **update_metrics(accelerator, stats, kl, non_score_reward, scores, logprobs, padding_mask, contain_eos,
                                 sequence_lengths, values, returns, padding_mask_p1, validation_metrics),
                "ppo/lr": policy_lr, "ppo/vf_lr": critic_lr, "ppo/episode": update * args.batch_size,
                "ppo/eps": (update - start_update) * args.batch_size / (time.time() - start),
                # the global batch's query + response positions, and the tokens generated (the validation
                # queries' responses come from the same decodes)
                **timer.metrics(tokens=args.batch_size * query_responses.shape[1], generated_tokens=(
                    args.batch_size + args.local_eval_batch_size * num_processes) * responses.shape[1]),
                **(compiled_step.counters() if compiled_step is not None else {}),
                **staleness_metrics(stale, log_ratios, ~padding_mask),
            }
            if args.ppo.use_adaptive_kl:
                metrics["objective/kl_coef"] = kl_ctl.value
                kl_ctl.update(metrics["objective/kl"], args.batch_size)
        logger.log(metrics, update)
        del (responses, logprobs, ref_logprobs, values, scores, query_responses, postprocessed_responses, rewards,
             advantages, returns, kl, non_score_reward)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        checkpoints.after_update(update, args.run_name, logger)

    model.eval()
    final_evaluation(run, unwrapped.policy, reward_model, tokenizer, dataset, logger)

    # only the policy is saved: a plain causal LM, loadable offline with transformers
    run.save(model, tokenizer, unwrapped.policy, functools.partial(load_policy, args.sft_model_path, tokenizer),
             prefix="policy.")
    run.finish(logger)


if __name__ == "__main__":
    main(parse_args(Args))  # tyro.cli, knowing other codebases' flags
