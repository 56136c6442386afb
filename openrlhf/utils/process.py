"""Ending an entry point's process: the process group closed in step, no exit-time garbage collection."""

from __future__ import annotations

import gc
import sys
from typing import NoReturn

__all__ = ["exit_after_run"]


def _close_process_group() -> None:
    # A rank that exits with a live gloo group lets the interpreter destroy its still-running worker threads, and
    # C++ aborts it ("terminate called without an active exception"): torchrun then reports a finished run as
    # failed. Closing together (barrier, then destroy) keeps every rank's exit clean. After a failure the peers
    # may be gone, so a barrier could hang: a failed run exits without it.
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()


def exit_after_run(rc: int) -> NoReturn:
    """`sys.exit(rc)` after closing the process group, without the collections the interpreter runs at shutdown.

    A process that loaded torch, transformers, DeepSpeed and vLLM tracks millions of objects, and scanning them at
    exit takes seconds (about 2 s for a tiny run on a 2-core CPU), in every rank of every run. Freezing puts them out of
    the collector's reach: reference counting still frees them as the modules are torn down and atexit handlers still
    run; only objects kept alive by reference cycles go unfinalized, and a run closes what it wrote (checkpoints,
    metrics, loggers, engines) before it returns.
    """
    if rc == 0:
        _close_process_group()
    gc.freeze()
    sys.exit(rc)
