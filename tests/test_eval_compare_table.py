"""eval/compare_table.py (make compare's table) on fake run folders with known verdicts, gold scores, KL
and timings."""

import json
import os
import sys

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval"))
import compare_table
from test_eval_rlhf_scaling_plot import GOOD, MID, POOR, POST

from summarize_from_feedback_details import win_rates
from summarize_from_feedback_details.evaluation import reward_scores

# four validation prompts (one post under four titles), the same in every run
QUERIES = [POST.replace("TITLE: help", f"TITLE: help {i}") for i in range(4)]


def rows_with(wins: int):
    """Four validation rows of which `wins` win against the reference and the rest lose (gold judge):
    the first `wins` prompts get GOOD, the others MID."""
    return [(GOOD, MID)] * wins + [(MID, GOOD)] * (4 - wins)


def words(query, summary):
    """The stand-in gold judge of these tests: the summary's word count, GOOD 16 > MID 10 > POOR 3 as
    the gold judge orders them (so the verdicts are the gold judge's), with numbers known by hand."""
    return float(len(summary.split()))


# per exp_name: win counts (of 4) for seeds 1, 2, 3; the comments give the paired difference to SFT
WINS = {"sft": (1, 1, 2), "ppo_left_padding": (3, 3, 4),  # +0.5 each seed: beats SFT
        "rloo": (0, 1, 0),  # -0.25, 0, -0.5: not resolved
        "grpo": (0, 0, 1)}  # -0.25 each seed: below SFT
KL = [9.0, 9.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # the last 5 average 3
SECONDS = {"ppo_left_padding": [2.0, 3.0, 10.0], "rloo": [1.0, 1.5, 9.0], "grpo": [1.0, 1.5, 9.0],
           "ppo_control": [2.0, 3.0, 10.0]}  # then the last, 4 times
# the control (PPO against a reward model that knows nothing) writes POOR on every prompt: gold 3 against
# SFT's 16 or 10 per prompt, paired per seed -8.5, -8.5, -10 (its rows in reverse order: joined on the query)
CONTROL_ROWS = [(POOR, GOOD)] * 4


def write_run(runs_dir, exp_name, seed, rows, tokenizer_dir, reward_model_path):
    folder = os.path.join(runs_dir, f"scaling_m_{seed}_{exp_name}")
    os.makedirs(folder)
    config = {"exp_name": exp_name, "base_model": "models/tiny/pythia-tiny-m", "seed": seed, "output_dir": tokenizer_dir}
    if exp_name != "sft":
        config["reward_model_path"] = reward_model_path
    with open(os.path.join(folder, "args.json"), "w") as f:
        json.dump(config, f)
    table = pd.DataFrame({"query": QUERIES, "postprocessed_response": [r for r, _ in rows],
                          "reference_responses": [ref for _, ref in rows]})
    (table.iloc[::-1] if exp_name == "ppo_control" else table).to_csv(os.path.join(folder, "validation_table.csv"),
                                                                      index=False)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        if exp_name in SECONDS:
            for kl, seconds in zip(KL, SECONDS[exp_name] + [SECONDS[exp_name][-1]] * 4):
                phases = {"time/generation": 1.0, **({"time/value_forward": 0.5} if exp_name == "ppo_left_padding" else {})}
                f.write(json.dumps({"objective/kl": kl, "time/update": seconds, **phases}) + "\n")
        f.write(json.dumps({"loss": 0.1}) + "\n")


def test_compare_table_known_answers(tmp_path, checkpoints, monkeypatch):
    _, reward_model = checkpoints
    monkeypatch.setattr(compare_table, "gold_score", words)
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    # the control's reward model (here an empty folder): not the one that scores the summaries
    os.makedirs(tmp_path / "control_reward_model")
    for exp_name, wins in WINS.items():
        for seed, w in zip((1, 2, 3), wins):
            write_run(runs_dir, exp_name, seed, rows_with(w), reward_model, reward_model)
    for seed in (1, 2, 3):
        write_run(runs_dir, "ppo_control", seed, CONTROL_ROWS, reward_model, str(tmp_path / "control_reward_model"))
    compare_table.main(compare_table.Args(runs_dir=runs_dir, run_glob="scaling_m_*", out=out))

    runs = pd.read_csv(os.path.join(out, "compare_runs.csv"))
    assert runs["policy"].tolist() == ["SFT"] * 3 + ["PPO"] * 3 + ["RLOO k=2"] * 3 + ["GRPO k=4"] * 3 + ["control"] * 3
    assert runs["win_rate"].tolist() == [w / 4 for wins in WINS.values() for w in wins] + [0.0] * 3
    online = runs[runs["policy"] != "SFT"]
    assert online["kl"].tolist() == pytest.approx([3.0] * 12)
    # time/update per update: the median of the 7 logged (2, 3, 10, 10, 10, 10, 10) is 10 for PPO
    assert online["seconds_per_update"].tolist() == pytest.approx([10.0] * 3 + [9.0] * 6 + [10.0] * 3)
    assert runs[runs["policy"] == "SFT"][["kl", "seconds_per_update"]].isna().all().all()
    # every policy's summaries scored by its seed's reward model (SFT's comes from the online runs)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model)
    expected = reward_scores(model, tokenizer, QUERIES, [r for r, _ in rows_with(1)], [True] * 4).mean()  # (no column)
    assert runs.loc[0, "rm_score"] == pytest.approx(expected, abs=1e-6)

    table = pd.read_csv(os.path.join(out, "compare_table_full.csv")).set_index("policy")
    assert table.loc["PPO", "win_rate"] == pytest.approx(10 / 12)
    assert table.loc["PPO", "win_rate_per_seed"] == "0.75 0.75 1"
    half = 4.302653 * np.std([0.75, 0.75, 1.0], ddof=1) / 3 ** 0.5
    assert table.loc["PPO", ["win_rate_ci_low", "win_rate_ci_high"]].tolist() == pytest.approx(
        [10 / 12 - half, 10 / 12 + half], abs=1e-5)
    assert table.loc["PPO", "win_rate_minus_sft"] == pytest.approx(0.5) and table.loc["PPO", "win_rate_vs_sft"] == "beats SFT"
    assert table.loc["RLOO k=2", "win_rate_minus_sft"] == pytest.approx(-0.25)
    assert table.loc["RLOO k=2", "win_rate_vs_sft"] == "not resolved"
    assert table.loc["GRPO k=4", "win_rate_vs_sft"] == "below SFT" and pd.isna(table.loc["SFT", "win_rate_vs_sft"])
    assert table.loc["RLOO k=2", "seconds_vs_ppo"] == pytest.approx(0.9)
    for ext in ("png", "pdf"):
        assert os.path.getsize(os.path.join(out, f"compare.{ext}")) > 0
    # what each method states of the post, slot by slot (the real gold judge's reading): GOOD states all five
    # facts right, MID the relation, the problem and the ask, POOR the relation and the problem
    assert runs.loc[3, ["duration_right", "duration_wrong", "ask_right"]].tolist() == [0.75, 0.0, 1.0]  # PPO seed 1
    facts = pd.read_csv(os.path.join(out, "compare_facts.csv")).set_index("method")
    assert list(facts.index) == ["SFT", "PPO", "RLOO k=2", "GRPO k=4", "control"]
    assert facts.loc["PPO", "duration right / wrong"] == "0.83 / 0.00"  # (3 + 3 + 4) / 12 GOOD
    assert facts.loc["SFT", "feeling right / wrong"] == "0.33 / 0.00"  # (1 + 1 + 2) / 12
    assert facts.loc["control", ["relation right / wrong", "ask right / wrong"]].tolist() == ["1.00 / 0.00", "0.00 / 0.00"]
    # where the time goes, per online method: the median of each phase's seconds, mean over seeds
    phases = pd.read_csv(os.path.join(out, "compare_phases.csv")).set_index("policy")
    assert list(phases.index) == ["PPO", "RLOO k=2", "GRPO k=4", "control"]
    assert phases.loc["PPO", "update"] == pytest.approx(10.0) and phases.loc["PPO", "generation"] == pytest.approx(1.0)
    assert phases.loc["RLOO k=2", "value_forward"] == 0.0 and phases.loc["PPO", "value_forward"] == pytest.approx(0.5)


def test_paired_gold_known_answers(tmp_path, checkpoints, monkeypatch):
    """The headline: per run the mean gold score minus its seed's SFT's, paired per prompt (bootstrap
    interval over prompts) with the head-to-head rate; per method the mean over seeds with its
    t-interval and verdict; compare_summary.csv's columns and labels."""
    _, reward_model = checkpoints
    monkeypatch.setattr(compare_table, "gold_score", words)
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    # DPO: MID on every prompt, an offline method (no KL)
    tables = {exp_name: [rows_with(w) for w in wins] for exp_name, wins in WINS.items()}
    tables.update(dpo=[rows_with(0)] * 3, ppo_control=[CONTROL_ROWS] * 3)
    for exp_name, per_seed in tables.items():
        for seed, rows in zip((1, 2, 3), per_seed):
            write_run(runs_dir, exp_name, seed, rows, reward_model, reward_model)
    compare_table.main(compare_table.Args(runs_dir=runs_dir, run_glob="scaling_m_*", out=out))

    runs = pd.read_csv(os.path.join(out, "compare_runs.csv"))
    # the headline columns lead, after the run
    assert list(runs.columns[:12]) == [
        "policy", "base_model", "seed", "run_name", "rows", "gold_minus_sft", "gold_minus_sft_ci_low",
        "gold_minus_sft_ci_high", "head_to_head_sft", "head_to_head_sft_ci_low", "head_to_head_sft_ci_high", "gold"]
    runs = runs.set_index(["policy", "seed"])
    # mean gold: SFT seed 1 writes GOOD MID MID MID -> (16 + 3 x 10) / 4; seed 3 GOOD GOOD MID MID -> 13
    assert runs.loc[("SFT", 1), "gold"] == 11.5 and runs.loc[("SFT", 3), "gold"] == 13.0
    assert runs.loc[("control", 1), "gold"] == 3.0
    # PPO seed 1 (GOOD GOOD GOOD MID) - SFT seed 1 per prompt: 0 +6 +6 0 -> +3, head to head T W W T -> 0.75
    ppo = runs.loc[("PPO", 1)]
    assert ppo["gold_minus_sft"] == 3.0 and ppo["head_to_head_sft"] == 0.75
    assert (ppo["gold_minus_sft_ci_low"], ppo["gold_minus_sft_ci_high"]) == pytest.approx(
        win_rates.bootstrap_interval(np.array([0.0, 6.0, 6.0, 0.0])))
    assert (ppo["head_to_head_sft_ci_low"], ppo["head_to_head_sft_ci_high"]) == pytest.approx(
        win_rates.wilson_interval(0.75, 4))
    # the control (rows reversed, joined on the query): 3 - (16 10 10 10) -> -8.5, loses every prompt
    control = runs.loc[("control", 1)]
    assert control["gold_minus_sft"] == -8.5 and control["head_to_head_sft"] == 0.0
    assert (control["gold_minus_sft_ci_low"], control["gold_minus_sft_ci_high"]) == pytest.approx(
        win_rates.bootstrap_interval(np.array([-13.0, -7.0, -7.0, -7.0])))
    assert runs.loc[("control", 3), "gold_minus_sft"] == -10.0  # 3 - (16 16 10 10)
    assert runs.loc["SFT", ["gold_minus_sft", "head_to_head_sft", "win_rate_minus_sft", "length_minus_sft"]] \
        .isna().all().all()
    # per run, the win rate and the length minus its seed's SFT's
    from transformers import AutoTokenizer

    from rlhf_scaling_plot import response_lengths

    good, mid, poor = response_lengths([GOOD, MID, POOR], AutoTokenizer.from_pretrained(reward_model))
    assert runs.loc[("PPO", 1), "win_rate_minus_sft"] == 0.5
    assert runs.loc[("PPO", 1), "length_minus_sft"] == pytest.approx((3 * good + mid - good - 3 * mid) / 4)
    assert runs.loc[("control", 3), "length_minus_sft"] == pytest.approx(poor - (2 * good + 2 * mid) / 4)

    # per method: the mean over seeds of the per-seed paired differences, with the 95% t-interval
    table = pd.read_csv(os.path.join(out, "compare_table_full.csv")).set_index("policy")
    assert table.loc["PPO", "gold_minus_sft_per_seed"] == "3 3 3"
    assert table.loc["PPO", ["gold_minus_sft", "gold_minus_sft_ci_low", "gold_minus_sft_ci_high"]].tolist() == [3, 3, 3]
    assert table.loc["PPO", "gold_vs_sft"] == "beats SFT"
    # RLOO k=2 (0 1 0 wins against SFT's 1 1 2): -1.5, 0, -3 -> -1.5 -+ 4.3027 x 1.5 / sqrt(3)
    half = 4.302653 * 1.5 / 3 ** 0.5
    assert table.loc["RLOO k=2", ["gold_minus_sft", "gold_minus_sft_ci_low", "gold_minus_sft_ci_high"]].tolist() == \
        pytest.approx([-1.5, -1.5 - half, -1.5 + half], abs=1e-4)
    assert table.loc["RLOO k=2", "gold_vs_sft"] == "not resolved"
    # control: -8.5, -8.5, -10 -> -9 -+ 4.3027 x std / sqrt(3), std = sqrt(0.75)
    half = 4.302653 * 0.75 ** 0.5 / 3 ** 0.5
    assert table.loc["control", ["gold_minus_sft", "gold_minus_sft_ci_low", "gold_minus_sft_ci_high"]].tolist() == \
        pytest.approx([-9.0, -9.0 - half, -9.0 + half], abs=1e-4)
    assert table.loc["control", "gold_vs_sft"] == "below SFT" and pd.isna(table.loc["SFT", "gold_vs_sft"])
    assert table.loc["control", "gold"] == 3.0 and table.loc["SFT", "gold"] == pytest.approx((11.5 + 11.5 + 13) / 3)
    assert table.loc["DPO", "gold_minus_sft"] == pytest.approx((-1.5 - 1.5 - 3) / 3)

    # the readable table leads with the paired gold difference and its verdict
    readable = pd.read_csv(os.path.join(out, "compare_table.csv")).set_index("method")
    assert list(readable.columns[2:5]) == ["gold minus SFT, paired [95% CI]", "vs SFT", "per seed"]
    assert readable.loc["PPO", "gold minus SFT, paired [95% CI]"] == "+3.000 [3.000, 3.000]"
    assert readable.loc["control", "gold minus SFT, paired [95% CI]"] == \
        f"-9.000 [{-9.0 - half:.3f}, {-9.0 + half:.3f}]"
    assert readable.loc["control", "vs SFT"] == "below SFT"
    assert readable.loc["PPO", "gold win rate vs reference [95% CI]"].startswith("0.833 [")
    md = open(os.path.join(out, "compare_table.md")).read()
    assert "| pythia-tiny-m | PPO | 1 2 3 | +3.000 [3.000, 3.000] | beats SFT | 3 3 3 | " in md

    # compare_summary.csv: one row per method but SFT, exactly these columns and labels
    summary = pd.read_csv(os.path.join(out, "compare_summary.csv"))
    assert list(summary.columns) == ["method", "seeds", "gold_minus_sft", "gold_minus_sft_low", "gold_minus_sft_high",
                                     "win_rate_minus_sft", "length_minus_sft", "kl"]
    assert summary["method"].tolist() == ["PPO", "DPO", "RLOO k=2", "GRPO k=4", "control"]
    summary = summary.set_index("method")
    assert summary["seeds"].tolist() == [3] * 5
    assert summary.loc["control", ["gold_minus_sft", "gold_minus_sft_low", "gold_minus_sft_high"]].tolist() == \
        pytest.approx([-9.0, -9.0 - half, -9.0 + half], abs=1e-4)
    assert summary.loc["control", "win_rate_minus_sft"] == pytest.approx(-1 / 3)
    assert summary.loc["PPO", "length_minus_sft"] == pytest.approx((good - mid) / 2)
    assert summary.loc["PPO", "kl"] == pytest.approx(3.0) and pd.isna(summary.loc["DPO", "kl"])
    assert open(os.path.join(out, "compare_summary.csv")).read().splitlines()[2].endswith(",")  # DPO's kl: empty
