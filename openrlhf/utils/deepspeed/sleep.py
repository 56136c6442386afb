"""DeepSpeed sleep (`--ds.enable_sleep`): park a training engine's state in host memory while
the colocated rollout engine generates, and bring it back before the next forward.

What is parked: the model's low-precision parameters (for ZeRO-3, the local partitions), the
optimizer's fp32 master weights and its state tensors (Adam moments). Each storage is copied to
host memory (pinned on CUDA) and then resized to zero bytes, which frees the device memory
while every tensor object and every view into a flat buffer (ZeRO keeps parameters as views of
one buffer) stays valid; waking resizes the storages back and copies the bytes in. DeepSpeed's
own `offload_states` needs its CUDA FusedAdam under ZeRO-3; this works for any optimizer and
ZeRO stage, and on CPU, where the test suite checks that training after a sleep/wake cycle is
bit-identical to training without one.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch

__all__ = ["EngineSleeper"]

logger = logging.getLogger(__name__)


def _engine_tensors(engine) -> Iterator[torch.Tensor]:
    for p in engine.module.parameters():
        yield p.data
        if hasattr(p, "ds_tensor"):  # ZeRO-3: p.data is an empty placeholder, the partition lives here
            yield p.ds_tensor
    zero_opt = getattr(engine, "optimizer", None)
    base = getattr(zero_opt, "optimizer", zero_opt)  # DeepSpeed's ZeRO wrapper, or a plain optimizer
    if base is None:
        return
    params = [p for group in base.param_groups for p in group["params"]]
    for p in list(params) + [k for k in base.state if torch.is_tensor(k)]:
        yield p.data  # the fp32 master partitions under ZeRO
        for v in base.state.get(p, {}).values():
            if torch.is_tensor(v):
                yield v
    # ZeRO's flat buffers: low-precision partitions, and fp32 masters that ZeRO-3 hands to the
    # base optimizer only while it steps.
    for name in ("bit16_groups_flat", "fp16_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        for t in getattr(zero_opt, name, None) or ():
            if torch.is_tensor(t):
                yield t


class EngineSleeper:
    """`sleep()` parks the engine's state in host memory; `wake()` restores it byte for byte."""

    def __init__(self, engine, name: str = "actor") -> None:
        self.engine, self.name = engine, name
        self._parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def asleep(self) -> bool:
        return bool(self._parked)

    def _storages(self) -> list[torch.UntypedStorage]:
        seen, out = set(), []
        for t in _engine_tensors(self.engine):
            s = t.untyped_storage()
            if s.nbytes() == 0 or s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            out.append(s)
        return out

    @torch.no_grad()
    def sleep(self) -> int:
        """Park every storage; returns the bytes freed on the device."""
        if self.asleep:
            return 0
        pin = torch.cuda.is_available()
        freed = 0
        for s in self._storages():
            host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.untyped_storage().copy_(s)
            freed += s.nbytes()
            s.resize_(0)
            self._parked.append((s, host))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.debug("%s asleep: %.1f MiB parked in host memory", self.name, freed / 2**20)
        return freed

    @torch.no_grad()
    def wake(self) -> None:
        for s, host in self._parked:
            s.resize_(host.numel())
            s.copy_(host.untyped_storage())
        self._parked.clear()

    def parked_bytes(self) -> int:
        return sum(host.numel() for _, host in self._parked)
