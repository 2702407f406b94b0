import json
import os

import pandas as pd
import pytest

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
    assert report.collect(report.Args(runs_dir=str(runs))) == []  # nothing has run yet
    write_run(runs / "hello_world_sft", [{"train/sft/loss": 2.0}, {"validation/sft/rouge/rougeL": 0.4567}],
              {"validation_table.csv": pd.DataFrame({"query": [POST, POST], "postprocessed_response": [
                  " one two three", " one two three four five"], "reference_responses": ["x", "y"]})})
    # the model orders pair 0 as the judge does, pair 1 the other way, pair 2 ties: agreement 0.5
    eval_table = pd.DataFrame({"query": [POST] * 3, "chosen": [GOOD, GOOD, POOR], "rejected": [POOR, POOR, GOOD],
                               "chosen_rewards": [1.0, -1.0, 0.0], "rejected_rewards": [0.0, 1.0, 0.0]})
    write_run(runs / "hello_world_reward", [{"eval/rm/validation/accuracy": 0.7, "eval/rm/validation_cnndm/accuracy": 0.65}],
              {"eval_validation_table.csv": eval_table, "eval_validation_cnndm_table.csv": eval_table.iloc[:1]})
    rows = dict(report.collect(report.Args(runs_dir=str(runs))))
    assert rows["SFT ROUGE-L (validation)"] == "0.457"
    assert rows["SFT mean response length (words)"] == "4.0"
    assert rows["RM accuracy, TL;DR validation"] == "0.700 (3 pairs)"
    assert rows["RM agreement with the gold judge, TL;DR validation"] == "0.500"
    assert rows["RM accuracy, OOD (CNN/DM role)"] == "0.650 (1 pairs)"
    assert rows["RM agreement with the gold judge, OOD (CNN/DM role)"] == "1.000"


def test_last_metrics_keeps_the_latest_value(tmp_path):
    write_run(tmp_path / "run", [{"a": 1.0}, {"a": 2.0, "b": 3.0}], {})
    assert report.last_metrics(str(tmp_path / "run")) == pytest.approx({"a": 2.0, "b": 3.0})
