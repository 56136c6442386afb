"""Removes the names of DeepSpeed's CPU shared-memory allreduce buffers once every rank has mapped them.

With the CPU accelerator and every rank on one machine (the `deepspeed` launcher sets LOCAL_SIZE), DeepSpeed's
init creates `/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>` (about 66 MiB per rank),
maps its peers' files, and never unlinks its own. /dev/shm is memory: every launch on a new port leaves its files
behind until the machine runs out (Ray's memory monitor then kills actors). The names are only needed while the
ranks find each other, so after a barrier each rank unlinks its own; the mappings stay valid and the kernel frees the
memory when the ranks exit, however they exit.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

__all__ = ["release_shm_allreduce_names"]

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer"


def _uses_shm_allreduce() -> bool:
    """The condition DeepSpeed's shm op initializes under: its op was loaded and every rank is local."""
    try:
        from deepspeed.comm import comm as ds_comm
    except ImportError:
        return False
    backend = getattr(ds_comm, "cdb", None)
    return getattr(backend, "shm_comm_op", None) is not None and os.environ.get("LOCAL_SIZE") == str(dist.get_world_size())


def release_shm_allreduce_names() -> None:
    """Collective over the default group (every rank decides alike, so all or none enter the barrier)."""
    if not dist.is_initialized() or not _uses_shm_allreduce():
        return
    dist.barrier()  # every rank has returned from DeepSpeed's init, which opens the peers' buffers by name
    name = f"{PREFIX}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}"
    (SHM_DIR / name).unlink(missing_ok=True)
