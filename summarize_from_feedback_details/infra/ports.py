"""Rendezvous ports for the `accelerate launch` runs a script or a test starts side by side on one
machine (torchrun's default 29500 is taken while any other run is up). Nothing here changes a result.

Linux hands out its ephemeral range (32768 up, /proc/sys/net/ipv4/ip_local_port_range) to every socket
opened without a port, gloo's among them: a port found free by bind(0) can be taken by one of them before
the launched run binds it (CI, once: a DDP launch on such a port hung 600 s before its first line). Below
that range a port stays free until someone binds it on purpose, so callers draw from there, each from
its own range.
"""

import random
import socket
import threading

EPHEMERAL_START = 32768
_handed_out = set()
_lock = threading.Lock()
_random = random.Random()  # its own: a global seed (set_seed) must not make two processes draw alike


def free_port(ports: range) -> int:
    """A TCP port of `ports` that nothing listens on now and that this process has not handed out before
    (two launches started side by side must not share one)."""
    with _lock:
        for port in _random.sample(ports, len(ports)):  # each port once, in random order
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:  # taken
                    continue
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free TCP port in {ports.start}-{ports.stop - 1} (every one taken or handed out)")
