"""Free TCP ports for the processes a tool starts on this host (engines' side channels,
rendezvous stores), chosen *below* the kernel's ephemeral range.

A port from ``bind(0)`` is an ephemeral one: released, it can be handed to another process's
outgoing socket (UCX, gloo, ZMQ, another test suite on the machine) before the process it was
meant for binds it. Seen: "Address already in use" with six engines started at once, and a
decode that reached another run's prefill (its transfer then failed with
``NIXL_ERR_REMOTE_DISCONNECT``). Ports below the range are only ever taken by a listener.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["ephemeral_port_range", "free_tcp_port"]

#: how far below the ephemeral range ports are drawn from
SPAN = 12000


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's ``ip_local_port_range`` (Linux's default where it cannot be read)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_tcp_port(host: str = "127.0.0.1", exclude: set[int] | None = None,
                  attempts: int = 200) -> int:
    """A TCP port on ``host`` that nothing listens on now, below the ephemeral range and not
    in ``exclude`` (added to it when given). RuntimeError when ``attempts`` draws find none."""
    top = ephemeral_port_range()[0]
    lo = max(1024, top - SPAN)
    rng = random.SystemRandom()
    for _ in range(attempts):
        port = rng.randrange(lo, top)
        if exclude is not None and port in exclude:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if exclude is not None:
            exclude.add(port)
        return port
    raise RuntimeError(f"no free TCP port found on {host} in {lo}..{top - 1} "
                       f"after {attempts} tries")
