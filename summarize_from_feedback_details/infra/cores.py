"""Cores a running stage takes over, at an update fixed in advance, once the job beside it has ended.

hello_world.sh runs two chains of stages side by side on a CPU, each on half the cores
(OMP_NUM_THREADS). When the policy's chain ends, the reward model beside it would keep half the
machine idle for the rest of its run, so its chain names the other's marker file in
TAKE_CORES_AT="<threads> <file> <update>": at the end of that update of the stage (or at its start,
when it resumes past it) the stage waits until the file is gone, then runs on <threads> torch threads.
The thread count changes the order of float sums, so a result depends on which updates ran on how
many threads; taking the cores at a fixed update, never at whichever one was running when the other
chain happened to end, keeps a rerun identical to the digit whatever the timing. The price is time:
a core idles between the end of the first of the two (the other chain, or this stage's update) and
the second.
"""

import os
import time
from typing import Callable, Optional

import torch

ENV = "TAKE_CORES_AT"
CHECK_EVERY_SECONDS = 2.0


def parse_spec(spec: Optional[str]) -> tuple:
    """(threads, marker file, update) of a TAKE_CORES_AT value; (None, None, None) when unset or empty."""
    if not spec:
        return None, None, None
    threads, _, rest = spec.partition(" ")
    marker, _, update = rest.rpartition(" ")
    if not (threads.isdigit() and int(threads) >= 1 and marker and update.isdigit()):
        raise ValueError(f"{ENV}={spec!r}: expected '<threads> <marker file> <update>', e.g. '2 /tmp/other_chain 375'")
    return int(threads), marker, int(update)


class CoresAtUpdate:
    """`poll(update)` at the end of each update: from the hand-off update on, waits for the marker
    file to be gone (looking every CHECK_EVERY_SECONDS), then sets torch's thread count, once."""

    def __init__(self, spec: Optional[str], sleep: Optional[Callable[[float], None]] = None):
        self.threads, self.marker, self.update = parse_spec(spec)
        self.sleep = sleep or time.sleep
        self.stopped = False  # whether the last poll gave up waiting for a stop signal

    def poll(self, update: int, stopping: Callable[[], bool] = lambda: False,
             report: Callable[[str], None] = print) -> Optional[int]:
        """`update`: the last update ended (a resumed run's first poll: the one it resumes from). The
        thread count taken by this call, None otherwise; None as well when `stopping()` turns true
        while waiting (a stop signal: the stage stops at its next safe point, and its resume takes
        the cores at its start)."""
        self.stopped = False
        if self.marker is None or update < self.update:
            return None
        if os.path.exists(self.marker):
            report(f"update {update}: waiting for the job beside to end, then on {self.threads} threads "
                   f"(this update is fixed in advance, so that timing changes no result)")
        while os.path.exists(self.marker):
            self.stopped = stopping()
            if self.stopped:
                return None
            self.sleep(CHECK_EVERY_SECONDS)
        self.marker = None
        torch.set_num_threads(self.threads)
        return self.threads
