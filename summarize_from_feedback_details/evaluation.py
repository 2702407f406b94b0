"""How every online method is evaluated, in one place (DESIGN section 1): one yardstick for PPO,
RLOO, GRPO and online DPO, as they already share one rollout engine. What a method learns stays in
its stage file; how its policy is measured lives here.

- `ValidationQueries`: which held-out validation queries each update scores, on each process.
- `validate`: each update, the policy's responses to that update's held-out validation queries
  (sampled by the stage in the same batched decode as its rollouts) scored by the reward model, and on
  synthetic data by the gold judge: the over-optimisation curve's two axes (DESIGN section 20).
- `final_evaluation` (`evaluate_policy` per split): after training (`--run_eval`), every validation
  and test query sampled through the rollout engine at the evaluation temperature, scored against
  the reference summaries.
- `reward_scores` / `table_reward_scores`: a reward model's score of a saved table's text, read where the
  stages read it (hello_world's report and eval/ score every policy's table through it);
- `fact_swap_pairs` / `swap_preferences`: each validation reference against itself with one fact made
  wrong, and how often a scorer puts the reference first (the report's reward-model rows);
  `fact_copy_row` with a causal LM's likelihood as the scorer (eval/fact_copy.py, and tiny_models.py's
  check that a base copies the post's facts); `duration_unit_pairs`: the duration's unit swapped instead
  of its number; `fact_probe_pairs`: both kinds, the pairs hello_world's table and eval/fact_copy.py read
  (`reward_scorer`, `reward_swap_row`: a reward model as the scorer);
- `generation_rows`: the tables of sft.py and dpo.py (no reward model to score with), sampled by the
  same engine from the same seeds, so that SFT, the baseline of every "minus SFT", is sampled as the
  policies compared with it are.

The reward model is read as every stage reads it: at the EOS-truncated response's last real token,
without the EOS penalty (the paper's evaluation). `truncate_response` and `get_reward` are the
stages' own helpers, kept equal to theirs by the identity tests (tests/test_run_infra.py lists them).
"""

import random

import numpy as np
import pandas as pd
import torch
from accelerate.utils import gather_object
from torch.utils.data import DataLoader

from summarize_from_feedback_details import packing
from summarize_from_feedback_details.gold_judge import (FACT_SWAP_SLOTS, gold_validation_metrics, swap_duration_unit,
                                                        swap_fact)
from summarize_from_feedback_details.rollout import SamplingGroup, decode, derived_seed

# the slots of fact_probe_pairs: FACT_SWAP_SLOTS with the duration's unit beside its number
PROBE_SLOTS = ("relation", "problem", "ask", "duration", "duration_unit", "feeling")

EVAL_COLUMNS = ["query_token", "reference_response_token"]
# contain_eos: whether the policy ended the response (a response without an EOS ran out of tokens, and
# the reward model reads it at its last token), so that a reader of the text scores what was scored
TABLE_COLUMNS = ["query", "postprocessed_response", "reference_responses", "scores", "reference_scores",
                 "contain_eos"]
# the table of a policy that no reward model scores (sft.py, dpo.py; eval/ judges it)
GENERATION_COLUMNS = ["query", "postprocessed_response", "reference_responses", "contain_eos"]
# derived_seed's first number after the run's seed: 0 rollouts, 1 per-update validation, 2 minibatch
# permutations (in the stages), 3 the final evaluation
EVAL_STREAM = 3


def cycling_slice(order: list, start: int, size: int) -> list:
    """`size` entries of `order` from `start`, wrapping around: the per-update validation queries
    walk through the whole split instead of repeating its first batch."""
    return [order[(start + i) % len(order)] for i in range(size)]


class ValidationQueries:
    """The online stages' per-update validation queries: global eval batch u is the u-th slice of one
    permutation of `split` seeded by --seed (wrapping), rank r taking its r-th part of
    --local_eval_batch_size, so every update scores new queries and any process count the same ones."""

    def __init__(self, split, columns, args, accelerator):
        self.split = split.with_format("torch", columns=list(columns))
        self.order = torch.randperm(len(split), generator=torch.Generator().manual_seed(args.seed)).tolist()
        self.size, self.seed, self.temperature = args.local_eval_batch_size, args.seed, args.eval_temperature
        self.offset, self.stride = accelerator.process_index * self.size, accelerator.num_processes * self.size

    def batch(self, update: int, device) -> dict:
        """This process's queries of `update` (1-based), on `device`."""
        rows = cycling_slice(self.order, (update - 1) * self.stride + self.offset, self.size)
        return {k: v.to(device) for k, v in self.split[rows].items()}

    def groups(self, batch: dict, update: int, chunk: int) -> list:
        """The sampling groups of `update`'s `batch`: chunks of `chunk` queries at --eval_temperature, each
        chunk's noise seeded by its position in the global eval batch only (any process count samples alike)."""
        return [SamplingGroup(batch["query_token"][i: i + chunk], self.temperature,
                              derived_seed(self.seed, 1, update, self.offset + i)) for i in range(0, self.size, chunk)]


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


@torch.no_grad()
def score_responses(accelerator, reward_model, tokenizer, queries: torch.Tensor, responses: torch.Tensor,
                    references: torch.Tensor) -> tuple:
    """`responses` to `queries` truncated after EOS, their reward-model scores (no EOS penalty, as the
    paper's eval) and the scores of the reference responses; returns (rows, scores, reference_scores)."""
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    responses = truncate_response(responses, eos_id, pad_id)
    with accelerator.autocast():
        scores = get_reward(reward_model, torch.cat([queries, responses], 1), pad_id).float()
        reference_scores = get_reward(reward_model, torch.cat([queries, references], 1), pad_id).float()
    rows = [dict(zip(TABLE_COLUMNS, values)) for values in zip(
        tokenizer.batch_decode(queries, skip_special_tokens=True),
        tokenizer.batch_decode(responses, skip_special_tokens=True),
        tokenizer.batch_decode(references, skip_special_tokens=True),
        scores.tolist(), reference_scores.tolist(), (responses == eos_id).any(-1).tolist(),
    )]
    return rows, scores, reference_scores


def validate(run, reward_model, tokenizer, validation_batch: dict, generated: list, logger, update: int) -> dict:
    """`objective/validation_score`, the reward model's mean score over all processes of the policy's
    responses (`generated`, from the batched decode) to this update's validation queries, and on
    synthetic data the gold judge's `eval/gold/*` of the same responses (the over-optimisation curve:
    proxy and gold side by side); every `print_sample_output_freq` updates they are saved as
    `samples_<update>.csv` (full slices on every rank: nothing to de-duplicate, and no dataloader state
    involved)."""
    sample_rows, scores, _ = score_responses(run.accelerator, reward_model, tokenizer, validation_batch["query_token"],
                                             torch.cat([response for response, _ in generated]),
                                             validation_batch["reference_response_token"])
    rows = gather_object(sample_rows)
    freq = run.args.print_sample_output_freq
    if freq and (update - 1) % freq == 0:
        table = pd.DataFrame(rows)
        logger.table(f"samples_{update}", table)
        run.print(f"update {update}: {table.iloc[0]['postprocessed_response']!r} (score {table.iloc[0]['scores']:.3f})")
    return {"objective/validation_score": run.accelerator.gather(scores).mean().item(), **gold_validation_metrics(rows)}


def final_eval_group(queries: torch.Tensor, temperature: float, seed: int, batch: int, accelerator) -> SamplingGroup:
    """The evaluation dataloader's batch `batch` on this process: accelerate deals a split's batches out
    round-robin, so it is the split's batch `batch * processes + rank`, and its sampling noise comes
    from that place alone (one process and N processes draw the same responses, whatever training
    drew from the global generator before)."""
    place = batch * accelerator.num_processes + accelerator.process_index
    return SamplingGroup(queries, temperature, derived_seed(seed, EVAL_STREAM, place))


def sample_eval_batch(accelerator, policy, tokenizer, queries: torch.Tensor, temperature: float, response_length: int,
                      seed: int, batch_index: int) -> torch.Tensor:
    """The responses to eval batch `batch_index`'s `queries`, sampled through the rollout engine from
    `final_eval_group`'s seed (eagerly: one batch shape per split would cost a CUDA-graph compile each)."""
    group = final_eval_group(queries, temperature, seed, batch_index, accelerator)
    with accelerator.autocast():
        ((responses, _),) = decode(policy, [group], tokenizer.pad_token_id, len(tokenizer), response_length)
    return responses


@torch.no_grad()
def generation_rows(accelerator, policy, tokenizer, batch: dict, temperature: float, response_length: int, seed: int,
                    batch_index: int) -> list:
    """The table rows (GENERATION_COLUMNS) of eval batch `batch_index`: its responses (`sample_eval_batch`),
    truncated after EOS, next to the references; gathered over processes without the duplicates that sharding pads
    the last batch with."""
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    responses = truncate_response(sample_eval_batch(accelerator, policy, tokenizer, batch["query_token"], temperature,
                                                    response_length, seed, batch_index), eos_id, pad_id)
    return accelerator.gather_for_metrics([dict(zip(GENERATION_COLUMNS, values)) for values in zip(
        tokenizer.batch_decode(batch["query_token"], skip_special_tokens=True),
        tokenizer.batch_decode(responses, skip_special_tokens=True),
        tokenizer.batch_decode(batch["reference_response_token"], skip_special_tokens=True),
        (responses == eos_id).any(-1).tolist(),  # (whether the policy ended it: hello_world_report)
    )], use_gather_object=True)


@torch.no_grad()
def reward_scores(reward_model, tokenizer, queries: list, responses: list, contain_eos: list,
                  batch_size: int = 64) -> np.ndarray:
    """The reward model's score of each [query | response], from the tables' text (both policies'
    summaries go through this same path, so their scores compare fairly), read where the stages read
    it: at the EOS of a response the policy ended (`contain_eos`), at the last token of one that ran
    out of tokens (an EOS appended to it would score a summary the policy never finished)."""
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    scores = []
    for start in range(0, len(queries), batch_size):
        end = start + batch_size
        rows = [q + r + [eos_id] * bool(eos) for q, r, eos in zip(
            tokenizer(list(queries[start:end]))["input_ids"],
            tokenizer(list(responses[start:end]), add_special_tokens=False)["input_ids"], contain_eos[start:end])]
        width = max(map(len, rows))
        ids = torch.tensor([row + [pad_id] * (width - len(row)) for row in rows])  # right padding
        scores.append(reward_model(input_ids=ids, attention_mask=ids != pad_id).logits[:, 0])
    # the normalisation of an RMSNorm architecture (reward.py): added here to a model loaded with plain
    # transformers; one loaded by infra.loading.load_reward_model adds it in its forward already
    hooked = getattr(reward_model, "reward_offset_hook", None) is not None
    return torch.cat(scores).numpy() + (0.0 if hooked else getattr(reward_model.config, "reward_offset", 0.0))


def table_reward_scores(reward_model, tokenizer, table: pd.DataFrame) -> np.ndarray:
    """`reward_scores` of a policy's table (a table written before its `contain_eos` column: every
    response scored with an EOS, as this report did then)."""
    contain_eos = list(table["contain_eos"]) if "contain_eos" in table else [True] * len(table)
    return reward_scores(reward_model, tokenizer, list(table["query"]), list(table["postprocessed_response"]),
                         contain_eos)


def evaluate_policy(accelerator, policy, reward_model, tokenizer, dataloader, temperature: float,
                    response_length: int, seed: int) -> tuple:
    """The whole split sampled through the rollout engine at `temperature` (`sample_eval_batch`), scored by the
    reward model, gathered without the duplicates that sharding pads the last batch with. Returns (metrics, table)."""
    rows = []
    for batch_index, batch in enumerate(dataloader):
        responses = sample_eval_batch(accelerator, policy, tokenizer, batch["query_token"], temperature,
                                      response_length, seed, batch_index)
        local_rows, _, _ = score_responses(accelerator, reward_model, tokenizer, batch["query_token"], responses,
                                           batch["reference_response_token"])
        rows += accelerator.gather_for_metrics(local_rows, use_gather_object=True)
    table = pd.DataFrame(rows, columns=TABLE_COLUMNS)
    metrics = {"scores": float(table["scores"].mean()), "reference_scores": float(table["reference_scores"].mean()),
               "rm_win_rate": float((table["scores"] > table["reference_scores"]).mean())}
    return metrics, table


def final_evaluation(run, policy, reward_model, tokenizer, dataset, logger) -> None:
    """`--run_eval` after training: `evaluate_policy` on the validation and test splits (those `dataset` has),
    logged as `eval/<split>/*` at the last update, the tables saved as `<split>_table.csv`."""
    args, accelerator = run.args, run.accelerator
    if not args.run_eval:
        return
    for split in [s for s in ("validation", "test") if s in dataset]:
        loader = accelerator.prepare(DataLoader(dataset[split].with_format("torch", columns=EVAL_COLUMNS),
                                                batch_size=args.local_eval_batch_size))
        metrics, table = evaluate_policy(accelerator, policy, reward_model, tokenizer, run.progress(
            loader, len(loader), f"eval {split}", stoppable=True), args.eval_temperature, args.response_length,
            args.seed)
        logger.log({f"eval/{split}/{key}": value for key, value in metrics.items()}, args.num_updates)
        logger.table(f"{split}_table", table)
        run.print(f"{split}: " + ", ".join(f"{key} {value:.4f}" for key, value in metrics.items()))


def fact_swap_pairs(table: pd.DataFrame, references: int = 1000) -> tuple:
    """(queries, texts, pairs) of the first `references` validation references of a table (SFT's): per
    slot of the synthetic task, [(row, that reference with the slot's fact made wrong)] (`swap_fact`),
    over the references that state the slot. Each swap costs the gold judge 2.5 or more."""
    queries, texts = list(table["query"][:references]), list(table["reference_responses"][:references])
    rng, pairs = random.Random(0), {slot: [] for slot in FACT_SWAP_SLOTS}
    for row, (query, reference) in enumerate(zip(queries, texts)):
        for slot in FACT_SWAP_SLOTS:
            swapped = swap_fact(rng, query, reference, slot)
            if swapped is not None:
                pairs[slot].append((row, swapped))
    return queries, texts, pairs


def duration_unit_pairs(queries: list, texts: list) -> list:
    """[(row, that reference with its duration in the other unit)] over the references (fact_swap_pairs'
    queries and texts) that state the post's duration: the swap that fact_swap_pairs' duration, which
    moves the number, never makes."""
    swaps = [(row, swap_duration_unit(query, text)) for row, (query, text) in enumerate(zip(queries, texts))]
    return [(row, swapped) for row, swapped in swaps if swapped is not None]


def fact_probe_pairs(table: pd.DataFrame, references: int = 1000) -> tuple:
    """fact_swap_pairs with the duration's unit as a sixth slot, `duration_unit` (duration_unit_pairs):
    the pairs a model is read on in hello_world's table and eval/fact_copy.py (PROBE_SLOTS). tiny_models'
    copy check reads fact_swap_pairs alone: the slots it checks are FACT_SWAP_SLOTS'."""
    queries, texts, pairs = fact_swap_pairs(table, references)
    pairs["duration_unit"] = duration_unit_pairs(queries, texts)
    return queries, texts, {slot: pairs[slot] for slot in PROBE_SLOTS}


def swap_preferences(score, queries: list, texts: list, pairs: dict) -> dict:
    """Per slot of `pairs` (fact_swap_pairs): how often score(queries, texts) -> array puts a reference
    above its swap (ties count half), over how many pairs, and the mean margin. Each reference is
    scored once, for every slot it is paired in."""
    reference_scores = np.asarray(score(queries, texts))
    accuracy = {}
    for slot, swaps in pairs.items():
        if swaps:
            rows, swapped = map(list, zip(*swaps))
            right = reference_scores[rows]
            wrong = np.asarray(score([queries[row] for row in rows], swapped))
            accuracy[slot] = {"accuracy": float(np.mean((right > wrong) + 0.5 * (right == wrong))),
                              "pairs": len(rows), "margin": float(np.mean(right - wrong))}
    return accuracy


def pair_ids(tokenizer, query: str, response: str) -> tuple:
    """(query ids, response ids) of a text pair read without padding: the query encoded as the datasets encode it
    (a BOS where the tokenizer prepends one), the response without special tokens."""
    return tokenizer(query)["input_ids"], tokenizer(response, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def response_logprobs(model, tokenizer, queries: list, responses: list) -> np.ndarray:
    """log p(response | query) per pair, summed over the response's tokens, one pair per forward (no
    padding; pair_ids' encoding)."""
    sums = []
    for query, response in zip(queries, responses):
        query_ids, response_ids = pair_ids(tokenizer, query, response)
        logits = model(torch.tensor([query_ids + response_ids])).logits[0, len(query_ids) - 1:-1].float()
        sums.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(response_ids)[:, None]).sum().item())
    return np.array(sums)


def swap_row(score, queries: list, texts: list, pairs: dict, slots: tuple = FACT_SWAP_SLOTS) -> dict:
    """{<slot>: accuracy, <slot>_margin: mean margin} of one scorer (swap_preferences) over `pairs`, for
    each of `slots`: NaN where `pairs` has none."""
    accuracy = swap_preferences(score, queries, texts, pairs)
    row = {}
    for slot in slots:
        entry = accuracy.get(slot, {"accuracy": float("nan"), "margin": float("nan")})
        row[slot], row[f"{slot}_margin"] = entry["accuracy"], entry["margin"]
    return row


def fact_copy_row(model, tokenizer, queries: list, texts: list, pairs: dict, slots: tuple = FACT_SWAP_SLOTS) -> dict:
    """swap_row of one causal LM's log-likelihood margin over fact_swap_pairs or fact_probe_pairs."""
    return swap_row(lambda qs, ts: response_logprobs(model, tokenizer, qs, ts), queries, texts, pairs, slots)


def reward_scorer(reward_model, tokenizer):
    """score(queries, texts) -> array of one reward model, each text read as ended (reward_scores): the
    scorer swap_preferences takes; a saved reward offset shifts both sides of a pair alike."""
    return lambda queries, texts: reward_scores(reward_model, tokenizer, queries, texts, [True] * len(texts))


def reward_swap_row(reward_model, tokenizer, queries: list, texts: list, pairs: dict,
                    slots: tuple = FACT_SWAP_SLOTS) -> dict:
    """swap_row of one reward model's score margin (reward_scorer) over the same pairs."""
    return swap_row(reward_scorer(reward_model, tokenizer), queries, texts, pairs, slots)
