import json
import os

import pandas as pd
import pytest
import torch

from summarize_from_feedback_details import hello_world_report as report

POST = ("SUBREDDIT: r/roommates\n\nTITLE: help\n\nPOST: I (25F) have lived with my roommate (27M) for 3 years.\n\n"
        "Lately they has not paid rent in months. I am so angry right now.\n\nShould I just move out?\n\nTL;DR:")
GOOD = " my roommate of 3 years has not paid rent, I feel angry. should I move out?<|endoftext|>"
POOR = " roommate owes rent.<|endoftext|>"


def write_run(folder, metrics_lines, tables):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, metrics in enumerate(metrics_lines):
            f.write(json.dumps({"step": step, **metrics}) + "\n")
    for name, frame in tables.items():
        frame.to_csv(os.path.join(folder, name), index=False)


def test_report_reads_the_run_folders(tmp_path):
    runs = tmp_path / "runs"
    args = report.Args(runs_dir=str(runs), models_dir=str(tmp_path / "no_models"), plots_dir=str(tmp_path / "no_plots"))
    assert report.collect(args) == []  # nothing has run yet
    write_run(runs / "hello_world_sft", [{"train/sft/loss": 2.0}, {"validation/sft/rouge/rougeL": 0.4567}],
              {"validation_table.csv": pd.DataFrame({"query": [POST, POST], "postprocessed_response": [
                  " one two three", " one two three four five"], "reference_responses": ["x", "y"]})})
    # the model orders pair 0 as the judge does, pair 1 the other way, pair 2 ties: agreement 0.5
    eval_table = pd.DataFrame({"query": [POST] * 3, "chosen": [GOOD, GOOD, POOR], "rejected": [POOR, POOR, GOOD],
                               "chosen_rewards": [1.0, -1.0, 0.0], "rejected_rewards": [0.0, 1.0, 0.0]})
    write_run(runs / "hello_world_reward", [{"eval/rm/validation/accuracy": 0.7, "eval/rm/validation_cnndm/accuracy": 0.65}],
              {"eval_validation_table.csv": eval_table, "eval_validation_cnndm_table.csv": eval_table.iloc[:1]})
    # DPO's implicit rewards in the same table format: pair 0 ordered against the judge -> agreement 0
    write_run(runs / "hello_world_dpo", [{"eval/rm/validation/accuracy": 0.6, "eval/rm/validation_cnndm/accuracy": 0.55}],
              {"eval_validation_table.csv": eval_table.assign(chosen_rewards=[-1.0, -1.0, 0.0]),
               "eval_validation_cnndm_table.csv": eval_table.iloc[:1].assign(chosen_rewards=[-1.0])})
    rows = dict(report.collect(args))
    assert rows["SFT ROUGE-L (validation)"] == "0.457"
    assert rows["RM accuracy, TL;DR validation"] == "0.700 (3 pairs)"
    assert rows["RM agreement with the gold judge, TL;DR validation"] == "0.500"
    assert rows["RM accuracy, OOD (CNN/DM role)"] == "0.650 (1 pairs)"
    assert rows["RM agreement with the gold judge, OOD (CNN/DM role)"] == "1.000"
    assert rows["DPO implicit-reward accuracy, TL;DR validation"] == "0.600 (3 pairs)"
    assert rows["DPO implicit-reward agreement with the gold judge, TL;DR validation"] == "0.167"  # (a tie: half)
    assert rows["DPO implicit-reward accuracy, OOD (CNN/DM role)"] == "0.550 (1 pairs)"
    assert rows["DPO implicit-reward agreement with the gold judge, OOD (CNN/DM role)"] == "0.000"
    # real data: accuracies without the synthetic gold judge
    real = dict(report.collect(report.Args(runs_dir=str(runs), models_dir=args.models_dir, gold_judge=False)))
    assert real["DPO implicit-reward accuracy, TL;DR validation"] == "0.600 (3 pairs)"
    assert not any("gold" in what for what in real)


def test_last_metrics_keeps_the_latest_value(tmp_path):
    write_run(tmp_path / "run", [{"a": 1.0}, {"a": 2.0, "b": 3.0}], {})
    assert report.last_metrics(str(tmp_path / "run")) == pytest.approx({"a": 2.0, "b": 3.0})


def test_policy_rows_score_both_policies_the_same_way(tmp_path, tokenizer_dir, tokenizer):
    from transformers import AutoModelForSequenceClassification

    from summarize_from_feedback_details import reward, run_infra

    models = tmp_path / "models"
    rm_dir = str(models / "reward_model")
    reward.reward_model_to_train(tokenizer_dir, run_infra.load_tokenizer(tokenizer_dir), head_seed=1).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    good, poor = GOOD.replace("<|endoftext|>", ""), POOR.replace("<|endoftext|>", "")
    runs = tmp_path / "runs"
    # SFT: one win (good vs poor reference) and one loss; PPO: two wins
    write_run(runs / "hello_world_sft", [{"validation/sft/rouge/rougeL": 0.5}], {"validation_table.csv": pd.DataFrame(
        {"query": [POST, POST], "postprocessed_response": [good, poor], "reference_responses": [poor, good]})})
    write_run(runs / "hello_world_ppo", [{"objective/kl": k} for k in (9.0, 1.0, 2.0, 3.0, 4.0, 5.0)],
              {"validation_table.csv": pd.DataFrame({"query": [POST, POST], "postprocessed_response": [good, good],
                                                     "reference_responses": [poor, poor]})})
    # DPO: two losses
    write_run(runs / "hello_world_dpo", [{"train/rm/loss": 0.6}], {"validation_table.csv": pd.DataFrame(
        {"query": [POST, POST], "postprocessed_response": [poor, poor], "reference_responses": [good, good]})})
    # ALGOS=all: GRPO (one win, one loss; its own KL history) is a policy row of its own
    write_run(runs / "hello_world_grpo", [{"objective/kl": k} for k in (0.5, 1.5)], {"validation_table.csv": pd.DataFrame(
        {"query": [POST, POST], "postprocessed_response": [good, poor], "reference_responses": [poor, good]})})
    (tmp_path / "plots").mkdir()
    for name in ("win_rate.png", "win_rate.pdf", "length.png"):
        (tmp_path / "plots" / name).touch()
    args = report.Args(runs_dir=str(runs), models_dir=str(models), plots_dir=str(tmp_path / "plots"))
    rows = dict(report.collect(args))
    assert rows["models"] == f"{models}/{{reward_model}}"
    assert rows["plots"] == f"{tmp_path / 'plots'} (2 plots: PNG, PDF, CSV, markdown)"
    # each with its 95% Wilson interval over the 2 prompts
    assert rows["SFT gold-judge win rate vs reference (2 prompts)"] == "0.500 [0.095, 0.905]"
    assert rows["PPO gold-judge win rate vs reference (2 prompts)"] == "1.000 [0.342, 1.000]"
    assert rows["DPO gold-judge win rate vs reference (2 prompts)"] == "0.000 [0.000, 0.658]"
    # all losses: the length-controlled rate is ~0 whatever the lengths
    assert rows["DPO length-controlled gold win rate"].startswith("0.000 [0.000, 0.000]")
    assert rows["DPO mean response length (tokens)"] == f"{len(tokenizer(poor)['input_ids']):.1f}"
    assert rows["PPO KL to the SFT policy (nats per response, last 5 updates)"] == "3.00"
    assert rows["GRPO k=4 gold-judge win rate vs reference (2 prompts)"] == "0.500 [0.095, 0.905]"
    assert rows["GRPO k=4 KL to the SFT policy (nats per response, last 5 updates)"] == "1.00"
    assert not any(what.startswith(("RLOO", "online DPO", "DPO KL")) for what in rows)  # no runs, no rows
    lengths = [len(tokenizer(r)["input_ids"]) for r in (good, poor)]
    assert rows["SFT mean response length (tokens)"] == f"{sum(lengths) / 2:.1f}"
    assert rows["PPO mean response length (tokens)"] == f"{lengths[0]:.1f}"
    # the score of [query | response + EOS], read at the EOS, whatever the padding of the batch
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    ids = torch.tensor([tokenizer(POST)["input_ids"] + tokenizer(good)["input_ids"] + [tokenizer.eos_token_id]])
    with torch.no_grad():
        alone = model(input_ids=ids).logits[0, 0].item()
    batched = report.reward_scores(model, tokenizer, [POST, POST], [poor, good])
    assert batched[1] == pytest.approx(alone, abs=1e-5) and batched[0] != pytest.approx(alone, abs=1e-3)
    assert rows["PPO mean reward-model score"] == f"{alone:.3f}"
    # real data: no gold judge, the other rows stay
    real = dict(report.collect(report.Args(runs_dir=str(runs), models_dir=str(models), gold_judge=False)))
    assert not any("gold" in what for what in real) and real["PPO mean reward-model score"] == f"{alone:.3f}"
