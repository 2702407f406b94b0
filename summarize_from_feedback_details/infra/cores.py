"""Cores a running stage takes over when another job frees them.

hello_world.sh runs two chains of stages side by side on a CPU, each on half the cores
(OMP_NUM_THREADS). When one chain ends, the stage still running in the other would keep half the
machine idle for the rest of its run (the reward model, for minutes), so each chain names the other's
marker file in TAKE_CORES_WHEN_GONE="<threads> <file>": once the file is gone, the stage runs on
<threads> torch threads. The thread count changes only the order of float sums: a result changes by
float noise, never by what is computed.
"""

import os
import time
from typing import Callable, Optional

import torch

ENV = "TAKE_CORES_WHEN_GONE"
CHECK_EVERY_SECONDS = 2.0


def parse_spec(spec: Optional[str]) -> tuple:
    """(threads, marker file) of a TAKE_CORES_WHEN_GONE value; (None, None) when unset or empty."""
    if not spec:
        return None, None
    threads, _, marker = spec.partition(" ")
    if not threads.isdigit() or int(threads) < 1 or not marker:
        raise ValueError(f"{ENV}={spec!r}: expected '<threads> <marker file>', e.g. '2 /tmp/other_chain'")
    return int(threads), marker


class CoresWhenFreed:
    """`poll()` between two items of a loop: once the marker file is gone, sets torch's thread count
    (once). Looks at the file at most every CHECK_EVERY_SECONDS."""

    def __init__(self, spec: Optional[str], clock: Callable[[], float] = time.monotonic):
        self.threads, self.marker = parse_spec(spec)
        self.clock, self.next_check = clock, 0.0

    def poll(self) -> Optional[int]:
        """The thread count taken by this call, None otherwise."""
        if self.marker is None or self.clock() < self.next_check:
            return None
        self.next_check = self.clock() + CHECK_EVERY_SECONDS
        if os.path.exists(self.marker):
            return None
        self.marker = None
        torch.set_num_threads(self.threads)
        return self.threads
