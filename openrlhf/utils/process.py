"""Ending an entry point's process without the interpreter's exit-time garbage collection."""

from __future__ import annotations

import gc
import sys
from typing import NoReturn

__all__ = ["exit_after_run"]


def exit_after_run(rc: int) -> NoReturn:
    """`sys.exit(rc)` without the full collections the interpreter runs while it shuts down.

    A process that loaded torch, transformers, DeepSpeed and vLLM tracks millions of objects, and scanning them at
    exit takes seconds (about 2 s for a tiny run on a 2-core CPU), in every rank of every run. Freezing puts them out of
    the collector's reach: reference counting still frees them as the modules are torn down and atexit handlers still
    run; only objects kept alive by reference cycles go unfinalized, and a run closes what it wrote (checkpoints,
    metrics, loggers, engines) before it returns.
    """
    gc.freeze()
    sys.exit(rc)
