"""Weight sync through CUDA IPC: an engine process maps the trainer's packed bucket on the GPU they share.

With Ray's hybrid engine (`--train.colocate_all`) each rollout engine worker shares its GPU with a policy rank. NCCL
refuses two ranks of one communicator on one device, and gloo moves every byte GPU -> host -> TCP -> host -> GPU. Here
the policy rank packs a bucket (`weight_sync.pack_sync_buckets`) on its own GPU and exports the bucket's CUDA IPC
handle (`share_bucket`); the engine worker on that GPU opens it (`open_bucket`), installs from it with one
device-to-device copy per tensor, and lets go of it before the rank reuses the memory.

Ray gives each actor its own CUDA_VISIBLE_DEVICES, so device indices differ between processes: a bucket names its GPU
by UUID, and a worker picks the bucket exported from its own GPU (`bucket_for`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from .weight_sync import WeightSyncError

__all__ = ["CudaIpcBucket", "device_uuid", "share_bucket", "open_bucket", "bucket_for", "mapped_bucket"]

_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device: the exporting process's device index


@dataclass(frozen=True)
class CudaIpcBucket:
    """A packed payload's CUDA IPC handle (torch's `rebuild_cuda_tensor` arguments) and its GPU's UUID. Picklable."""

    device_uuid: str
    rebuild_args: tuple


def _local(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def device_uuid(device: torch.device | str) -> str:
    """The GPU's UUID: the same in every process, whatever its CUDA_VISIBLE_DEVICES."""
    return str(torch.cuda.get_device_properties(_local(device)).uuid)


def share_bucket(payload: torch.Tensor) -> CudaIpcBucket:
    """Export a CUDA payload. Keep it alive, unmodified, until every process that opens it has let go (the engine
    calls return only after their copies are done)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if payload.device.type != "cuda":
        raise WeightSyncError(f"CUDA IPC weight sync needs the bucket on a GPU, got {payload.device}")
    try:
        fn, args = reduce_tensor(payload)
    except RuntimeError as e:  # e.g. an allocator whose segments cannot be exported
        raise WeightSyncError(f"CUDA IPC weight sync could not export the bucket ({e}); use --vllm.sync_backend gloo") from e
    if fn is not rebuild_cuda_tensor:
        raise WeightSyncError(f"CUDA IPC weight sync: torch shared the bucket with {getattr(fn, '__name__', fn)}, not a CUDA IPC handle")
    return CudaIpcBucket(device_uuid(payload.device), tuple(args))


def open_bucket(bucket: CudaIpcBucket, device: torch.device | str) -> torch.Tensor:
    """Map an exported payload in this process, on `device`, which must be the GPU it was exported from."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = _local(device)
    here = device_uuid(device)
    if here != bucket.device_uuid:
        raise WeightSyncError(f"CUDA IPC weight sync: the bucket was exported from GPU {bucket.device_uuid}, this process "
                              f"is on {here}")
    args = list(bucket.rebuild_args)
    args[_DEVICE_ARG] = device.index
    return rebuild_cuda_tensor(*args)


def bucket_for(buckets: Mapping[str, CudaIpcBucket], device: torch.device | str, who: str) -> CudaIpcBucket:
    """The bucket exported from `device`'s GPU, or a WeightSyncError that says no policy rank shares it."""
    uuid = device_uuid(device)
    if uuid not in buckets:
        raise WeightSyncError(
            f"{who}: no policy rank shares this engine's GPU ({uuid}; the ranks' GPUs: {sorted(buckets)}), so CUDA IPC "
            "cannot reach it. --vllm.sync_backend ipc needs every engine GPU to hold a policy rank (--train.colocate_all "
            "with as many policy ranks as engine GPUs); use --vllm.sync_backend gloo otherwise")
    return buckets[uuid]


@contextlib.contextmanager
def mapped_bucket(buckets: Mapping[str, CudaIpcBucket], device: torch.device | str, who: str) -> Iterator[torch.Tensor]:
    """The payload exported from `device`'s GPU, mapped for the block. On leaving it, the work queued on `device`'s
    stream (the copies out of the payload) has finished. torch keeps the exporter from reusing the memory while any
    view of it lives here, so drop them (return) soon: the exporting rank's memory is held until then."""
    device = _local(device)
    payload = open_bucket(bucket_for(buckets, device, who), device)
    yield payload
    torch.cuda.current_stream(device).synchronize()
