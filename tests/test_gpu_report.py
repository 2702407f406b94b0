"""benchmarks/gpu_report.py (`make gpu-report`): what it runs on a GPU machine, that it refuses to run
without CUDA, and its whole plumbing on the CPU at tiny shapes (so it cannot rot between GPU runs)."""

import functools
import importlib.util
import os
import subprocess
import sys
import time

import forked_launches
import pytest
from conftest import side_by_side, subprocess_with

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_report.py")
_spec = importlib.util.spec_from_file_location("gpu_report", SCRIPT)
gpu_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_report)


def test_without_cuda_it_says_so_and_runs_nothing(tmp_path):
    result = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "report")], capture_output=True,
                            text=True, env=dict(os.environ, PATH="/usr/bin:/bin"))
    assert result.returncode == 1 and "torch sees no GPU here; nothing ran" in result.stderr
    assert not (tmp_path / "report").exists()


def test_the_gpu_plan_is_the_papers_per_gpu_share():
    """On a GPU: make test-gpu, then ppo_speed at Pythia-1B with 64 queries x 512 + 53 tokens (one GPU's
    share of the paper's 512), one process and ZeRO-2, then ours vs TRL (each with the padded, packed
    and compiled forwards), then the three samplers of asynchronous RLHF, then the log-prob drift, then
    DPO's micro-batch memory."""
    plan = {step.name: step.command for step in gpu_report.steps(gpu_report.Args(out="r"))}
    assert list(plan) == ["test_gpu", "speed", "trl", "async", "drift", "dpo_memory"]
    assert plan["test_gpu"][1:7] == ["-m", "pytest", "-q", "-s", "-rs", "-m"] and plan["test_gpu"][7] == "gpu"
    for name in ("speed", "trl", "async"):
        command = " ".join(plan[name])
        assert "--shapes pythia-1b --query_length 512 --response_length 53 --batch_size 64" in command
    assert "--strategies single zero2" in " ".join(plan["speed"]) and "--mode trl" in " ".join(plan["trl"])
    assert "--strategies single --micro_batch_sizes 16 --samplers sync sequential overlapped" in " ".join(plan["async"])
    assert all("--forwards padded packed compiled" in " ".join(plan[name]) for name in ("speed", "trl"))
    assert plan["dpo_memory"][1].endswith("benchmarks/dpo_memory.py") and plan["dpo_memory"][2:4] == ["--shape",
                                                                                                   "pythia-1b"]
    assert plan["drift"][1].endswith("benchmarks/logprob_drift.py")
    assert plan["drift"][2:] == ["--model", "pythia-1b", "--out", os.path.join(os.path.abspath("r"), "drift")]


@pytest.mark.slow
def test_smoke_report_on_the_cpu(tmp_path, monkeypatch):
    """Every step at tiny shapes, in two reports side by side (each step runs one thread: on the GPU they
    run one after another in one report)."""
    groups = {"benchmarks": ("speed", "trl", "async"), "checks": ("test_gpu", "drift", "dpo_memory")}

    def popen(command, stdout, stderr, cwd, start_new_session, env):  # the steps that are scripts, forked
        if forked_launches.launchable(command) and stderr == subprocess.STDOUT and start_new_session:
            return forked_launches.start(command, cwd, env, log=stdout.name)  # (its own process group)
        return subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=cwd, start_new_session=start_new_session,
                                env=env)

    monkeypatch.setattr(gpu_report, "subprocess", subprocess_with(Popen=popen))
    runs = side_by_side(**{name: functools.partial(gpu_report.main, gpu_report.Args(
        out=str(tmp_path / name), smoke=True, steps=chosen)) for name, chosen in groups.items()})
    reports = {}
    for name, chosen in groups.items():
        assert runs[name].result() == 0
        with open(tmp_path / name / "report.md") as f:
            reports[name] = f.read()
        for step in chosen:
            assert f"## {step}:" in reports[name] and (tmp_path / name / f"{step}.log").exists()
        assert reports[name].count("\nok in ") == len(chosen) and "FAILED" not in reports[name]
    assert "| tiny-s | single | packed | 1 | 4 | fp32 |" in reports["benchmarks"]
    assert "| tiny-s | overlapped | 1 |" in reports["benchmarks"]  # (the worker's seconds and hidden share follow)
    assert "| tiny-s | cpu | 2 | padded, all logits | n/a |" in reports["checks"]  # (no GPU: seconds only)
    assert "1 passed" in reports["checks"]
    drift = reports["checks"][reports["checks"].index("## drift"):]
    # the same tokens at batch 1 and 4 in each dtype the CPU runs, against fp32 at batch 1 (0 there)
    assert "| fp32 | 1 | 32 | 0 | 0 | 0 |" in drift and "| bf16 | 4 | 32 |" in drift


def test_killing_a_group_returns_once_none_of_it_runs(monkeypatch):
    """kill_group waits for the exits, not only the signals: under load a killed process runs on for a
    while (the suite once saw a killed `sleep` still running as the next check came), holding its GPU."""
    group = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    deadline = time.time() + 30
    while len(gpu_report.live_processes_of_group(group.pid)) < 3 and time.time() < deadline:
        time.sleep(0.02)
    live = gpu_report.live_processes_of_group(group.pid)
    assert len(live) == 3 and group.pid in live, live  # bash and its two sleeps
    gpu_report.kill_group(group.pid)
    assert gpu_report.live_processes_of_group(group.pid) == []
    group.wait()
    # a group whose last process exits only at the third look (an idle machine rarely shows the wait)
    looks, signals = [], []
    monkeypatch.setattr(gpu_report, "live_processes_of_group",
                        lambda g: looks.append(g) or ([4321] if len(looks) < 3 else []))
    monkeypatch.setattr(gpu_report.os, "killpg", lambda g, signum: signals.append((g, signum)))
    gpu_report.kill_group(1234)
    assert signals == [(1234, gpu_report.signal.SIGKILL)] and looks == [1234] * 3


def test_a_step_past_its_timeout_is_stopped_with_the_processes_it_launched(tmp_path):
    """--step_timeout_s: a slow step is reported as timed out, and what it launched (a stage holding the
    GPU) is stopped with it, so the next step gets the GPU."""
    pid_file = tmp_path / "child.pid"
    step = gpu_report.Step("slow", ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], "a step that hangs")
    result = gpu_report.run_step(step, str(tmp_path), timeout_s=1)
    assert result["status"] == "TIMED OUT after 1 s" and result["seconds"] < 10
    stat = f"/proc/{int(pid_file.read_text())}/stat"
    # gone, or a zombie waiting for a reaper that a container's init may never be
    assert not os.path.exists(stat) or open(stat).read().rsplit(")", 1)[1].split()[0] == "Z"
    assert gpu_report.run_step(gpu_report.Step("quick", ["true"], ""), str(tmp_path), 0)["status"] == "ok"
    assert gpu_report.run_step(gpu_report.Step("bad", ["false"], ""), str(tmp_path), 0)["status"] == "FAILED (exit 1)"


def test_steps_chooses_a_subset_and_refuses_a_name_it_does_not_know(tmp_path, capsys, monkeypatch):
    """Which steps run (a stand-in for run_step records them: the smoke test above runs them for real)."""
    ran = []
    monkeypatch.setattr(gpu_report, "run_step", lambda step, out, timeout_s: ran.append(step.name) or
                        {"status": "ok", "seconds": 0.0})
    out = str(tmp_path / "report")
    assert gpu_report.main(gpu_report.Args(out=out, smoke=True, steps=("drift", "nonesuch"))) == 2
    assert "--steps: no step named nonesuch" in capsys.readouterr().err and ran == []
    assert gpu_report.main(gpu_report.Args(out=out, smoke=True, steps=("drift", "speed"))) == 0
    assert ran == ["speed", "drift"]  # in the report's order, not the flag's
    with open(os.path.join(out, "report.md")) as f:
        report = f.read()
    assert "## drift:" in report and "## speed:" in report and "## test_gpu:" not in report and "## trl:" not in report
