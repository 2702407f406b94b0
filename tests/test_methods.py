"""The registry of methods (summarize_from_feedback_details/methods.tsv): one table that the shell scripts and Python
read alike, refused when a row is malformed, and a new row is all a variant needs to be trained by hello_world.sh
(ALGOS=all, so make compare) and to appear in the results table and eval/'s tables and plots (docs/development.md,
"Adding a method")."""

import os
import re
import subprocess
import sys

import pytest

from summarize_from_feedback_details import methods
from summarize_from_feedback_details.hello_world_report import DPO_AND_ONLINE_METHODS
from test_hello_world_script import BASH, checkout, flag, run, stage_calls  # noqa: F401 (checkout: a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "eval"))
import common  # noqa: E402 (eval/common.py)

HEADER = "# name\trun\tlabel\tscript\tsamples\tflags\n"
# the doc's example: RLOO with the per-token clipped ratio, one row
TOKEN_RATIO_ROW = "rloo_token\trloo_token\tRLOO k=2 token ratio\trloo.py\t2\t--token_level_ratio --exp_name rloo_token\n"


def shell(command: str) -> str:
    """What one of sbatches/methods.sh's functions prints."""
    result = subprocess.run([BASH, "-c", f"source sbatches/methods.sh; {command}"], cwd=ROOT, capture_output=True,
                            text=True, check=True)
    return result.stdout.strip()


def test_shell_and_python_read_the_same_rows():
    names, rloo_names, sampled = (shell(c) for c in ("method_names", "method_names rloo.py", "sampled_method_names"))
    assert names.split() == [m.name for m in methods.METHODS] == ["ppo", "dpo", "rloo", "rloo_k4", "grpo",
                                                                   "online_dpo", "control", "null_control"]
    assert rloo_names.split() == [m.name for m in methods.METHODS if m.script == "rloo.py"]
    assert sampled.split() == [m.name for m in methods.METHODS if m.samples is not None]
    for method in methods.METHODS:
        script, samples, *flags = shell(f"method_row {method.name}").split()
        assert (script, samples, tuple(flags)) == (method.script, str(method.samples or "-"), method.flags)
    assert shell("method_row nothing") == ""
    # the results table and eval/ list the registry's rows, in its order
    assert DPO_AND_ONLINE_METHODS == tuple((m.label, m.run) for m in methods.METHODS)
    assert common.OTHER_METHODS == ["rloo=RLOO k=2", "rloo_k4=RLOO k=4", "grpo=GRPO k=4", "online_dpo=online DPO",
                                    "ppo_control=control", "ppo_null_control=null control"]


@pytest.mark.parametrize("row, message", [
    ("x\tx\tX\trloo.py\t2\n", "5 tab-separated fields, not 6"),
    ("x\tx\tX\trloo.py\t0\t\n", "samples must be a whole number >= 1 or '-', not '0'"),
    ("x\tx\tX\tnowhere.py\t2\t\n", "x: no stage file nowhere.py"),
    ("rloo_tok\trloo_tok\tX\trloo.py\t2\t--token_level_ratio\n", "its run (rloo_tok) and exp_name (rloo) must be its "
                                                                 "name (add --exp_name rloo_tok to its flags)"),
    ("k4\tk4\tX\trloo.py\t2\t--rloo_k 4 --exp_name k4\n", "k4: --rloo_k 4 but samples 2"),
    ("rloo\trloo\tPPO\trloo.py\t2\t\n", "two rows share a label"),
])
def test_a_malformed_row_is_refused(tmp_path, row, message):
    registry = tmp_path / "methods.tsv"
    registry.write_text(HEADER + "ppo\tppo\tPPO\tppo_left_padding.py\t-\t\n" + row)
    with pytest.raises(ValueError, match=re.escape(message)):
        methods.read_methods(registry)


def test_a_new_row_is_trained_by_hello_world_and_listed_by_eval(checkout, tmp_path):
    """The doc's walk-through: one row for RLOO with the per-token ratio. hello_world.sh ALGOS=all (what make compare
    runs per seed) then trains it after online DPO at PPO's budget, with its flags, in its own folders; ALGOS names
    it alone; and the registry read from that file lists it for the results table and eval/ (their OTHER_METHODS:
    make compare's table and plots)."""
    with open(os.path.join(ROOT, "docs", "development.md")) as doc:
        assert TOKEN_RATIO_ROW.strip() in doc.read()  # (the row the doc walks through)
    registry = checkout / "summarize_from_feedback_details" / "methods.tsv"
    rows = registry.read_text().splitlines(keepends=True)
    rows.insert(rows.index(next(r for r in rows if r.startswith("control\t"))), TOKEN_RATIO_ROW)
    registry.write_text("".join(rows))
    result, calls = run(checkout, 0, ALGOS="all")
    assert result.returncode == 0, result.stderr
    trained = [os.path.basename(flag(c, "--output_dir")) for c in calls if any(a.endswith(".py") for a in c)
               and "--output_dir" in c]
    assert trained.index("rloo_token") == trained.index("online_dpo") + 1 and trained[-2:] == ["ppo_control", "ppo_null_control"]
    (token,) = [c for c in stage_calls(calls, "rloo.py") if "--token_level_ratio" in c]
    assert flag(token, "--exp_name") == "rloo_token" and flag(token, "--output_dir") == "models/hello_world/rloo_token"
    assert flag(token, "--local_rollout_forward_batch_size") == "32"  # (64 episodes / 2 samples)
    result, calls = run(checkout, 0, ALGOS="rloo_token", NAME="alone")  # (a new NAME: nothing to skip)
    assert result.returncode == 0 and len(stage_calls(calls, "rloo.py")) == 1
    added = methods.read_methods(registry)
    assert [f"{m.run}={m.label}" for m in added if m.name not in ("ppo", "dpo")][-3:] == [
        "rloo_token=RLOO k=2 token ratio", "ppo_control=control", "ppo_null_control=null control"]
    assert ("RLOO k=2 token ratio", "rloo_token") in [(m.label, m.run) for m in added]
