"""tests/forked_launches.py: a forked launch gives what the real one gives (exit status, every rank's
output, torchrun's environment, a fresh `__main__`), fails and times out as subprocess.run does (its
timeout showing where each process stood), and its CPU seconds, every rank's included, reach
tests/cpu_seconds.py."""

import os
import signal
import subprocess
import sys
import time

import cpu_seconds
import forked_launches
import pytest
from conftest import FORWARDED_SIGNALS, accelerate_launcher

# a stand-in stage: prints what a rank sees, burns BURN_S of CPU, and exits with argv[1]; each line in one
# write, so that two ranks' lines cannot interleave (under PYTHONUNBUFFERED print writes the newline apart)
SCRIPT = """
import os, signal, sys, time
import torch.distributed as dist
say = lambda line, file=sys.stdout: file.write(line + "\\n")
say(f"rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')} main {__name__} argv {sys.argv[1:]} "
      f"omp {os.environ.get('OMP_NUM_THREADS')} threads {__import__('torch').get_num_threads()}")
if "RANK" in os.environ:
    dist.init_process_group("gloo")
    total = __import__("torch").ones(1) * (int(os.environ["RANK"]) + 1)
    dist.all_reduce(total)
    say(f"rank {os.environ['RANK']} sum {total.item():.0f}")
say("to stderr", sys.stderr)
end = time.process_time() + float(os.environ.get("BURN_S", "0"))
while time.process_time() < end:
    pass
if dist.is_initialized():  # every rank burns its whole share before one fails and the launcher stops the rest
    dist.barrier()
if sys.argv[1] == "raise":
    raise ValueError("the stage failed")
if sys.argv[1] == "sleep":
    time.sleep(60)
if sys.argv[1] == "wait":  # for SIGUSR1, as a stage waits for a preemption notice
    def stop(signum, frame):
        say(f"rank {os.environ['RANK']} got {signal.Signals(signum).name}")
        sys.exit(0)
    signal.signal(signal.SIGUSR1, stop)
    open(f"ready-{os.environ['RANK']}", "w").close()
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "stage.py"
    path.write_text(SCRIPT)
    return str(path)


def both(cmd, tmp_path, **env) -> tuple:
    """(the real run, the forked one) of `cmd`, and the CPU seconds the forked one reported."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    if "--multi_gpu" in cmd:
        env["ACCELERATE_USE_CPU"] = "1"
    real = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    before = cpu_seconds._elsewhere[0]
    forked = forked_launches.run(cmd, tmp_path, env, timeout=120)
    return real, forked, cpu_seconds._elsewhere[0] - before


def lines(text: str) -> list:
    return sorted(line for line in text.splitlines() if line.startswith("rank"))


@pytest.mark.parametrize("exit_code", ["0", "raise"])
def test_a_two_process_launch_runs_as_the_real_one_does(script, tmp_path, exit_code):
    cmd = accelerate_launcher(2) + [script, exit_code]
    real, forked, cpu = both(cmd, tmp_path, BURN_S="0.5")
    assert forked.returncode == real.returncode and (real.returncode == 0) == (exit_code == "0")
    assert lines(forked.stdout) == lines(real.stdout)
    assert f"rank 0 of 2 main __main__ argv ['{exit_code}'] omp 1 threads 1" in forked.stdout
    assert "rank 1 sum 3" in forked.stdout  # the two ranks' process group
    # a failing rank's traceback, from the script's frame on, prefixed by torch.distributed (which ranks
    # print it depends on which fails first: the launcher stops the other)
    for result in (real, forked):
        told = [line.split(": ", 1)[1] for line in result.stderr.splitlines() if line.startswith("[rank")]
        assert told[:3] == ([] if exit_code != "raise" else [
            "Traceback (most recent call last):", f'  File "{script}", line 19, in <module>',
            '    raise ValueError("the stage failed")']), result.stderr
    assert "to stderr" in forked.stderr
    assert cpu >= 2 * 0.5  # both ranks' CPU, though they are the zygote's grandchildren


def test_a_script_launched_with_python_and_its_threads(script, tmp_path):
    real, forked, cpu = both([sys.executable, script, "0"], tmp_path, OMP_NUM_THREADS="2", BURN_S="0.3")
    assert forked.returncode == real.returncode == 0
    assert forked.stdout == real.stdout == "rank None of None main __main__ argv ['0'] omp 2 threads 2\n"
    assert cpu >= 0.3


def test_a_launch_past_its_timeout_is_killed_and_shows_where_it_stood(script, tmp_path):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        forked_launches.run(accelerate_launcher(2) + [script, "sleep"], tmp_path,
                            dict(os.environ, ACCELERATE_USE_CPU="1"), timeout=10)
    assert time.monotonic() - start < 30
    # both ranks' stacks, at the script's sleep (its line 21), and the launcher's, waiting for them
    shown = str(timed_out.value)
    assert shown.count(f'File "{script}", line 21 in <module>') == 2, shown
    assert "in torchrun_in_forks" in shown, shown
    assert forked_launches.run([sys.executable, script, "0"], tmp_path, dict(os.environ), timeout=60).returncode == 0


def test_a_signal_to_the_launch_reaches_every_rank(script, tmp_path):
    """As torchrun's agent passes on the signals it handles (PET_SIGNALS_TO_HANDLE, conftest.run_until_signalled)
    to its ranks and then fails the launch."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "PET_SIGNALS_TO_HANDLE": FORWARDED_SIGNALS}
    outcomes = []
    for start in (lambda cmd: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                               env=env, cwd=tmp_path),
                  lambda cmd: forked_launches.start(cmd, tmp_path, env)):
        for rank in (0, 1):
            (tmp_path / f"ready-{rank}").unlink(missing_ok=True)
        process = start(accelerate_launcher(2) + [script, "wait"])
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready-{rank}").exists() for rank in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGUSR1)
        stdout, _ = process.communicate(timeout=60)
        outcomes.append((process.returncode, lines(stdout)))
    assert outcomes[1] == outcomes[0]
    assert outcomes[0][0] != 0 and {"rank 0 got SIGUSR1", "rank 1 got SIGUSR1"} <= set(outcomes[0][1])


def test_only_this_interpreters_launches_are_forked(monkeypatch):
    monkeypatch.delenv("REAL_LAUNCHES", raising=False)
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    assert forked_launches.launchable([accelerate, "launch", "--multi_gpu", "stage.py"])
    assert forked_launches.launchable([sys.executable, "stage.py", "--flag"])
    assert not forked_launches.launchable(["accelerate", "launch", "stage.py"])  # another accelerate on PATH
    assert not forked_launches.launchable([sys.executable, "-m", "pytest"])
    assert not forked_launches.launchable(["bash", "hello_world.sh"])
    monkeypatch.setenv("REAL_LAUNCHES", "1")
    assert not forked_launches.launchable([accelerate, "launch", "--multi_gpu", "stage.py"])


def test_deepspeed_runs_without_compiling_its_cpu_shared_memory_kernel(tmp_path):
    """forked_launches.without_deepspeed_shm_kernel: a forked rank's DeepSpeed backend finds no kernel to
    build (left as it was, the first call compiles it for about 100 CPU seconds and returns the module)."""
    script = tmp_path / "shm.py"
    script.write_text("import importlib\n"
                      "print('kernel', importlib.import_module('deepspeed.comm.torch').build_shm_op())\n")
    forked = forked_launches.run([sys.executable, str(script)], tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"},
                                 timeout=60)
    assert forked.returncode == 0 and "kernel None" in forked.stdout, forked.stderr
