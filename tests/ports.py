"""A TCP port for a test's rendezvous that stays free until the test binds it.

Binding port 0 and closing the socket (the usual "free port") hands out a port from the kernel's
ephemeral range, which every later ``connect`` and port-0 bind on the machine draws from too (Gloo's
connections, other tests' stores): on a busy machine the port can be taken again before torchrun
binds it, and the test fails at start-up (issue 33: two of four failures under load). A port below
the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``) is never handed out by the kernel,
so once found free it stays free unless a program binds it by number.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port in [10000, start of the ephemeral range) that nothing listens on now."""
    high = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port found in [10000, {high})")
