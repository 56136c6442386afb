"""Ports for rendezvous: one picker for the launchers, the Ray actors, the benchmarks and the tests."""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Iterable

__all__ = ["free_port"]

# Ray's workers listen on 10002-19999 by default; the pool starts above them.
_POOL_LOW = 20000
_rng = random.SystemRandom()  # forked processes must not draw the same sequence


def _ephemeral_range() -> tuple[int, int]:
    """The ports the OS hands to outgoing connections (Linux's default where /proc does not say)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _pool() -> tuple[int, int]:
    low, high = _ephemeral_range()
    if low - 1 - _POOL_LOW >= 1000:
        return _POOL_LOW, low - 1
    return (high + 1, 65535) if 65535 - high >= 1000 else (1024, 65535)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", exclude: Iterable[int] = ()) -> int:
    """A port nothing listens on now at `host`, outside the OS's ephemeral range, other than `exclude`.

    The rendezvous binds it later. A port from the ephemeral range (what binding port 0 returns) can be given to
    any outgoing connection in between (Ray's and gloo's clients open many), and the rendezvous then fails with
    EADDRINUSE; ports below the range are only ever taken by another listener. `exclude` names ports already handed
    to a rendezvous that has not bound them yet.
    """
    taken = set(exclude)
    low, high = _pool()
    for _ in range(64):
        port = _rng.randint(low, high)
        if port not in taken and _bindable(host, port):
            return port
    raise RuntimeError(f"free_port: no free port found in {low}-{high} at {host!r} (excluding {sorted(taken)})")
