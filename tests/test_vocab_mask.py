"""Ids the tokenizer does not have are never sampled and have probability 0 in every logprob (issue 60,
item 4). A model's embedding can have rows past `len(tokenizer)`: Qwen2.5/3 271 (270 beside the
`[PAD]` the loader adds), Pythia 26, the Qwen3-style tiny model 63. They decode to '' and RL can make
them likely (NeMo-RL#237, "Token id 151708 is out of vocabulary"). Here a Qwen3-style tiny model, loaded
as every stage loads it, gets an LM-head bias that gives those ids nearly all the probability, so that
any place that samples them or counts them in a normaliser shows it: the rollout engine (rollouts,
per-update validation, the online stages' final evaluation, sft.py's and dpo.py's evaluation tables) and
`scaled_logits` in the policy's and the reference's forwards."""

import contextlib
import copy
import math
import os
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import hf_generate
from summarize_from_feedback_details import dpo, evaluation, online_dpo
from summarize_from_feedback_details import ppo_left_padding as ppo
from summarize_from_feedback_details import rloo, rollout, sft, tiny_models
from summarize_from_feedback_details.infra import loading

RESPONSE = 12
SPARE_LOGIT = 12.0  # added to every spare id's logit: unmasked, the 63 take all but ~3e-5 of the probability


@pytest.fixture(scope="module")
def one_thread():
    """Generation is hundreds of tiny ops: one thread is much faster than a pool on a small shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def with_dominant_spare_rows(model, vocab_end: int):
    """`model` whose LM head (its tied weights kept) adds SPARE_LOGIT to the logits of the ids at or
    beyond `vocab_end`, the rows no token has."""
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    head.weight = model.lm_head.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[vocab_end:] = SPARE_LOGIT
    model.lm_head = head
    return model


@pytest.fixture(scope="module")
def qwen3_style(raw_dir, tmp_path_factory):
    """A Qwen3-style tokenizer (320 tokens, EOS as its pad) and random tiny-s models of tiny_models.py's
    qwen3 layout (embedding rows: the next multiple of 64 past the tokens), loaded through the stages'
    loaders, which add `[PAD]` into a spare row. The policy and a reference (its weights moved) both
    favour the spare ids. {"tokenizer", "policy", "reference"}."""
    folder = str(tmp_path_factory.mktemp("qwen3_spare_rows"))
    texts = tiny_models.corpus_texts(os.path.join(raw_dir, "tldr_sft", "train.jsonl"))
    base_tokenizer = tiny_models.train_tokenizer(texts, 320, "qwen3")
    torch.manual_seed(0)
    config = tiny_models.model_config("s", len(base_tokenizer), base_tokenizer, "qwen3")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    base_tokenizer.save_pretrained(folder)
    tokenizer = loading.load_tokenizer(folder)
    policy = with_dominant_spare_rows(loading.load_policy(folder, tokenizer).eval(), len(tokenizer))
    reference = with_dominant_spare_rows(loading.load_policy(folder, tokenizer).eval(), len(tokenizer))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for parameter in reference.model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return {"tokenizer": tokenizer, "policy": policy, "reference": reference}


def left_padded_queries(pad: int, rows: int = 6, length: int = 8) -> torch.Tensor:
    queries = torch.randint(2, pad, (rows, length), generator=torch.Generator().manual_seed(2))
    for row, padding in enumerate([0, 3, 5, 1, 0, 6][:rows]):
        queries[row, :padding] = pad
    return queries


def hf_samples(model, queries, temperature: float, seed: int, pad: int, vocab_end: int) -> torch.Tensor:
    """What HF generate samples for `queries` alone under torch.manual_seed(seed), `[PAD]` and the ids
    from `vocab_end` to the model's rows suppressed (hf_generate.generation_config)."""
    torch.manual_seed(seed)
    config = hf_generate.generation_config(RESPONSE, temperature, pad, vocab_end, model.config.vocab_size)
    return hf_generate.generate(model, queries, pad, config)


def test_rollout_engine_samples_no_spare_id_and_what_hf_generate_samples(qwen3_style, one_thread):
    """Three groups in batched decodes (rollout T 0.7, validation T 0.01, T 1): no response holds an id
    at or beyond len(tokenizer) (nor [PAD]), and each group's is what HF generate samples for it alone
    with the same seed and suppressed ids. The set-up: [PAD] is the tokenizer's last id (added into a
    spare row, no resize), 63 rows stay past it, and with [PAD] alone suppressed HF generate samples
    them nearly always."""
    tokenizer, policy = qwen3_style["tokenizer"], qwen3_style["policy"]
    pad, vocab_end, rows = tokenizer.pad_token_id, len(tokenizer), policy.config.vocab_size
    assert (pad, vocab_end, rows) == (320, 321, 384)
    queries = left_padded_queries(pad)
    torch.manual_seed(0)
    unmasked = hf_generate.generate(policy, queries, pad, hf_generate.generation_config(RESPONSE, 0.7, pad, rows, rows))
    assert (unmasked >= vocab_end).float().mean() > 0.95
    groups = [rollout.SamplingGroup(queries[:3], 0.7, 11), rollout.SamplingGroup(queries[3:5, 1:], 0.01, 12),
              rollout.SamplingGroup(queries[5:], 1.0, 13)]
    decoded = rollout.decode_in_batches(policy, groups, pad, vocab_end, RESPONSE, 3)
    for group, (responses, _) in zip(groups, decoded, strict=True):
        assert (responses < vocab_end).all() and (responses != pad).all()
        assert torch.equal(responses, hf_samples(policy, group.queries, group.temperature, group.seed, pad,
                                                 vocab_end))


def test_policy_and_reference_logprobs_give_spare_ids_probability_zero(qwen3_style, one_thread):
    """The logprobs the losses read (`scaled_logits` on the policy's and on the reference's forward, and
    online DPO's summed ones) equal a log-softmax over the tokenizer's ids without [PAD] (its last id),
    computed by hand; the policy's equal the rollout engine's (the first PPO ratio is 1)."""
    tokenizer, policy, reference = qwen3_style["tokenizer"], qwen3_style["policy"], qwen3_style["reference"]
    pad, vocab_end, eos, temperature = tokenizer.pad_token_id, len(tokenizer), tokenizer.eos_token_id, 0.7
    assert pad == vocab_end - 1  # (so the tokens without [PAD] are ids 0 .. pad - 1)
    queries = left_padded_queries(pad)
    ((responses, sampled_logprobs),) = rollout.decode(policy, [rollout.SamplingGroup(queries, temperature, 3)],
                                                      pad, vocab_end, RESPONSE)
    assert (responses < pad).all()  # (the ids whose log-probs are computed by hand below)
    query_responses = torch.cat([queries, responses], 1)
    with torch.no_grad():
        for model in (policy, reference):
            logits = ppo.response_logits(model, query_responses, pad, RESPONSE)
            by_hand = torch.log_softmax(logits[..., :pad] / (temperature + 1e-7), -1)  # ids 0 .. pad - 1
            expected = by_hand.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
            logprobs = ppo.gather_logprobs(ppo.scaled_logits(logits, temperature, pad, vocab_end), responses)
            assert torch.allclose(logprobs, expected, atol=1e-5)
            sums = online_dpo.response_logprob_sums(model, query_responses, responses, temperature, eos, pad, vocab_end)
            assert torch.allclose(sums, online_dpo.masked_sums(expected, responses, eos), atol=1e-4)
            if model is policy:
                assert (logprobs - sampled_logprobs).abs().max() < 1e-5


@pytest.mark.parametrize("stage", [ppo, rloo, online_dpo], ids=lambda stage: stage.__name__.split(".")[-1])
def test_scaled_logits_known_answer(stage):
    """Ids 0-3 are tokens, [PAD] is 1, ids 4 and 5 are spare rows with the largest logits: at T 0.5 the
    allowed ids 0, 2, 3 have logits 2, 4, 0, so log-probs 2 - z, 4 - z, -z with z = log(e^2 + e^4 + 1)."""
    logits = torch.tensor([[1.0, 5.0, 2.0, 0.0, 9.0, 7.0]])
    scaled = stage.scaled_logits(logits, 0.5, 1, 4)
    assert torch.softmax(scaled, -1)[0, [1, 4, 5]].tolist() == [0.0, 0.0, 0.0]
    z = math.log(math.exp(2) + math.exp(4) + 1)
    assert torch.allclose(torch.log_softmax(scaled, -1)[0, [0, 2, 3]], torch.tensor([2 - z, 4 - z, -z]), atol=1e-5)
    assert torch.isfinite(ppo.entropy_from_logits(scaled)).all()


def fake_accelerator():
    """What sft.py's and dpo.py's evaluations and evaluation.py read of an Accelerator, on one plain process."""
    return types.SimpleNamespace(num_processes=1, process_index=0, unwrap_model=lambda model: model,
                                 autocast=contextlib.nullcontext,
                                 gather_for_metrics=lambda values, use_gather_object=False: values)


def eval_batch(tokenizer) -> dict:
    """A split's batch as sft.py's and dpo.py's evaluations read it: left-padded queries, references ending
    in EOS, their concatenation."""
    queries = left_padded_queries(tokenizer.pad_token_id, rows=4)
    words = torch.randint(2, tokenizer.pad_token_id, (4, 3), generator=torch.Generator().manual_seed(3))
    references = torch.cat([words, torch.full((4, 1), tokenizer.eos_token_id)], 1)
    return {"query_token": queries, "reference_response_token": references,
            "query_reference_response_token": torch.cat([queries, references], 1)}


@pytest.mark.parametrize("stage", ["sft", "dpo", "online"])
def test_evaluation_sampling_emits_no_spare_id(stage, qwen3_style, monkeypatch, one_thread):
    """sft.py's evaluation and dpo.py's generation table (at their eval temperature 0.01, where a spare id would
    be the argmax) and the online stages' final evaluation, all through the rollout engine, sample no id at or
    beyond len(tokenizer), [PAD] neither."""
    tokenizer, policy = qwen3_style["tokenizer"], qwen3_style["policy"]
    sampled, original = [], evaluation.decode

    def recorded(*args, **kwargs):
        result = original(*args, **kwargs)
        sampled.append(result[0][0])
        return result

    monkeypatch.setattr(evaluation, "decode", recorded)
    batch = eval_batch(tokenizer)
    if stage == "sft":
        sft.evaluate(sft.Args(response_length=RESPONSE), fake_accelerator(), policy, tokenizer, [batch])
    elif stage == "dpo":
        dpo.generation_table(dpo.Args(response_length=RESPONSE), fake_accelerator(), policy, tokenizer, [batch])
    else:
        config = copy.deepcopy(policy.config)
        config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
        torch.manual_seed(0)
        reward_model = AutoModelForSequenceClassification.from_config(config).eval()
        evaluation.evaluate_policy(fake_accelerator(), policy, reward_model, tokenizer, [batch], 0.01, RESPONSE, 5)
    (responses,) = sampled
    assert responses.shape == (4, RESPONSE)
    assert (responses < len(tokenizer)).all() and (responses != tokenizer.pad_token_id).all()
