"""HF generate as the tests' reference sampler: the rollout engine's contract is "what HF generate samples for each
group under its seed" (tests/test_ppo.py, tests/test_vocab_mask.py check it; no stage samples through HF generate).
Moved here from sft.py, which sampled its evaluation this way before it went through the engine."""

import contextlib

import torch
from transformers import GenerationConfig


def generation_config(response_length: int, temperature: float, pad_id: int, vocab_end: int, rows: int):
    """Exactly `response_length` new tokens: no EOS/pad stopping, no top-k/top-p; `[PAD]` and the ids from
    `vocab_end` (len(tokenizer)) to the embedding's `rows`, which no token has, are never sampled."""
    return GenerationConfig(
        max_new_tokens=response_length, min_new_tokens=response_length, temperature=temperature + 1e-7,
        top_k=0, top_p=1.0, do_sample=True, eos_token_id=None, pad_token_id=None, bos_token_id=None,
        suppress_tokens=[pad_id, *range(vocab_end, rows)],
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
