"""The paper's pre-tokenized hub datasets are every stage's default. Their columns, from the paper's
tldr_dataset.py at the commit that wrote them (vwxyzjn/summarize_from_feedback_details bed5a4d,
datasets `vwxyzjn/summarize_from_feedback{_tldr_3_filtered,}_oai_preprocessing_1706381144`), are a
subset of ours: every training stage must run on exactly those columns."""

import json
import os

import pytest
from datasets import load_from_disk

from conftest import run_in_process
from summarize_from_feedback_details import dpo
from summarize_from_feedback_details import ppo_left_padding as ppo
from summarize_from_feedback_details import reward, sft

PAPER_SFT_COLUMNS = {
    "id", "subreddit", "title", "post", "summary", "query_token", "query", "reference_response",
    "reference_response_token", "reference_response_token_len", "query_reference_response",
    "query_reference_response_token", "query_reference_response_token_response_label",
    "query_reference_response_token_len",
}
PAPER_PREFERENCE_COLUMNS = {
    "info", "summaries", "choice", "worker", "batch", "split", "extra", "query_token", "query", "query_token_len",
    "chosen", "chosen_token", "chosen_token_len", "rejected", "rejected_token", "rejected_token_len",
    "chosen_policy", "rejected_policy", "policies", "query_chosen", "query_chosen_token", "query_chosen_token_len",
    "query_chosen_token_response_label", "query_rejected", "query_rejected_token", "query_rejected_token_len",
    "query_rejected_token_response_label",
}


def test_our_datasets_hold_every_column_of_the_papers(tiny_datasets):
    data_dir, _ = tiny_datasets
    for name, paper, extra in (("sft", PAPER_SFT_COLUMNS, {"query_token_len", "query_truncations"}),
                               ("preference", PAPER_PREFERENCE_COLUMNS, {"query_truncations"})):
        for split, ds in load_from_disk(os.path.join(data_dir, name)).items():
            assert set(ds.column_names) - paper == extra, (name, split)
            assert paper <= set(ds.column_names), (name, split)


@pytest.fixture(scope="module")
def paper_datasets(tiny_datasets, tmp_path_factory):
    """The tiny datasets with only the paper's columns."""
    data_dir, _ = tiny_datasets
    out = tmp_path_factory.mktemp("paper_schema")
    for name, columns in (("sft", PAPER_SFT_COLUMNS), ("preference", PAPER_PREFERENCE_COLUMNS)):
        dataset = load_from_disk(os.path.join(data_dir, name))
        dataset.remove_columns([c for c in dataset["train"].column_names if c not in columns]).save_to_disk(out / name)
    return str(out)


def last_metrics(workdir, name) -> dict:
    with open(os.path.join(workdir, "runs", name, "metrics.jsonl")) as f:
        return {k: v for line in f for k, v in json.loads(line).items()}


def test_every_stage_runs_on_the_papers_columns(paper_datasets, models_dir, tmp_path):
    """A few updates of SFT (response-only loss, so the label column is read too, and eval), the
    reward model (with eval and normalisation), PPO and DPO (with eval), chained, on the paper's
    columns."""
    base, workdir = os.path.join(models_dir, "pythia-tiny-s"), str(tmp_path)
    sft_data, preference_data = os.path.join(paper_datasets, "sft"), os.path.join(paper_datasets, "preference")
    run_in_process(sft.main, sft.Args(
        base_model=base, query_dataset=sft_data, output_dir=os.path.join(workdir, "sft"), run_name="sft", lr=3e-3,
        total_episodes=16, local_micro_batch_size=8, gradient_accumulation_steps=1, response_length=32,
        response_only_loss=True, run_eval=True, local_eval_batch_size=64), workdir)
    assert "validation/sft/rouge/rougeL" in last_metrics(workdir, "sft")
    run_in_process(reward.main, reward.Args(
        base_model=base, sft_model_path=os.path.join(workdir, "sft"), label_dataset=preference_data,
        query_dataset=sft_data, output_dir=os.path.join(workdir, "rm"), run_name="rm", total_episodes=16,
        local_micro_batch_size=8, gradient_accumulation_steps=1, run_eval=True, local_eval_batch_size=64), workdir)
    rm = last_metrics(workdir, "rm")
    assert {"eval/rm/validation/accuracy", "eval/rm/validation_cnndm/accuracy"} <= rm.keys()
    assert rm["eval/rm/normalization_max_error"] < 1e-4  # re-scored after the shift was folded in
    run_in_process(ppo.main, ppo.Args(
        base_model=base, sft_model_path=os.path.join(workdir, "sft"), reward_model_path=os.path.join(workdir, "rm"),
        query_dataset=sft_data, output_dir=os.path.join(workdir, "ppo"), run_name="ppo", response_length=32,
        total_episodes=8, local_micro_batch_size=4, gradient_accumulation_steps=2, local_rollout_forward_batch_size=8,
        local_eval_batch_size=64, run_eval=True, print_sample_output_freq=0), workdir)
    assert "eval/validation/scores" in last_metrics(workdir, "ppo")
    run_in_process(dpo.main, dpo.Args(
        base_model=base, sft_model_path=os.path.join(workdir, "sft"), label_dataset=preference_data,
        query_dataset=sft_data, output_dir=os.path.join(workdir, "dpo"), run_name="dpo", response_length=32,
        total_episodes=16, local_micro_batch_size=8, gradient_accumulation_steps=1, run_eval=True,
        local_eval_batch_size=64), workdir)
    assert {"eval/rm/validation/accuracy", "eval/rm/validation_cnndm/accuracy"} <= last_metrics(workdir, "dpo").keys()
    assert os.path.isfile(os.path.join(workdir, "runs", "dpo", "validation_table.csv"))
