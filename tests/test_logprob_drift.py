"""benchmarks/logprob_drift.py on a checkpoint and its dataset: the reference row is exactly 0, fp32 at
batch N differs from batch 1 only by float noise, and every dtype the CPU runs gets both batch rows."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import logprob_drift


def test_drift_table_on_the_tiny_default(tiny_datasets, checkpoints, tmp_path):
    sft, _ = checkpoints
    args = logprob_drift.Args(model=sft, queries=os.path.join(tiny_datasets[0], "sft"), rows=4, response_length=8,
                              out=str(tmp_path))
    rows = logprob_drift.drift_table(args)
    logprob_drift.write(rows, args.out)
    by = {(r["dtype"], r["batch"]): r for r in rows}
    assert set(by) == {(d, b) for d in ("fp32", "bf16", "fp16") for b in (1, 4)}
    assert all(r["tokens"] == 4 * 8 for r in rows)
    reference = by[("fp32", 1)]
    assert reference["max_abs_log_ratio"] == 0 and reference["share_outside_0.9_1.1"] == 0
    # left padding and batching change float sums only
    assert by[("fp32", 4)]["max_abs_log_ratio"] < 1e-4
    # bf16 keeps 8 bits of mantissa: it moves the log-probabilities by more than fp32's noise
    assert by[("bf16", 4)]["mean_abs_log_ratio"] > 10 * by[("fp32", 4)]["mean_abs_log_ratio"]
    assert open(os.path.join(args.out, "logprob_drift.md")).read().count("\n") == 2 + 6
    with pytest.raises(SystemExit, match="give --queries"):
        logprob_drift.drift_table(logprob_drift.Args(model=sft, rows=2))
