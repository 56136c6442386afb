"""Ending an entry point's process: the process group closed in step, then an exit that runs no C++ teardown."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_after_run"]


def _close_process_group() -> None:
    # Ranks close the group together (barrier, then destroy) so that none tears its side down while a peer is still
    # in a collective. After a failure the peers may be gone and a barrier could hang: a failed run skips this.
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()


def _finish_python() -> None:
    """The interpreter's own first steps of a shutdown, in its order: threading's shutdown (its exit callbacks stop
    executor workers, then every non-daemon thread is joined), the atexit handlers (logging's flush, weight-sync groups
    closed, Ray's and vLLM's shutdowns), and the standard streams flushed."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to save
            pass


def exit_after_run(rc: int) -> NoReturn:
    """End the process with status `rc` once the run's own shutdown is done, without the interpreter's teardown.

    A normal exit then frees whatever is still alive: DeepSpeed's engine keeps the gloo process groups it was given,
    and their transport threads are destroyed at that point in no fixed order. One rank in a few of a finished
    multi-rank run aborted there ("terminate called without an active exception"), so the launcher reported a good
    run as failed. `os._exit` skips that teardown (and the seconds of garbage collection over the millions of objects
    torch, transformers, DeepSpeed and vLLM create); everything a run writes is closed before it returns.
    """
    if rc == 0:
        _close_process_group()
    _finish_python()
    os._exit(rc)
