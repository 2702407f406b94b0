"""eval/end_margin.py: how close a policy came to going on where its summaries end, with known answers from
hand-set logits, from a model that reads nothing (every margin 0) and from the likelihood read of fact_copy."""

import math
import os
import sys

import pandas as pd
import pytest
import torch
from conftest import tiny_llama_config
from test_eval_fact_copy import REFERENCES, uniform_model
from test_hello_world_report import POST
from transformers import AutoTokenizer, LlamaForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval"))
import end_margin

from summarize_from_feedback_details import evaluation


def test_the_margin_is_eos_against_the_likeliest_other_token():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    margin, rival = end_margin.end_margin(logits, eos_id=0)
    assert rival == 1 and margin == pytest.approx(math.log(0.5 / 0.3), abs=1e-6)
    margin, rival = end_margin.end_margin(logits + 7.0, eos_id=2)  # a shift of every logit changes nothing
    assert rival == 0 and margin == pytest.approx(math.log(0.2 / 0.5), abs=1e-6)


def write_table(path, contain_eos) -> str:
    pd.DataFrame({"query": [POST] * len(contain_eos), "postprocessed_response": REFERENCES[:len(contain_eos)],
                  "contain_eos": contain_eos}).to_csv(path, index=False)
    return str(path)


def test_a_model_that_reads_nothing_ends_every_summary_at_a_tie(tmp_path, tokenizer_dir):
    model = uniform_model(tokenizer_dir, str(tmp_path / "uniform"))
    table = write_table(tmp_path / "validation_table.csv", [True, False, True])
    frame = end_margin.main(end_margin.Args(table=table, model=model, out=str(tmp_path / "out")))
    assert list(frame["margin"]) == [0.0, 0.0]  # the summary without EOS is not read
    written = pd.read_csv(tmp_path / "out" / "end_margin.csv", keep_default_na=False)
    assert list(written["margin"]) == [0.0, 0.0] and len(set(written["rival"])) == 1
    with pytest.raises(ValueError, match="none of its first 1 summaries ends with EOS"):
        end_margin.main(end_margin.Args(table=write_table(tmp_path / "none.csv", [False]), model=model, prompts=1,
                                        out=str(tmp_path / "none")))


def test_the_read_is_the_step_after_the_summary(tokenizer_dir):
    """log p(EOS | post, summary) from the logits end_logits reads equals the likelihood read of fact_copy
    (evaluation.response_logprobs) of the summary with EOS minus that of the summary alone."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), max_position_embeddings=512)).eval()
    eos = tokenizer.eos_token_id
    for response in REFERENCES:
        logprob_eos = torch.log_softmax(end_margin.end_logits(model, tokenizer, POST, response).float(), -1)[eos]
        with torch.no_grad():
            with_eos, alone = evaluation.response_logprobs(model, tokenizer, [POST] * 2,
                                                           [response + tokenizer.eos_token, response])
        assert tokenizer(response + tokenizer.eos_token, add_special_tokens=False)["input_ids"][-1] == eos
        assert float(logprob_eos) == pytest.approx(with_eos - alone, abs=1e-4)
