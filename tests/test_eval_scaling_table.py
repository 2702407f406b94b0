"""eval/scaling_table.py: the sweep's results table from the tables eval/ wrote (known answers)."""

import os
import sys

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval"))
import scaling_table  # noqa: E402
from common import seed_summary, write_table  # noqa: E402

SIZES = {"models/tiny/pythia-tiny-s": 231168, "models/tiny/pythia-tiny-m": 658944, "models/tiny/pythia-tiny-l": 1728192}


def per_seed(values: dict, **columns) -> pd.DataFrame:
    """{base_model: [value of seed 1, 2, 3]} -> the one-row-per-seed frame eval/ summarises."""
    return pd.DataFrame([{"base_model": b, "model_size": SIZES[b], "seed": seed + 1, "value": v, **columns}
                         for b, vs in values.items() for seed, v in enumerate(vs)])


def summary(values: dict, **columns) -> pd.DataFrame:
    return seed_summary(per_seed(values, **columns), ["base_model", "model_size", *columns])


@pytest.fixture
def plots_dir(tmp_path):
    s, m, l = SIZES  # noqa: E741
    write_table(summary({s: [0.3, 0.4, 0.35], m: [0.5, 0.55, 0.6], l: [0.6, 0.62, 0.64]}), tmp_path, "rouge_score_plot")
    write_table(pd.concat([summary({s: [0.6, 0.6, 0.6], m: [0.62, 0.63, 0.64], l: [0.66, 0.65, 0.67]}, split="validation"),
                           summary({s: [0.6, 0.61, 0.62], m: [0.63, 0.6, 0.6], l: [0.6, 0.6, 0.6]}, split="validation_cnndm")]),
                tmp_path, "rm_scale_plot")
    sft = {s: [0.0, 0.01, 0.02], m: [0.2, 0.1, 0.15], l: [0.25, 0.2, 0.3]}
    ppo = {s: [0.0, 0.0, 0.0], m: [0.3, 0.1, 0.2], l: [0.4, 0.3, 0.2]}
    write_table(pd.concat([summary(sft, policy="SFT"), summary(ppo, policy="PPO")]), tmp_path, "rlhf_scale_plot")
    runs = pd.concat([per_seed(sft, policy="SFT"), per_seed(ppo, policy="PPO")]).rename(columns={"value": "win_rate"})
    # PPO's paired gold difference to its seed's SFT (rlhf_scaling_plot's gold_minus_sft; NaN for SFT)
    gold_gain = {s: [-0.1, 0.0, 0.1], m: [0.2, 0.3, 0.4], l: [0.5, 0.6, 0.4]}
    runs["gold_minus_sft"] = [np.nan] * 9 + [v for vs in gold_gain.values() for v in vs]
    write_table(runs, tmp_path, "rlhf_scale_plot_runs")
    return tmp_path


def test_results_table_known_answers(plots_dir):
    scaling_table.main(scaling_table.Args(plots_dir=str(plots_dir)))
    table = pd.read_csv(plots_dir / "scaling_table.csv").set_index("metric")
    assert list(table.columns) == ["231K (pythia-tiny-s)", "659K (pythia-tiny-m)", "1.73M (pythia-tiny-l)", "check"]
    # mean [mean -+ t(0.975, 2) x std / sqrt(3)] (each seed)
    assert table.loc["SFT ROUGE-L (validation)", "231K (pythia-tiny-s)"] == "0.350 [0.226, 0.474] (0.300, 0.400, 0.350)"
    checks = table["check"].to_dict()
    assert checks["SFT ROUGE-L (validation)"] == "rises with size"
    assert checks["RM accuracy, TL;DR validation"] == "rises with size"
    assert checks["RM accuracy, OOD (CNN/DM role)"] == "does not rise"  # means 0.61, 0.61, 0.60
    assert checks["PPO gold-judge win rate"] == "rises with size"
    # PPO - SFT per seed: s -0.01 mean, m +0.05 (0.1, 0, 0.05), l +0.05 (0.15, 0.1, -0.1)
    gain = table.loc["PPO minus SFT win rate (same seed)"]
    assert gain["659K (pythia-tiny-m)"] == "0.050 [-0.074, 0.174] (0.100, 0.000, 0.050)"
    assert gain["1.73M (pythia-tiny-l)"].startswith("0.050 [-0.279, 0.379] (0.150, 0.100, -0.100)")
    assert gain["check"] == "PPO ahead at pythia-tiny-m, pythia-tiny-l"
    # the paired gold row: the mean of the per-seed differences, PPO ahead at m and l, growing with size
    gold = table.loc["PPO minus SFT, mean gold (paired per prompt, same seed)"]
    assert gold["659K (pythia-tiny-m)"] == "0.300 [0.052, 0.548] (0.200, 0.300, 0.400)"
    assert gold["231K (pythia-tiny-s)"].startswith("0.000 [")
    assert gold["check"] == "PPO ahead at pythia-tiny-m, pythia-tiny-l; the gain grows with size"
    assert list(table.index[-2:]) == ["PPO minus SFT, mean gold (paired per prompt, same seed)",
                                      "PPO minus SFT win rate (same seed)"]
    assert (plots_dir / "scaling_table.md").read_text().startswith("| metric |")


def test_rises_and_missing_sizes(plots_dir):
    assert scaling_table.rises([0.1, 0.2, 0.3]) and not scaling_table.rises([0.1, 0.3, 0.3])
    assert not scaling_table.rises([0.5])  # one size shows no trend
    # a size without PPO runs: an empty cell, and no claim about the trend
    runs = pd.read_csv(plots_dir / "rlhf_scale_plot.csv")
    runs = runs[~((runs["policy"] == "PPO") & (runs["base_model"] == "models/tiny/pythia-tiny-l"))]
    write_table(runs, plots_dir, "rlhf_scale_plot")
    table = scaling_table.results_table(scaling_table.long_table(str(plots_dir))).set_index("metric")
    assert table.loc["PPO gold-judge win rate", "1.73M (pythia-tiny-l)"] == ""
    assert table.loc["PPO gold-judge win rate", "check"] == "does not rise"
    assert not np.isnan(scaling_table.long_table(str(plots_dir))["mean"]).any()


def test_missing_eval_tables_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="rouge_score_plot.csv is missing: run eval/sft_rm_scale.py"):
        scaling_table.long_table(str(tmp_path))
