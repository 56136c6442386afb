"""Ports for rendezvous: one picker for the launchers, the Ray actors, the benchmarks and the tests."""

from __future__ import annotations

import socket
from typing import Iterable

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1", exclude: Iterable[int] = ()) -> int:
    """A port nothing listens on now at `host`, other than `exclude`.

    A fixed port collides with other jobs on the host. `exclude` names ports already handed to a rendezvous that has
    not bound them yet: the OS may give a just-released port out again, and two groups would then collide.
    """
    taken = set(exclude)
    for _ in range(64):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port
    raise RuntimeError(f"free_port: the OS kept handing out ports in {sorted(taken)}")
