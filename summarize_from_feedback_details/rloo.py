"""RLOO (REINFORCE Leave-One-Out) and GRPO on TL;DR summaries against the reward model of reward.py.

    accelerate launch --config_file deepspeed.yaml summarize_from_feedback_details/rloo.py \\
        --base_model EleutherAI/pythia-1b-deduped --sft_model_path models/sft_model \\
        --reward_model_path models/reward_model --deepspeed --run_eval          # 256 queries x 2 = 512 episodes
    python summarize_from_feedback_details/rloo.py --base_model models/tiny/pythia-tiny-s \\
        --sft_model_path <sft.py output> --reward_model_path <reward.py output> --query_dataset data/tldr/sft \\
        --response_length 32 --total_episodes 1920 --local_micro_batch_size 16 --gradient_accumulation_steps 4 \\
        --local_rollout_forward_batch_size 32 --local_eval_batch_size 16 --lr 1e-4    # tiny default, CPU
    ... rloo.py --algorithm grpo --rloo_k 4 [--grpo_loss dr_grpo]                  # GRPO, Dr. GRPO

The harness is PPO's (ppo_left_padding.py, DESIGN section 19): policy and reference from the SFT checkpoint, the reward
model with the EOS trick, rollouts at T=0.7 whose logprobs come from the generation logits, the reference's logprobs
under the same temperature, the global query order, lr 3e-6 annealed linearly, 53 tokens, 512 episodes per update,
minibatches drawn from the global batch. There is no critic. Each update samples every query `--rloo_k` times (each
sample from its own seeded generator) and scores each response once.

`--algorithm rloo` (the default), after Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
Optimization for Learning from Human Feedback in LLMs" (the leave-one-out baseline is Kool et al. 2019, "Buy 4
REINFORCE samples, get a baseline for free!"), as TRL's RLOOTrainer ran it on TL;DR:
- the whole response is one action: reward = score - kl_coef * (sum over response tokens of logprob - ref_logprob), the
  sequence-level k1 KL in the reward (TRL RLOOConfig kl_coef 0.05; its TL;DR recipe 0.03);
- advantage = reward - mean reward of the query's other k-1 samples (k >= 2); rloo_k 2 (TRL's default and TL;DR recipe;
  the paper's best TL;DR result used k=4); whitening over the global batch: `--normalize_advantage` (off, as TRL);
- loss: TRL's PPO-clipped surrogate on the SEQUENCE log-ratio (the sum of the token log-ratios), cliprange 0.2;
  `--token_level_ratio` clips per token (the sequence advantage on every token, token losses summed per response, so at
  ratio 1 the gradient is the same); `--no_clip` is the paper's plain REINFORCE, loss = -advantage * log pi(response);
- 1 epoch, 1 minibatch per batch: the paper's one on-policy REINFORCE step, TRL 1.x's num_iterations=1 (TRL 0.x's
  RLOOConfig defaulted to num_ppo_epochs 4; its TL;DR recipe ran --num_ppo_epochs 2 --num_mini_batches 2 --kl_coef
  0.03: `--noptepochs 2 --nminibatches 2 --kl_coef 0.03` here).

`--algorithm grpo`, after Shao et al. 2024 (DeepSeekMath, "GRPO"): advantage = (r - group mean) / (group std + 1e-4)
with r the raw score (no KL in the reward); the std is the sample std by default (`--grpo_std`: TRL's GRPOTrainer takes
torch's, Bessel-corrected); k >= 2. The ratio is clipped per token; the KL is a loss term, kl_coef x the k3 estimator
exp(ref - logp) - (ref - logp) - 1 per token (Schulman 2020, as DeepSeekMath; its beta was 0.04, here --kl_coef's 0.05
unless given); the loss is averaged over each response's tokens, then over responses (DeepSeekMath's 1/G sum_i 1/|o_i|
sum_t). `--grpo_loss dr_grpo` (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective") drops
both length and std normalisation: token losses summed and divided by the constant minibatch size x response_length,
advantage = r - group mean.

Where this file deliberately differs (PPO's deviations from the paper's code hold here too: global
minibatches, statistics over real tokens only, `[PAD]` and the ids past `len(tokenizer)` never sampled, a
validation score on new queries every update; see ppo_left_padding.py):
- TRL laid a process's episodes out sample-major (its queries repeated k times) and permuted them per process; here
  episode row q * k + j of the global batch is sample j of global query q on any process count, a query's k samples are
  drawn on one process from seeds fixed by (seed, update, place of its chunk in the global batch, j), and advantages
  are computed over the gathered global batch: 1 and N processes give the same update;
- the loss is a mean over the responses of the whole minibatch of all processes, whatever the micro-batch size,
  accumulation and process count; a minibatch's rows train in order, so a query's samples share micro-batches and
  packing computes their query once;
- ratio statistics (ppo/val/ratio, ppo/policy/approxkl_avg, ppo/policy/clipfrac_avg) are means over the unit the ratio
  is taken on: responses with the sequence ratio, real tokens with a per-token one;
- a response without EOS scores -1 (the paper's EOS trick, TRL's old --non_eos_penalty), not TRL 1.x's score - penalty.

Only the policy is saved (`--output_dir`: a plain causal LM and its tokenizer). Under DeepSpeed it trains with ZeRO-2;
the frozen reference and reward model are inference engines (ZeRO-3, on CPU under `--offload`). Carried out by the
shared loaders (`infra/`), as in the paper's code: a dedicated `[PAD]` token (never EOS), dropout off, the reward read
at the response's EOS (`config.pad_token_id` is `[PAD]`), each process seeded with seed + rank x 100003.
"""

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

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
from summarize_from_feedback_details.infra.tracking import PhaseTimer
from summarize_from_feedback_details.rollout import (RolloutChunks, StalePolicy, chunk_batches, compiled_step_for,
                                                     decode_update, derived_seed, staleness_metrics, with_next)


@dataclass
class MethodArgs:
    """rloo.py's flags that change what is learned, then (memory and speed) those that change only how the work
    is split and run"""

    # the algorithm
    algorithm: Literal["rloo", "grpo"] = "rloo"
    """`rloo`: leave-one-out baseline, sequence KL in the reward, clipped sequence ratio (TRL's RLOO); `grpo`:
    group mean/std advantages, per-token clipped ratio, k3 KL in the loss (DeepSeekMath)"""
    rloo_k: int = 2
    """samples per query (TRL's rloo_k / num_generations 2; the RLOO paper's best TL;DR run used 4); a query's
    samples are drawn on one process"""
    kl_coef: float = 0.05
    """KL coefficient: rloo, of the sequence KL subtracted from the score; grpo, of the k3 KL loss term (TRL's
    RLOOConfig kl_coef / beta 0.05)"""
    cliprange: float = 0.2
    """clip range of the ratio in the surrogate loss (TRL's cliprange / epsilon, DeepSeekMath's 0.2)"""
    noptepochs: int = 1
    """optimisation epochs over each batch (1: the RLOO paper's on-policy step, TRL 1.x's num_iterations)"""
    normalize_advantage: bool = False
    """whiten the advantages over the global batch: (A - mean) / (sample std + 1e-8), as TRL's flag"""
    token_level_ratio: bool = False
    """rloo: clip the ratio of each token (sequence advantage on every token) instead of the sequence's"""
    no_clip: bool = False
    """plain REINFORCE: loss -A * log pi (no ratio, no clipping), the RLOO paper's estimator"""
    grpo_std: Literal["sample", "population"] = "sample"
    """grpo: the group std that scales advantages, `sample` (Bessel-corrected, n - 1; torch's and TRL's) or
    `population` (n)"""
    grpo_loss: Literal["grpo", "dr_grpo"] = "grpo"
    """grpo: `grpo` averages each response's token losses, then over responses (DeepSeekMath); `dr_grpo` sums all
    token losses over a constant (minibatch x response_length) and leaves advantages unscaled (Dr. GRPO)"""
    truncate_token: Literal["eos"] = "eos"
    """responses are cut after their first EOS (the only choice, as in the paper's runs)"""
    penalty_reward_value: float = -1.0
    """the score of a response without EOS (with --non_eos_penalty)"""
    non_eos_penalty: bool = True
    """the EOS trick: a rollout response without EOS gets --penalty_reward_value as its score (eval is unpenalised)"""

    # seed, models and data
    seed: int = 1
    """global seed: query order, sampling, minibatches, and each process's seeds (seed + rank * 100003)"""
    base_model: str = "EleutherAI/pythia-1b-deduped"
    """the tokenizer (and the hub repo name with --push_to_hub)"""
    sft_model_path: str = "models/sft_model"
    """policy and reference policy (a causal-LM checkpoint from sft.py)"""
    reward_model_path: str = "models/reward_model"
    """the reward model (a sequence-classification checkpoint from reward.py)"""
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
    """clip the global gradient norm at this value, the same way with and without DeepSpeed; unset or <= 0: no
    clipping (DESIGN section 4)"""
    optimizer: Literal["adamw", "adam"] = "adamw"
    """`adamw`: decoupled weight decay; `adam`: torch's Adam, which adds --weight_decay to the gradient (L2)"""

    # batches, in episodes (query + one sampled response): batch_size = local_micro_batch_size *
    # gradient_accumulation_steps * nminibatches * world_size = queries * rloo_k (the first two under memory and speed)
    total_episodes: int = 1_000_000
    """episodes (query + sampled response) of the whole run, the paper's 1M; num_updates = this // batch_size"""
    nminibatches: int = 1
    """minibatches (optimizer steps) per epoch"""

    # memory and speed: how the work is split and run (each help says what, if anything, it changes)
    local_micro_batch_size: Resumable[int] = 1
    """episodes per forward/backward in the training epochs on each process: a memory knob (the update does not
    change)"""
    gradient_accumulation_steps: Resumable[int] = 64
    """micro-batches per minibatch (one optimizer step per minibatch)"""
    local_rollout_forward_batch_size: int = 32
    """queries per generation / no-grad forward chunk (its k samples in one forward; must divide local_batch_size /
    rloo_k); each chunk is sampled once per sample index j, from a seed fixed by its place in the global batch and
    j: keep it fixed when comparing runs sample for sample"""
    local_generation_batch_size: Resumable[Optional[int]] = None
    """rows per batched decode: the update's validation chunks and rollout chunks (a chunk's k samples in turn),
    packed whole in that order (default: the validation queries plus rloo_k chunks). A memory knob: it changes
    no sample"""
    local_eval_batch_size: Resumable[int] = 2
    """queries per process for the per-update validation score and in the final eval"""
    gradient_checkpointing: Resumable[bool] = False
    """recompute the policy's activations in the backward pass: less memory, more compute, the same update"""
    deepspeed: Resumable[bool] = False
    """assert that accelerate runs DeepSpeed (ZeRO-2 for the policy) and give it our batch sizes"""
    offload: Resumable[bool] = False
    """DeepSpeed only: the frozen reference policy and reward model as ZeRO-3 engines, parameters offloaded to CPU"""


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
    output_dir: Resumable[str] = "models/rloo_model"
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
    """derived: local_batch_size x world_size, episodes per update (512: 256 queries x rloo_k 2)"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """derived: total_episodes // batch_size"""


QUERY_COLUMNS = ("query_token", "reference_response_token")
# per (epoch, minibatch) sums over the training epochs, reduced over processes once per update; `units`: what
# the ratio is taken on (responses for the sequence ratio, real tokens for a per-token one)
STAT_NAMES = ("pg_loss", "kl_loss", "approxkl", "clipfrac", "ratio", "ratio_deviation_sq", "units", "entropy",
              "policy_tokens")


# ---------------------------------------------------------------------------------------------
# helpers (pure functions; tests import them). Those shared with PPO are copies of
# ppo_left_padding.py's, kept identical by tests/test_run_infra.py
# ---------------------------------------------------------------------------------------------


def check_algorithm_flags(args: Args) -> None:
    """Refuses settings that cannot learn or learn something else (rloo_k 1: no other sample to be a baseline;
    --no_clip over several steps per batch: plain REINFORCE has no ratio to correct the later steps' older samples,
    measured: the ratio reached 23,004 at epoch 3) and a flag the chosen algorithm never reads."""
    if args.rloo_k < 2:
        one = "every advantage is 0" if args.algorithm == "grpo" else "the advantage is the raw reward (biased)"
        raise ValueError(f"--rloo_k {args.rloo_k}: {args.algorithm} needs >= 2 samples per query (a sample's baseline "
                         f"is its group's other samples; with one, {one})")
    if args.no_clip and (args.noptepochs > 1 or args.nminibatches > 1):
        raise ValueError(f"--no_clip with --noptepochs {args.noptepochs} --nminibatches {args.nminibatches}: plain "
                         "REINFORCE is on-policy, one step per batch; without a clipped ratio the later steps follow "
                         "an older policy's samples uncorrected. Use --noptepochs 1 --nminibatches 1, or no --no_clip")
    unread = ({"grpo_std": "sample", "grpo_loss": "grpo"} if args.algorithm == "rloo" else {"token_level_ratio": False})
    for name, default in unread.items():
        if getattr(args, name) != default:
            raise ValueError(f"--{name} does nothing under --algorithm {args.algorithm}")


def derive_batch_sizes(args: Args, world_size: int) -> None:
    """Fills the derived batch fields; inexact divisions are errors. A process's episodes are whole
    queries' k samples, so local_batch_size must be a multiple of rloo_k."""
    for name in ("local_micro_batch_size", "gradient_accumulation_steps", "nminibatches", "local_eval_batch_size",
                 "local_rollout_forward_batch_size", "total_episodes", "rloo_k", "noptepochs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    check_algorithm_flags(args)
    args.world_size = world_size
    args.local_mini_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    args.local_batch_size = args.local_mini_batch_size * args.nminibatches
    args.mini_batch_size = args.local_mini_batch_size * world_size
    args.batch_size = args.local_batch_size * world_size
    if args.local_batch_size % args.rloo_k:
        raise ValueError(f"local_batch_size {args.local_batch_size} episodes is not divisible by --rloo_k "
                         f"{args.rloo_k}: a query's samples are drawn on one process")
    if (args.local_batch_size // args.rloo_k) % args.local_rollout_forward_batch_size:
        raise ValueError(f"the {args.local_batch_size // args.rloo_k} queries of a process per update are not "
                         f"divisible by --local_rollout_forward_batch_size {args.local_rollout_forward_batch_size}")
    if args.local_generation_batch_size is None:  # the validation queries and one chunk's k samples
        args.local_generation_batch_size = (args.local_eval_batch_size
                                            + args.rloo_k * args.local_rollout_forward_batch_size)
    if args.local_generation_batch_size < 1:
        raise ValueError(f"--local_generation_batch_size must be >= 1, got {args.local_generation_batch_size}")
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


def query_major(per_chunk: list, k: int) -> torch.Tensor:
    """Rollout chunks, rows sample-major (`chunk_batches`) -> row q * k + j is sample j of query q: after gather_global
    (ranks in order) global row g is sample g % k of query g // k on any process count (minibatch_rows' premise)."""
    return torch.cat([rows.unflatten(0, (k, -1)).transpose(0, 1).flatten(0, 1) for rows in per_chunk])


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k1 estimate of KL(policy || reference) of each response: sum over its real tokens of logprob -
    ref_logprob (TRL's RLOO; PPO's objective/kl)."""
    return torch.where(mask, logprobs - ref_logprobs, torch.zeros_like(logprobs)).sum(1)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference), exp(ref - logp) - (ref - logp) - 1 (Schulman 2020,
    "Approximating KL divergence"): unbiased under the policy's samples and never negative (DeepSeekMath's GRPO).
    Written expm1(d) - d: the same value without exp(d) - 1's cancellation (float32 lost ~all digits of d^2 / 2
    near the reference, where d ~ 1e-3)."""
    delta = ref_logprobs - logprobs
    return torch.expm1(delta) - delta


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """[queries, k] rewards -> each sample's reward minus the mean reward of its query's other k - 1
    samples (Kool et al. 2019; Ahmadian et al. 2024); k = 1 has no other sample: the raw reward."""
    k = rewards.shape[1]
    if k == 1:
        return rewards.clone()
    baseline = (rewards.sum(1, keepdim=True) - rewards) / (k - 1)
    return rewards - baseline


def grpo_advantages(rewards: torch.Tensor, std: str = "sample", scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """[queries, k] rewards -> (r - group mean) / (group std + eps) (DeepSeekMath's outcome supervision; std
    `sample`: Bessel-corrected, `population`: over n); with `scale` False (Dr. GRPO) r - group mean. A group of
    one carries no comparison: 0 (its sample std is undefined)."""
    centred = rewards - rewards.mean(1, keepdim=True)
    if not scale or rewards.shape[1] == 1:
        return centred
    return centred / (rewards.std(1, keepdim=True, correction=1 if std == "sample" else 0) + eps)


def algorithm_advantages(args: Args, scores: torch.Tensor, kl: torch.Tensor, k: int) -> tuple:
    """(rewards, advantages) of the global batch's rows (row q * k + j: sample j of query q) under --algorithm;
    a value without an arm here is refused, not run as another method."""
    match args.algorithm:
        case "rloo":  # the KL is in the reward, the whole response one action
            rewards = scores - args.kl_coef * kl
            return rewards, rloo_advantages(rewards.view(-1, k)).flatten()
        case "grpo":  # the score alone (the KL is a loss term)
            return scores, grpo_advantages(scores.view(-1, k), args.grpo_std, scale=args.grpo_loss == "grpo").flatten()
        case _:
            raise ValueError(f"--algorithm {args.algorithm}: no advantages for it")


def whiten(values: torch.Tensor) -> torch.Tensor:
    """(v - mean) / (sample std + 1e-8) over the whole (global) batch, as TRL's --normalize_advantage."""
    return (values - values.mean()) / (values.std() + 1e-8)


def clipped_surrogate(ratio: torch.Tensor, advantage: torch.Tensor, cliprange: float) -> tuple:
    """max(-A r, -A clip(r, 1 - c, 1 + c)) per ratio unit, and where the clipped term is the larger (PPO's surrogate)."""
    unclipped = -advantage * ratio
    clipped_losses = -advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.max(unclipped, clipped_losses), (clipped_losses > unclipped).float()


def reinforce_losses(logprobs: torch.Tensor, advantage: torch.Tensor) -> torch.Tensor:
    """-A log pi (the RLOO paper's plain REINFORCE): its gradient is the unclipped surrogate's at ratio 1."""
    return -advantage * logprobs


def response_means(token_values: torch.Tensor, mask: torch.Tensor, normaliser) -> torch.Tensor:
    """Each response's sum over its real tokens divided by `normaliser`: its length (DeepSeekMath's 1/|o_i| sum_t), the
    constant response_length (Dr. GRPO), or 1 (a sum: RLOO's per-token ratio)."""
    return torch.where(mask, token_values, torch.zeros_like(token_values)).sum(1) / normaliser


def policy_objective(new_logprobs: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                     advantages: torch.Tensor, mask: torch.Tensor, args: Args) -> tuple:
    """Each response's loss (the caller averages over the minibatch's responses) under --algorithm (the module
    docstring has the formulas), and the ratio's statistics: (losses, kl_losses (GRPO's KL term's part of losses),
    logratio, ratio, clipped, units), the last four per ratio unit: [n] for RLOO's sequence ratio, [n, length] per
    token (GRPO, --token_level_ratio) with `units` the mask (real response tokens)."""
    logratio = torch.where(mask, new_logprobs - logprobs, torch.zeros_like(new_logprobs))
    match args.algorithm:  # (the ratio's unit, what a response's token losses are divided by, the KL term's weight)
        case "rloo":
            per_token, normaliser, kl_coef = args.token_level_ratio, 1, None
        case "grpo":
            per_token, kl_coef = True, args.kl_coef
            normaliser = mask.sum(1) if args.grpo_loss == "grpo" else mask.shape[1]
        case _:
            raise ValueError(f"--algorithm {args.algorithm}: no objective for it")
    if per_token:
        advantage, units = advantages.unsqueeze(1), mask
    else:
        logratio, advantage, units = logratio.sum(1), advantages, torch.ones_like(advantages, dtype=torch.bool)
    ratio = torch.exp(logratio)
    if args.no_clip:
        new = torch.where(mask, new_logprobs, torch.zeros_like(new_logprobs))
        losses, clipped = reinforce_losses(new if per_token else new.sum(1), advantage), torch.zeros_like(ratio)
    else:
        losses, clipped = clipped_surrogate(ratio, advantage, args.cliprange)
    kl_losses = torch.zeros_like(advantages)
    if kl_coef is not None:
        kl_losses = response_means(kl_coef * k3_kl(new_logprobs, ref_logprobs), mask, normaliser)
    if per_token:
        losses = response_means(losses, mask, normaliser) + kl_losses
    return losses, kl_losses, logratio, ratio, clipped, units


def ratio_stats(logratio, ratio, clipped, units, entropy, mask) -> torch.Tensor:
    """Sums of the logged statistics (STAT_NAMES[2:]): the ratio's over its units (its spread as (r - 1)^2: E[r^2] -
    E[r]^2 cancels in float32 near 1), the entropy over real tokens; masked entries dropped, not multiplied by 0."""

    def total(x, keep):
        return torch.where(keep, x, torch.zeros_like(x)).sum()

    return torch.stack([total(0.5 * logratio ** 2, units), total(clipped, units), total(ratio, units),
                        total((ratio - 1) ** 2, units), units.sum().float(), total(entropy, mask), mask.sum().float()])


def rloo_update_metrics(accelerator, stats: torch.Tensor, scores, kl, rewards, advantages, logprobs, padding_mask,
                        contain_eos, sequence_lengths, args: Args, validation_metrics: dict) -> dict:
    """The objective/, ppo/ and rloo/ metrics of an update: the rollout's over the global batch (the tensors are
    gathered), the epochs' from their per-(epoch, minibatch) sums `stats` (STAT_NAMES), reduced over processes.
    PPO's names where the quantity is PPO's; objective/rlhf_reward is score - kl_coef x KL for grpo too."""
    stats = accelerator.reduce(stats, "sum")
    stat = dict(zip(STAT_NAMES, stats.unbind(-1)))
    totals = stats.sum((0, 1))
    non_score_reward = -args.kl_coef * kl
    return {
        "objective/kl": kl.mean().item(),
        # estimated entropy (sum of -logprob of the sampled tokens) over real tokens only
        "objective/entropy": (-logprobs).masked_fill(padding_mask, 0).sum(1).mean().item(),
        "objective/non_score_reward": non_score_reward.mean().item(),
        "objective/rlhf_reward": (scores + non_score_reward).mean().item(),
        "objective/scores": scores.mean().item(),
        **validation_metrics,
        "ppo/policy/approxkl_avg": (stat["approxkl"] / stat["units"]).mean().item(),
        "ppo/policy/clipfrac_avg": (stat["clipfrac"] / stat["units"]).mean().item(),
        "ppo/loss/policy_avg": stat["pg_loss"].mean().item(),
        "ppo/policy/entropy_avg": (stat["entropy"] / stat["policy_tokens"]).mean().item(),
        "ppo/val/ratio": (stat["ratio"] / stat["units"]).mean().item(),
        "ppo/val/ratio_var": (totals[5] / totals[6] - (totals[4] / totals[6] - 1) ** 2).item(),
        # the sanity check of the N+ paper: before any step the ratio is 1 and approxkl 0
        "ppo/val/ratio_first_minibatch": (stat["ratio"][0, 0] / stat["units"][0, 0]).item(),
        "ppo/policy/approxkl_first_minibatch": (stat["approxkl"][0, 0] / stat["units"][0, 0]).item(),
        "ppo/policy/clipfrac_first_minibatch": (stat["clipfrac"][0, 0] / stat["units"][0, 0]).item(),
        "ppo/val/num_eos_tokens": contain_eos.long().sum().item(),
        "ppo/val/response_length": (sequence_lengths + 1).float().mean().item(),
        "rloo/loss/kl_avg": stat["kl_loss"].mean().item(),  # (grpo's k3 term; 0 for rloo)
        "rloo/reward_mean": rewards.mean().item(),  # the reward the advantages come from
        # spread of the rewards among a query's samples (population std): 0 leaves nothing to learn
        "rloo/reward_std_within_query": rewards.view(-1, args.rloo_k).std(1, correction=0).mean().item(),
        "rloo/advantage_mean": advantages.mean().item(),
        "rloo/advantage_std": advantages.std(correction=0).item(),
        "rloo/advantage_abs_max": advantages.abs().max().item(),
    }


# ---------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    dataset = load_split_dataset(args.query_dataset, QUERY_COLUMNS)
    require_splits(dataset, args.query_dataset, ("train", "validation"), "rloo.py")
    derive_batch_sizes(args, int(os.environ.get("WORLD_SIZE", "1")))
    # a checkpoint continues on any process count, for the same stage, seed and batch arithmetic
    # (and rollout chunk, which fixes where each chunk's sampling noise comes from)
    run = start_run(args, {"stage": "rloo", "seed": args.seed, "batch_size": args.batch_size,
                           "mini_batch_size": args.mini_batch_size, "total_episodes": args.total_episodes,
                           "num_updates": args.num_updates, "rloo_k": args.rloo_k,
                           "local_rollout_forward_batch_size": args.local_rollout_forward_batch_size},
                    generates=True)
    accelerator, start_update = run.accelerator, run.start_update
    k = args.rloo_k
    queries_per_update, local_queries = args.batch_size // k, args.local_batch_size // k
    run.print_batch_arithmetic("episodes", f"{queries_per_update} queries x rloo_k {k}", f"algorithm {args.algorithm}",
                               f"offload {args.offload}")

    tokenizer = load_tokenizer(args.base_model, args.query_dataset)
    pad_id, eos_id, vocab_end = tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)
    policy, _, ref_policy, reward_model = load_policy_reference_reward(run, tokenizer)
    optimizer = make_optimizer(args, policy)

    # One explicit query order for every rank and world size; accelerate hands rank r the local
    # batches r, r + world_size, ..., so the global batch of queries of update u is
    # order[(u - 1) * queries_per_update : u * queries_per_update]. More queries than the split: reshuffled passes.
    train = dataset["train"].with_format("torch", columns=["query_token"])
    order = epoch_permutations(len(train), -(-args.num_updates * queries_per_update // len(train)), args.seed)
    order = order[start_update * queries_per_update:]  # a resumed run starts at its first unseen global batch
    # (its own generator: see ppo_left_padding.py, a resumed run must not shift the global torch stream)
    train_loader = DataLoader(train, batch_size=local_queries, sampler=order, drop_last=True,
                              generator=torch.Generator())
    model, optimizer, train_loader = accelerator.prepare(policy, optimizer, train_loader)
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
    temperature, fwd_batch, length = args.temperature, args.local_rollout_forward_batch_size, args.response_length
    ga, num_processes, rank = args.gradient_accumulation_steps, accelerator.num_processes, accelerator.process_index

    # dropout is off; eval for rollouts (train mode's gradient checkpointing drops the KV cache), train for epochs
    batches = with_next(iter(train_loader))
    rollout_chunks = RolloutChunks(temperature, args.seed, rank * local_queries, fwd_batch, samples=k)
    start = time.time()
    for update in run.progress(range(start_update + 1, args.num_updates + 1), args.num_updates - start_update,
                               args.algorithm, ("objective/scores", "objective/kl")):
        data, next_data = next(batches)
        timer = PhaseTimer(device)  # time/ and throughput/ metrics: seconds of this update by phase (rank 0's)
        # linear annealing from lr (first update) to lr / num_updates (last update), as the paper's PPO
        lr_now = (1.0 - (update - 1.0) / args.num_updates) * args.lr
        for group in optimizer.param_groups:
            group["lr"] = lr_now

        model.eval()
        validation_batch = validation.batch(update, device)  # (new held-out queries every update)
        queries = data["query_token"]

        # ---- generation: each query chunk k times, sample j from a seed of (update, chunk's global row, j)
        validation_groups = validation.groups(validation_batch, update, fwd_batch)
        rollout_groups = rollout_chunks.groups(data, update)
        stale.start_update()
        with timer("generation"), accelerator.autocast():
            validation_generated, rollout_generated = decode_update(
                unwrapped, stale, validation_groups, rollout_groups, pad_id, vocab_end, length,
                args.local_generation_batch_size, compiled_step, rollout_chunks.groups(next_data, update + 1))

        with timer("validation"):  # the current policy's score on the held-out queries
            validation_metrics = validate(run, reward_model, tokenizer, validation_batch, validation_generated, logger,
                                        update)

        # ---- rollout scoring and advantages ---------------------------------------------------
        with torch.no_grad():
            chunks = []
            for chunk_queries, response, logprob in chunk_batches(rollout_groups, rollout_generated, k):
                query_response = torch.cat([chunk_queries, response], 1)
                sampled_logprob = logprob
                if stale.staleness():
                    with timer("learner_forward"), accelerator.autocast():
                        logprob = learner_logprobs(unwrapped, query_response, response, temperature, pad_id, vocab_end)
                with timer("reference_forward"), accelerator.autocast():
                    # the reference sees the raw response, with the same temperature scaling
                    with reference_policy(unwrapped, ref_policy) as reference:
                        ref_logits = response_logits(reference, query_response, pad_id, length)
                    ref_logprob = gather_logprobs(scaled_logits(ref_logits, temperature, pad_id, vocab_end), response)
                    del ref_logits
                with timer("reward_forward"), accelerator.autocast():
                    # the reward model scores the EOS-truncated response at its EOS
                    postprocessed = truncate_response(response, eos_id, pad_id)
                    score = get_reward(reward_model, torch.cat([chunk_queries, postprocessed], 1), pad_id).float()
                chunks.append((response, logprob, ref_logprob, score, logprob - sampled_logprob))
            with timer("advantages"):
                # row q * k + j: sample j of query q
                responses, logprobs, ref_logprobs, scores, log_ratios = (query_major(list(x), k) for x in zip(*chunks))
                query_responses = torch.cat([queries.repeat_interleave(k, 0), responses], 1)
                postprocessed_responses = truncate_response(responses, eos_id, pad_id)
                contain_eos = (postprocessed_responses == eos_id).any(-1)
                if args.non_eos_penalty:
                    scores = penalize_missing_eos(scores, postprocessed_responses, eos_id, args.penalty_reward_value)
                sequence_lengths, padding_mask, _ = response_masks(postprocessed_responses, pad_id)
                # the global batch on every process: advantages over whole groups, minibatches from all of it
                (query_responses, responses, logprobs, ref_logprobs, padding_mask, scores, contain_eos,
                 sequence_lengths, log_ratios) = gather_global(accelerator, query_responses, responses, logprobs,
                                                               ref_logprobs, padding_mask, scores, contain_eos,
                                                               sequence_lengths, log_ratios)
                kl = sequence_kl(logprobs, ref_logprobs, ~padding_mask)
                rewards, advantages = algorithm_advantages(args, scores, kl, k)
                if args.normalize_advantage:
                    advantages = whiten(advantages)

        if not run.all_finite(update, "rollout", scores=scores, kl=kl, advantages=advantages):
            checkpoints.after_update(update, args.run_name, logger)  # (--on_nonfinite skip: no training on it)
            continue

        # ---- training epochs ---------------------------------------------------------------
        model.train()
        with timer("ppo_epochs"):
            stats = torch.zeros(args.noptepochs, args.nminibatches, len(STAT_NAMES), device=device)
            for epoch in range(args.noptepochs):
                for minibatch, mb_indices in enumerate(minibatch_rows(args.seed, update, epoch, args.batch_size,
                                                                      args.nminibatches, rank, num_processes)):
                    for micro_start in range(0, args.local_mini_batch_size, args.local_micro_batch_size):
                        micro = mb_indices.sort().values[micro_start: micro_start + args.local_micro_batch_size]
                        mask = ~padding_mask[micro]
                        with accelerator.accumulate(model):
                            new_logits = scaled_logits(response_logits(model, query_responses[micro], pad_id, length),
                                                       temperature, pad_id, vocab_end)
                            new_logprobs = gather_logprobs(new_logits, responses[micro])
                            losses, kl_losses, logratio, ratio, clipped, units = policy_objective(
                                new_logprobs, logprobs[micro], ref_logprobs[micro], advantages[micro], mask, args)
                            # this micro-batch's share of the mean over the global minibatch's responses
                            loss = losses.sum() / args.mini_batch_size
                            # accelerate divides by the accumulation steps and DDP averages over ranks:
                            # undo both so the gradient is exactly that of the minibatch objective
                            accelerator.backward(loss * ga * num_processes)
                            run.optimizer_step(model, optimizer, update, loss)  # (clipping; --on_nonfinite)
                        with torch.no_grad():
                            kl_loss = kl_losses.sum() / args.mini_batch_size
                            stats[epoch, minibatch] += torch.cat([
                                torch.stack([loss.detach() - kl_loss, kl_loss]),
                                ratio_stats(logratio, ratio, clipped, units, entropy_from_logits(new_logits), mask)])
                        del new_logits
                s = stats[epoch].sum(0)  # this epoch, this process
                run.print(f"update {update} epoch {epoch}: approxkl {s[2] / s[6]:.3e} "
                          f"clipfrac {s[3] / s[6]:.4f} ratio {s[4] / s[6]:.6f}", highlight=False)

        # ---- logging ------------------------------------------------------------------------
        with torch.no_grad():
            metrics = {
                **rloo_update_metrics(accelerator, stats, scores, kl, rewards, advantages, logprobs, padding_mask,
                                      contain_eos, sequence_lengths, args, validation_metrics),
                "ppo/lr": lr_now, "ppo/episode": update * args.batch_size,
                "ppo/eps": (update - start_update) * args.batch_size / (time.time() - start),
                # the global batch's query + response positions, and the tokens generated (the validation
                # queries' responses come from the same decodes)
                **timer.metrics(tokens=args.batch_size * query_responses.shape[1], generated_tokens=(
                    args.batch_size + args.local_eval_batch_size * num_processes) * length),
                **(compiled_step.counters() if compiled_step is not None else {}),
                **staleness_metrics(stale, log_ratios, ~padding_mask),
            }
        logger.log(metrics, update)
        del responses, logprobs, ref_logprobs, scores, query_responses, postprocessed_responses, rewards, advantages, kl
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
