"""eval/compare_table.py (make compare's table) on fake run folders with known verdicts, KL and
timings."""

import json
import os
import sys

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval"))
import compare_table
from test_eval_rlhf_scaling_plot import GOOD, MID, POST

from summarize_from_feedback_details.hello_world_report import reward_scores


def rows_with(wins: int):
    """Four validation rows of which `wins` win against the reference and the rest lose (gold judge)."""
    return [(GOOD, MID)] * wins + [(MID, GOOD)] * (4 - wins)


# per exp_name: win counts (of 4) for seeds 1, 2, 3; the comments give the paired difference to SFT
WINS = {"sft": (1, 1, 2), "ppo_left_padding": (3, 3, 4),  # +0.5 each seed: beats SFT
        "rloo": (0, 1, 0),  # -0.25, 0, -0.5: not resolved
        "grpo": (0, 0, 1)}  # -0.25 each seed: below SFT
KL = [9.0, 9.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # the last 5 average 3
SECONDS = {"ppo_left_padding": [2.0, 3.0, 10.0], "rloo": [1.0, 1.5, 9.0], "grpo": [1.0, 1.5, 9.0]}  # then the last, 4 times


def write_run(runs_dir, exp_name, seed, wins, tokenizer_dir, reward_model_path):
    folder = os.path.join(runs_dir, f"scaling_m_{seed}_{exp_name}")
    os.makedirs(folder)
    config = {"exp_name": exp_name, "base_model": "models/tiny/pythia-tiny-m", "seed": seed, "output_dir": tokenizer_dir}
    if exp_name != "sft":
        config["reward_model_path"] = reward_model_path
    with open(os.path.join(folder, "args.json"), "w") as f:
        json.dump(config, f)
    rows = rows_with(wins)
    pd.DataFrame({"query": [POST] * 4, "postprocessed_response": [r for r, _ in rows],
                  "reference_responses": [ref for _, ref in rows]}).to_csv(
        os.path.join(folder, "validation_table.csv"), index=False)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        if exp_name in SECONDS:
            for kl, seconds in zip(KL, SECONDS[exp_name] + [SECONDS[exp_name][-1]] * 4):
                phases = {"time/generation": 1.0, **({"time/value_forward": 0.5} if exp_name == "ppo_left_padding" else {})}
                f.write(json.dumps({"objective/kl": kl, "time/update": seconds, **phases}) + "\n")
        f.write(json.dumps({"loss": 0.1}) + "\n")


def test_compare_table_known_answers(tmp_path, checkpoints):
    _, reward_model = checkpoints
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    for exp_name, wins in WINS.items():
        for seed, w in zip((1, 2, 3), wins):
            write_run(runs_dir, exp_name, seed, w, reward_model, reward_model)
    compare_table.main(compare_table.Args(runs_dir=runs_dir, run_glob="scaling_m_*", out=out))

    runs = pd.read_csv(os.path.join(out, "compare_runs.csv"))
    assert runs["policy"].tolist() == ["SFT"] * 3 + ["PPO"] * 3 + ["RLOO k=2"] * 3 + ["GRPO k=4"] * 3
    assert runs["win_rate"].tolist() == [w / 4 for wins in WINS.values() for w in wins]
    online = runs[runs["policy"] != "SFT"]
    assert online["kl"].tolist() == pytest.approx([3.0] * 9)
    # time/update per update: the median of the 7 logged (2, 3, 10, 10, 10, 10, 10) is 10 for PPO
    assert online["seconds_per_update"].tolist() == pytest.approx([10.0] * 3 + [9.0] * 6)
    assert runs[runs["policy"] == "SFT"][["kl", "seconds_per_update"]].isna().all().all()
    # every policy's summaries scored by its seed's reward model (SFT's comes from the online runs)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model)
    expected = reward_scores(model, tokenizer, [POST] * 4, [r for r, _ in rows_with(1)]).mean()
    assert runs.loc[0, "rm_score"] == pytest.approx(expected, abs=1e-6)

    table = pd.read_csv(os.path.join(out, "compare_table_full.csv")).set_index("policy")
    assert table.loc["PPO", "win_rate"] == pytest.approx(10 / 12)
    assert table.loc["PPO", "win_rate_per_seed"] == "0.75 0.75 1"
    half = 4.302653 * np.std([0.75, 0.75, 1.0], ddof=1) / 3 ** 0.5
    assert table.loc["PPO", ["win_rate_ci_low", "win_rate_ci_high"]].tolist() == pytest.approx(
        [10 / 12 - half, 10 / 12 + half], abs=1e-5)
    assert table.loc["PPO", "minus_sft"] == pytest.approx(0.5) and table.loc["PPO", "vs_sft"] == "beats SFT"
    assert table.loc["RLOO k=2", "minus_sft"] == pytest.approx(-0.25) and table.loc["RLOO k=2", "vs_sft"] == "not resolved"
    assert table.loc["GRPO k=4", "vs_sft"] == "below SFT" and pd.isna(table.loc["SFT", "vs_sft"])
    assert table.loc["RLOO k=2", "seconds_vs_ppo"] == pytest.approx(0.9)
    readable = open(os.path.join(out, "compare_table.md")).read()
    assert "| pythia-tiny-m | PPO | 1 2 3 | 0.833 [" in readable and "| beats SFT |" in readable
    for ext in ("png", "pdf"):
        assert os.path.getsize(os.path.join(out, f"compare.{ext}")) > 0
    # where the time goes, per online method: the median of each phase's seconds, mean over seeds
    phases = pd.read_csv(os.path.join(out, "compare_phases.csv")).set_index("policy")
    assert list(phases.index) == ["PPO", "RLOO k=2", "GRPO k=4"]
    assert phases.loc["PPO", "update"] == pytest.approx(10.0) and phases.loc["PPO", "generation"] == pytest.approx(1.0)
    assert phases.loc["RLOO k=2", "value_forward"] == 0.0 and phases.loc["PPO", "value_forward"] == pytest.approx(0.5)
