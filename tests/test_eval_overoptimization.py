"""eval/overoptimization.py on a fake run whose gold score peaks at a known update while the proxy keeps
rising, with known KL, entropy and length histories: the peak, its KL and when each signal fires."""

import json
import os
import sys

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval"))
import overoptimization


def write_run(runs_dir, name, updates=40, peak=20):
    folder = os.path.join(runs_dir, name)
    os.makedirs(folder)
    with open(os.path.join(folder, "args.json"), "w") as f:
        json.dump({"exp_name": "ppo_left_padding", "base_model": "m", "seed": 1}, f)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in range(1, updates + 1):
            f.write(json.dumps({
                "step": step, "objective/kl": 0.2 * step, "objective/validation_score": 0.1 * step,  # proxy rises
                "objective/scores": 0.5 - 0.02 * step,  # the rollouts' proxy falls (a made-up contrast)
                "eval/gold/score": 3.0 - 0.01 * (step - peak) ** 2,  # gold peaks at `peak`
                "objective/entropy": 2.0 - 0.05 * step, "ppo/val/response_length": 20.0 + 0.5 * step}) + "\n")
        f.write(json.dumps({"step": updates, "eval/scores": 1.0}) + "\n")  # the final eval: no gold per update


def test_gold_peak_and_warning_timing(tmp_path):
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    write_run(runs_dir, "overopt_a")
    os.makedirs(os.path.join(runs_dir, "other"))  # no metrics.jsonl: not an online run, skipped
    overoptimization.main(overoptimization.Args(runs_dir=runs_dir, out=out, smooth=1,
                                                warn=["kl=3", "entropy=0.5", "length_change=0.5"]))
    summary = pd.read_csv(os.path.join(out, "overoptimization.csv")).set_index("run")
    row = summary.loc["overopt_a"]
    assert row["updates"] == 40 and row["peak_update"] == 20 and row["kl_at_peak"] == pytest.approx(4.0)
    assert row["gold_at_peak"] == pytest.approx(3.0) and row["gold_at_end"] == pytest.approx(3.0 - 0.01 * 400)
    assert row["proxy_rise_after_peak"] == pytest.approx(2.0)  # the proxy goes on rising: 2.0 -> 4.0
    assert row["rollout_proxy_at_peak"] == pytest.approx(0.1) and row["rollout_proxy_rise_after_peak"] == pytest.approx(-0.4)
    warnings = pd.read_csv(os.path.join(out, "warnings.csv")).set_index("signal")
    # kl > 3 first at update 16 (0.2 x 16 = 3.2): 4 updates before the peak; entropy < 0.5 at 31 (2 - 1.55 =
    # 0.45): 11 after; length +50% over 20.5 (the first update's) at 22 (31.0 / 20.5 - 1 = 0.51): 2 after
    assert warnings.loc["kl=3", ["fired_at_update", "updates_before_peak"]].tolist() == [16, 4]
    assert warnings.loc["entropy=0.5", ["fired_at_update", "updates_before_peak"]].tolist() == [31, -11]
    assert warnings.loc["length_change=0.5", ["fired_at_update", "updates_before_peak"]].tolist() == [22, -2]
    for ext in ("png", "pdf"):
        assert os.path.getsize(os.path.join(out, f"overoptimization.{ext}")) > 0


def test_smoothing_is_a_centred_average_that_keeps_the_ends():
    values = np.array([0.0, 3.0, 0.0, 3.0, 0.0])
    assert overoptimization.smoothed(values, 3).tolist() == pytest.approx([1.5, 1.0, 2.0, 1.0, 1.5])
    assert overoptimization.smoothed(values, 1).tolist() == values.tolist()


def test_no_gold_judge_is_an_error(tmp_path):
    runs_dir = tmp_path / "runs"
    (runs_dir / "real").mkdir(parents=True)
    (runs_dir / "real" / "metrics.jsonl").write_text(json.dumps({"step": 1, "objective/kl": 0.1}) + "\n")
    with pytest.raises(SystemExit, match="no online run with eval/gold/score"):
        overoptimization.main(overoptimization.Args(runs_dir=str(runs_dir), out=str(tmp_path / "out")))
