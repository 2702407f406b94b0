"""Launched runs without the cost of starting Python: the suite's `accelerate launch` and `python
script.py` runs, forked from a process that has already imported what a stage imports.

A stage's rank spends 8-10 of its 12-16 CPU seconds on a tiny run importing torch, transformers,
peft and DeepSpeed, and `accelerate launch` adds a launcher and torchrun's agent that import torch
again (measured in docs/development.md). Here each pytest worker starts one *zygote* once: a fresh
interpreter that imports those modules and does nothing else (no tensor op, no thread), then forks on
request. A launch is a forked child that runs accelerate's own launcher code on the command line
(its parser, its checks, the environment it prepares, DeepSpeed's included) with torchrun's agent
replaced by forking one child per rank, given the environment torchrun gives its workers, and passing
on the signals torchrun passes on (its --signals_to_handle); each rank runs the script as `__main__`,
as `python script.py` would. What stays real: every rank is its own process with its own process
group (gloo), DeepSpeed engine, signal handlers and output. What differs: imports happened before the
launch's environment was set (a launch asking for other threads than the zygote's gets them through
torch.set_num_threads), DeepSpeed's collectives on the CPU skip its shared-memory kernel
(`without_deepspeed_shm_kernel`), and torchrun's agent itself is not under test (the Slurm tests,
`make test-slurm`, launch for real; REAL_LAUNCHES=1 makes the suite do so too).

The zygote reports each launch's CPU seconds, its ranks included, to tests/cpu_seconds.py, and the
CPU its own start took to the test that started it."""

import atexit
import faulthandler
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from unittest import mock

# a launch that outlives its timeout is sent this first: every process of it (the launcher and its ranks)
# prints its threads' Python stacks into its stderr, which the TimeoutExpired then shows (a hang in CI is
# rare and does not come again on demand: the failure must say where it stood)
STACKS_SIGNAL = signal.SIGRTMIN + 3

# what a stage's rank imports (the stage modules pull the rest: torch, transformers, peft, datasets)
PRELOADED = ("deepspeed", "accelerate.commands.launch", "torch.distributed.run", "deepspeed.launcher.runner",
             *(f"summarize_from_feedback_details.{stage}"
               for stage in ("tldr_dataset", "sft", "reward", "ppo_left_padding", "dpo", "rloo", "online_dpo")))


def launchable(cmd: list) -> bool:
    """`accelerate launch ...` or `python script.py ...` with this interpreter: what the zygote runs
    (unless REAL_LAUNCHES=1)."""
    if os.environ.get("REAL_LAUNCHES") == "1":
        return False
    if os.path.basename(cmd[0]) == "accelerate" and cmd[1:2] == ["launch"]:
        return os.path.dirname(cmd[0]) == os.path.dirname(sys.executable)
    return cmd[0] == sys.executable and len(cmd) > 1 and cmd[1].endswith(".py")


# ----- in the zygote's children -----------------------------------------------------------------------

def exit_code_of(exc: BaseException) -> int:
    """The exit status Python gives an uncaught `exc`, printing it as Python would: through sys.excepthook
    (torch.distributed's prefixes each line with the rank)."""
    if isinstance(exc, SystemExit):
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    sys.excepthook(type(exc), exc, exc.__traceback__)
    return 1


def end_process(code: int):
    """Leave a forked child as an interpreter would (its exit handlers run, its output flushed), without
    returning into the zygote's loop."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def run_as_main(argv: list):
    """`python argv[0] argv[1:]` in this (forked) process; never returns."""
    code = 0
    try:
        if "OMP_NUM_THREADS" in os.environ:  # read by OpenMP once, at the zygote's import of torch
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    except BaseException as exc:
        traceback = exc.__traceback__  # from the script's first frame on, as Python prints it
        while traceback and traceback.tb_frame.f_code.co_filename != argv[0]:
            traceback = traceback.tb_next
        code = exit_code_of(exc.with_traceback(traceback or exc.__traceback__))
    end_process(code)


def torchrun_in_forks(torchrun_args):
    """Stands in for torch.distributed.run.run on one machine: a forked process per rank with the
    environment torchrun gives its workers (rank 0 hosts the rendezvous store, as without an agent);
    the first rank to fail stops the others and fails the launch, as torchrun's agent does."""
    world = int(torchrun_args.nproc_per_node)
    if str(torchrun_args.nnodes) not in ("1", "1:1"):
        raise ValueError("forked launches run on one machine")
    common = dict(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                  ROLE_NAME="default", ROLE_WORLD_SIZE=str(world), MASTER_ADDR=torchrun_args.master_addr,
                  MASTER_PORT=str(torchrun_args.master_port), TORCHELASTIC_RESTART_COUNT="0",
                  TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none")
    if world > 1 and "OMP_NUM_THREADS" not in os.environ:
        common["OMP_NUM_THREADS"] = "1"  # torchrun's default for several workers
    ranks, signalled = [], []
    handled = [getattr(signal, name.strip()) for name in torchrun_args.signals_to_handle.split(",")]

    def forward(signum, frame):  # torchrun's agent passes on the signals it handles, then fails the launch
        signalled.append(signum)
        for pid in ranks:
            os.kill(pid, signum)

    for signum in handled:
        signal.signal(signum, forward)
    for rank in range(world):
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for signum in handled:
                signal.signal(signum, signal.SIG_DFL)
            os.environ.update(common, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            run_as_main([torchrun_args.training_script, *torchrun_args.training_script_args])
        ranks.append(pid)
    failed = None
    while ranks:
        pid, status = os.wait()
        ranks.remove(pid)
        if os.waitstatus_to_exitcode(status) != 0 and failed is None:
            failed = os.waitstatus_to_exitcode(status)
            for other in ranks:
                os.kill(other, signal.SIGTERM)
    if signalled:
        # torchrun's agent raises this one: accelerate >= 1.16 turns it into the exit status 128 + the signal
        from torch.distributed.elastic.multiprocessing.api import SignalException

        sigval = signal.Signals(signalled[0])
        raise SignalException(f"the launch got {sigval.name}", sigval=sigval)
    if failed is not None:
        raise RuntimeError(f"a rank exited with {failed}")


def launch(cmd: list):
    """In a forked child of the zygote, whose environment and folder are the launch's: `cmd`; never returns."""
    if cmd[0] == sys.executable:
        run_as_main(cmd[1:])
    code = 0
    try:
        from accelerate.commands.launch import launch_command, launch_command_parser
        import torch.distributed.run

        sys.argv = ["accelerate", *cmd[1:]]
        with mock.patch.object(torch.distributed.run, "run", torchrun_in_forks):
            launch_command(launch_command_parser().parse_args(cmd[2:]))
    except BaseException as exc:
        code = exit_code_of(exc)
    end_process(code)


def serve(requests, replies):
    """The zygote's loop: a request (one JSON line: id, cmd, cwd, env, stdout and stderr paths) forks a
    launch in its own process group and is answered with its pid at once, and with its exit code and CPU
    seconds (its ranks' included) when it ends. Ends when the requests' pipe closes."""
    running, buffer = {}, b""
    while True:
        readable, _, _ = select.select([requests], [], [], 0.05)
        if readable:
            chunk = os.read(requests, 65536)
            if not chunk:
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush(), sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    os.setpgid(0, 0)
                    os.close(requests), os.close(replies)  # stdin stays /dev/null
                    opened = {path: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # one file: one offset
                              for path in {request["stdout"], request["stderr"]}}
                    os.dup2(opened[request["stdout"]], 1), os.dup2(opened[request["stderr"]], 2)
                    faulthandler.register(STACKS_SIGNAL, file=sys.__stderr__, all_threads=True)
                    os.environ.clear()
                    os.environ.update(request["env"])
                    os.chdir(request["cwd"])
                    launch(request["cmd"])
                running[pid] = request["id"]
                os.write(replies, (json.dumps(dict(id=request["id"], pid=pid)) + "\n").encode())
        while running:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if not pid:
                break
            os.write(replies, (json.dumps(dict(id=running.pop(pid), code=os.waitstatus_to_exitcode(status),
                                               cpu=usage.ru_utime + usage.ru_stime)) + "\n").encode())


def without_deepspeed_shm_kernel():
    """DeepSpeed's collectives on the CPU through torch.distributed (gloo), not DeepSpeed's CPU-only
    shared-memory all-reduce kernel: that kernel is compiled with the C++ compiler on a virtual
    environment's first DeepSpeed run (about 100 CPU seconds on the 2-core CI machine, in whichever test
    comes first), and a GPU run, which the suite's DeepSpeed-on-CPU runs stand in for, never uses it
    (its collectives are torch.distributed's, on NCCL). DeepSpeed takes this path itself where the
    kernel is not compatible (off Linux). REAL_LAUNCHES=1 keeps the kernel."""
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def zygote_main():
    start = time.process_time()
    # the requests' and replies' pipes move off stdin and stdout (the zygote prints nothing; its stderr
    # stays the worker's, for a crash), its children's output goes to the files each request names
    requests, replies = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    for module in PRELOADED:
        __import__(module)
    without_deepspeed_shm_kernel()
    os.write(replies, (json.dumps(dict(ready=time.process_time() - start)) + "\n").encode())
    serve(requests, replies)


# ----- in the pytest worker ---------------------------------------------------------------------------

class Zygote:
    """The worker's side of one zygote process: launches from any thread."""

    def __init__(self):
        import tempfile

        self.outputs = tempfile.mkdtemp(prefix="forked-launches-")
        atexit.register(shutil.rmtree, self.outputs, ignore_errors=True)
        self.process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=os.path.dirname(__file__))
        ready = json.loads(self.process.stdout.readline() or '{"ready": null}')
        if ready["ready"] is None:
            raise RuntimeError(f"the zygote ended before it was ready (exit {self.process.wait()}; stderr above)")
        count_cpu_elsewhere(ready["ready"])
        self.lock, self.next_id, self.replies = threading.Lock(), 0, {}
        threading.Thread(target=self.read_replies, daemon=True).start()

    def read_replies(self):
        for line in self.process.stdout:
            reply = json.loads(line)
            with self.lock:
                self.replies.setdefault(reply["id"], {}).update(reply)

    def reply(self, request_id: int, key: str, timeout: float = 0):
        """The reply's `key` (pid, code, cpu) once it came, waiting up to `timeout`; None if it did not."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                value = self.replies.get(request_id, {}).get(key)
            if value is not None or time.monotonic() >= deadline:
                return value
            time.sleep(0.02)

    def start(self, cmd: list, cwd, env: dict, log: str = None) -> "ForkedProcess":
        with self.lock:
            request_id, self.next_id = self.next_id, self.next_id + 1
            paths = {stream: log or os.path.join(self.outputs, f"{request_id}.{stream}")
                     for stream in ("stdout", "stderr")}
            self.process.stdin.write((json.dumps(dict(id=request_id, cmd=cmd, cwd=str(cwd), env=env, **paths))
                                      + "\n").encode())
            self.process.stdin.flush()
        return ForkedProcess(self, request_id, cmd, paths)


class ForkedProcess:
    """What the suite uses of subprocess.Popen (with stdout and stderr captured as text), for a launch."""

    def __init__(self, zygote: Zygote, request_id: int, args: list, paths: dict):
        self.zygote, self.request_id, self.args, self.paths = zygote, request_id, args, paths
        self.pid, self.returncode = zygote.reply(request_id, "pid", timeout=60), None
        if self.pid is None:
            raise RuntimeError(f"the zygote did not start {args} (exit {zygote.process.poll()})")

    def poll(self):
        if self.returncode is None:
            code = self.zygote.reply(self.request_id, "code")
            if code is not None:
                self.returncode = code
                count_cpu_elsewhere(self.zygote.reply(self.request_id, "cpu"))
        return self.returncode

    def send_signal(self, signum: int):
        if self.poll() is None:
            os.kill(self.pid, signum)

    def wait(self, timeout: float = None) -> int:
        """Its exit status once it ended; TimeoutExpired past `timeout` (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout: float) -> tuple:
        """(stdout, stderr) once it ended; past `timeout` its processes print their stacks (STACKS_SIGNAL), its
        process group is killed and LaunchTimedOut raised with that stderr."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in processes_in_group(self.pid):  # one at a time: their stacks go to one file
                os.kill(pid, STACKS_SIGNAL)
                time.sleep(0.5)
            os.killpg(self.pid, signal.SIGKILL)
            self.wait()
            raise LaunchTimedOut(self.args, timeout, *self.outputs()) from None
        return self.outputs()

    def outputs(self) -> tuple:
        """(stdout, stderr) from the files they went to, which are removed (one file when they were the same)."""
        outputs = []
        for path in self.paths.values():
            with open(path) as f:
                outputs.append(f.read())
        for path in set(self.paths.values()):
            os.remove(path)
        return tuple(outputs)


def processes_in_group(group: int) -> list:
    """The processes of a process group, lowest pid (the launch's first process) first."""
    found = []
    for pid in (int(entry) for entry in os.listdir("/proc") if entry.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:  # pid (comm) state ppid pgrp ...: comm may hold spaces
                if int(f.read().rsplit(")", 1)[1].split()[2]) == group:
                    found.append(pid)
        except OSError:
            continue  # one that ended
    return sorted(found)


class LaunchTimedOut(subprocess.TimeoutExpired):
    """subprocess.TimeoutExpired that shows the end of the launch's stderr: its processes' stacks at the timeout."""

    def __str__(self):
        return f"{super().__str__()}; the end of its stderr, with every process's stacks:\n{self.stderr[-20000:]}"


def count_cpu_elsewhere(seconds: float):
    import cpu_seconds  # the suite's plugin (tests/cpu_seconds.py), imported only in the worker

    cpu_seconds.count_elsewhere(seconds)


_zygote, _zygote_lock = None, threading.Lock()


def start(cmd: list, cwd, env: dict, log: str = None) -> ForkedProcess:
    """subprocess.Popen(cmd, cwd=cwd, env=env, stdout=PIPE, stderr=PIPE, text=True) for a `launchable`
    command, forked from this worker's zygote (started at the first launch); with `log`, its stdout and
    stderr go to that file instead (stdout=open(log, "w"), stderr=STDOUT), and communicate() is not for it."""
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            _zygote = Zygote()
    return _zygote.start(cmd, cwd, env, log)


def run(cmd: list, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True) for a
    `launchable` command."""
    process = start(cmd, cwd, env)
    stdout, stderr = process.communicate(timeout)
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


if __name__ == "__main__":
    zygote_main()
