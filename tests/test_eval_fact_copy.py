"""eval/fact_copy.py: the reward model's fact-swap pairs read on a causal LM's likelihood, with known
answers from a model that reads nothing (uniform next tokens) and from the gold judge as the scorer."""

import os
import sys
import types

import numpy as np
import pandas as pd
import torch
from conftest import tiny_llama_config
from test_hello_world_report import GOOD, POST
from transformers import AutoTokenizer, LlamaForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval"))
import fact_copy

from summarize_from_feedback_details.gold_judge import gold_score
from summarize_from_feedback_details import evaluation
from summarize_from_feedback_details.evaluation import fact_swap_pairs

REFERENCES = [GOOD.replace("<|endoftext|>", ""), " my roommate has not paid rent.", " roommate owes rent, I am angry."]


def uniform_model(tokenizer_dir: str, folder: str) -> str:
    """A causal LM whose every weight is 0: logits 0, so log p(response) = -n log V for n tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), max_position_embeddings=512))
    with torch.no_grad():
        for weight in model.parameters():
            weight.zero_()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_model_that_reads_nothing_prefers_the_shorter_of_each_pair(tmp_path, tokenizer_dir):
    table = tmp_path / "validation_table.csv"
    pd.DataFrame({"query": [POST] * 3, "reference_responses": REFERENCES}).to_csv(table, index=False)
    model = uniform_model(tokenizer_dir, str(tmp_path / "uniform"))
    out = fact_copy.main(fact_copy.Args(table=str(table), models=[model], out=str(tmp_path / "out")))
    tokenizer = AutoTokenizer.from_pretrained(model)
    length = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    log_vocabulary = np.log(len(tokenizer))
    # the response's tokens only, each at probability 1/V
    loaded = LlamaForCausalLM.from_pretrained(model).eval()
    assert np.allclose(evaluation.response_logprobs(loaded, tokenizer, [POST] * 2, REFERENCES[:2]),
                       [-length(text) * log_vocabulary for text in REFERENCES[:2]], rtol=0, atol=1e-4)
    # read without autograd: a scorer over thousands of pairs must not build a graph per forward
    grad_enabled = []
    hook = loaded.register_forward_hook(lambda module, inputs, output: grad_enabled.append(torch.is_grad_enabled()))
    evaluation.response_logprobs(loaded, tokenizer, [POST], REFERENCES[:1])
    hook.remove()
    assert grad_enabled == [False]
    queries, texts, pairs = evaluation.fact_probe_pairs(pd.read_csv(table))
    for slot, swaps in pairs.items():
        # log p(reference) - log p(swap) = (swap's tokens - reference's tokens) x log V
        margins = [(length(swapped) - length(texts[row])) * log_vocabulary for row, swapped in swaps]
        expected = np.mean([(m > 0) + 0.5 * (m == 0) for m in margins])
        assert out[slot][0] == round(expected, 3) and abs(out[f"{slot}_margin"][0] - np.mean(margins)) < 1e-3, slot
    assert {slot: len(swaps) for slot, swaps in pairs.items()} == {
        "relation": 3, "problem": 3, "ask": 1, "duration": 1, "feeling": 2, "duration_unit": 1}
    assert pairs["duration_unit"] == [(0, GOOD.replace("3 years", "3 months").replace("<|endoftext|>", ""))]
    written = pd.read_csv(tmp_path / "out" / "fact_copy.csv")
    assert list(written["model"]) == [model] and written["feeling"][0] == out["feeling"][0]
    assert list(written["kind"]) == ["causal LM"]


def test_reward_models_read_the_same_pairs_and_the_unit_swap_finds_one_blind_to_the_unit(tmp_path, monkeypatch):
    """--reward_models: each scores the pairs as hello_world's table does. A scorer that reads every duration
    in years (blind to the unit) passes the duration's fact swap (its number moved) and ties on the
    unit swap; the gold judge checks both."""
    table = tmp_path / "validation_table.csv"
    pd.DataFrame({"query": [POST] * 3, "reference_responses": REFERENCES}).to_csv(table, index=False)
    scorers = {"gold": gold_score, "unit_blind": lambda q, t: gold_score(q, t.replace("months", "years"))}
    loaded = types.SimpleNamespace(from_pretrained=lambda path: types.SimpleNamespace(eval=lambda: path))
    monkeypatch.setattr(fact_copy, "AutoModelForSequenceClassification", loaded)
    monkeypatch.setattr(fact_copy, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(evaluation, "reward_scores", lambda model, tokenizer, qs, ts, eos: np.array(
        [scorers[model](q, t) for q, t in zip(qs, ts)]))
    out = fact_copy.main(fact_copy.Args(table=str(table), models=[], reward_models=list(scorers),
                                        out=str(tmp_path / "out")))
    assert list(out["kind"]) == ["reward model"] * 2
    assert all(out[slot][0] == 1.0 for slot in evaluation.PROBE_SLOTS)  # the gold judge
    assert out["duration"][1] == 1.0 and out["duration_unit"][1] == 0.5 and out["duration_unit_margin"][1] == 0


def test_a_scorer_that_checks_every_fact_prefers_every_reference(monkeypatch):
    queries, texts, pairs = fact_swap_pairs(pd.DataFrame({"query": [POST] * 3, "reference_responses": REFERENCES}))
    monkeypatch.setattr(evaluation, "response_logprobs",
                        lambda model, tokenizer, qs, ts: np.array([gold_score(q, t) for q, t in zip(qs, ts)]))
    row = fact_copy.fact_copy_row(None, None, queries, texts, pairs)
    assert all(row[slot] == 1.0 and row[f"{slot}_margin"] >= 2.5 for slot in pairs)
