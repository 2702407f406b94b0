"""The refusals before a run builds anything (start_run makes them first): nothing here changes a
result; it stops a run that would fail later, or silently, and says why.

- `cuda_problem`: nvidia-smi lists GPUs that torch cannot see (a CPU build of torch, or a CUDA build
  newer than the driver);
- `check_settings`: settings that cannot work;
- `lock_output_dir` keeps a second run out of a folder in use, `check_fresh_start` keeps a new run
  out of an earlier run's checkpoints and logs.
"""

import errno
import fcntl
import os
import platform
import subprocess
import time
import warnings
from typing import Optional

import torch


# the oldest NVIDIA driver (Linux) that runs a CUDA major version's builds (CUDA 12's minor-version
# compatibility covers 12.0-12.9 from R525)
MINIMUM_DRIVER = {12: 525, 13: 580}


def nvidia_smi_gpus() -> list:
    """(name, driver version) of each GPU nvidia-smi lists; none where it is missing or fails."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if listed.returncode:
        return []
    return [tuple(part.strip() for part in line.rsplit(",", 1)) for line in listed.stdout.splitlines() if line.strip()]


def cuda_problem() -> Optional[str]:
    """Why this process would run on the CPU although the node has GPUs: nvidia-smi lists some that
    torch cannot see (a CPU build of torch, or a CUDA build newer than the driver). None where torch
    sees a GPU, nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them on purpose."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_available() or (hidden is not None and hidden.strip() in ("", "-1")):
        return None
    gpus = nvidia_smi_gpus()
    if not gpus:
        return None
    name, driver = gpus[0] if len(gpus[0]) == 2 else (gpus[0][0], "unknown")
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU build"
    else:
        major = int(torch.version.cuda.split(".")[0])
        why = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, which needs NVIDIA driver "
               f"{MINIMUM_DRIVER.get(major, '(see NVIDIA)')} or newer, and this node's driver is {driver}")
    return (f"nvidia-smi lists {len(gpus)} GPU(s) ({name}, driver {driver}) but torch sees none: {why}. Install a "
            "torch built for a CUDA this driver runs (docs/real_pipeline.md, the driver requirement), or set "
            "ACCELERATE_USE_CPU=1 to run on the CPU on purpose")


# settings that must be at least 1 wherever a stage has them (0 ended in a library traceback)
POSITIVE_SETTINGS = ("response_length", "local_rollout_forward_batch_size", "local_generation_batch_size",
                     "keep_checkpoints")


def check_settings(args) -> None:
    for name in POSITIVE_SETTINGS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if args.checkpoint_every < 0:
        raise ValueError(f"--checkpoint_every must be >= 0 (0: only on a stop signal), got {args.checkpoint_every}")


# what lockf raises where another process holds the lock (POSIX allows either)
LOCK_HELD = (errno.EAGAIN, errno.EACCES)


def lock_output_dir(output_dir: str):
    """An exclusive lock on <output_dir>/.lock for this run (held by the main process), or an error
    naming the run that holds it: two runs writing checkpoints and a model into one folder would
    overwrite each other's. The operating system drops the lock when the process ends, however it
    ends, so a crashed run leaves no stale lock behind. (A POSIX lock: a second run started inside
    the same Python process, as the tests do, shares it.) On a filesystem that cannot lock (some NFS
    and FUSE mounts: ENOLCK, EOPNOTSUPP, EINVAL ...) the run goes on unguarded, with a warning."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        handle = open(os.path.join(output_dir, ".lock"), "a+")
    except OSError as e:  # (a path through a file, a read-only or unwritable place, a full disk)
        raise OSError(e.errno, f"--output_dir {output_dir} cannot be created or written: {e.strerror} "
                               f"({e.filename})") from None
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in LOCK_HELD:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise RuntimeError(f"--output_dir {output_dir} is in use by a running {holder}: two runs writing one "
                               "folder would overwrite each other's checkpoints and model. Wait for it, stop it, or "
                               "choose another --output_dir") from None
        # locking unsupported here: refusing would stop every run on this filesystem, so it runs unguarded
        warnings.warn(f"--output_dir {output_dir}: its filesystem cannot lock {handle.name} "
                      f"({errno.errorcode.get(e.errno, e.errno)}: {e.strerror}), so a second run started into this "
                      "folder would not be stopped, and the two would overwrite each other's checkpoints and model. "
                      "Running on without the lock", RuntimeWarning, stacklevel=2)
    handle.seek(0)
    handle.truncate()
    handle.write(f"run (pid {os.getpid()} on {platform.node()}, started {time.strftime('%Y-%m-%d %H:%M:%S')})")
    handle.flush()
    return handle


def check_fresh_start(args) -> None:
    """A run without --resume starts only where no earlier run would be mixed into it: in an
    --output_dir holding another run's checkpoints, the newest checkpoint would be that run's (it
    sorts after this run's first one, which `--keep_checkpoints` then prunes), and after a crash
    --resume would continue the old run; a run folder runs/<--run_name> that already holds logs
    would get this run's metrics appended to the old ones and a second TensorBoard event file."""
    if args.resume:
        return
    folder = os.path.join(args.output_dir, "checkpoints") if args.output_dir else None
    names = sorted(n for n in os.listdir(folder) if n.startswith("update-")) if folder and os.path.isdir(folder) else []
    if names:
        raise FileExistsError(f"--output_dir {args.output_dir} holds checkpoints of an earlier run (newest: "
                              f"{names[-1]}), and --resume was not given. --resume continues that run; to start over, "
                              f"delete {folder} or choose another --output_dir")
    logs = os.path.join("runs", args.run_name) if args.run_name else None
    if logs and os.path.isdir(logs) and os.listdir(logs):
        raise FileExistsError(f"--run_name {args.run_name}: {logs} already holds a run's logs, which this run would "
                              f"append to. Choose another --run_name, or delete {logs}")
