"""Loopback ports for tests that start servers or torchrun rendezvous: `free_port()`.

Each pytest-xdist worker draws from its own band (worker N: ports 20000 + 2000*N up to the next band), below the
kernel's ephemeral range, walking the band from a per-process start and returning the first port that binds: two
workers never hand out the same port, and a port handed out is not one the kernel gives a client socket meanwhile.
"""

from __future__ import annotations

import itertools
import os
import socket

BASE, BAND = 20000, 2000


def _worker() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name[2:].isdigit() else 0


_offsets = itertools.count(os.getpid() % BAND)


def free_port() -> int:
    """A loopback TCP port that was free just now, from this worker's band (module docstring)."""
    start = BASE + BAND * _worker()
    for _ in range(BAND):
        port = start + next(_offsets) % BAND
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}..{start + BAND - 1}")
