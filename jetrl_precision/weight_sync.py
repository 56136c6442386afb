"""What the trainer sends to a rollout engine after each optimizer step.

FP8 layers travel as the e4m3 bytes + fp32 128x128 scales that the trainer's own forward
uses (`Fp8Linear.quantized_weight`, cached): half the bytes of bf16, and the engine installs
them without re-quantizing, so both sides hold identical bytes. Everything else (embeddings,
norms, lm_head, biases) travels in its own dtype. `digest` fingerprints bytes for the
post-sync check.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch
from torch import nn

from .formats import Block
from .graph import canonical_name
from .linear import Fp8Linear

__all__ = ["SyncTensor", "iter_sync_tensors", "digest", "sync_nbytes"]


@dataclass
class SyncTensor:
    name: str  # canonical parameter name, e.g. "model.layers.0.mlp.down_proj.weight"
    data: torch.Tensor  # e4m3 bytes (kind == "fp8") or the parameter in its dtype
    scale: torch.Tensor | None = None  # fp32 logical [ceil(N/b0), ceil(K/b1)] for fp8
    block: Block | None = None

    @property
    def kind(self) -> str:
        return "fp8" if self.scale is not None else "hp"

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (self.scale.numel() * self.scale.element_size() if self.scale is not None else 0)


def digest(t: torch.Tensor) -> str:
    """sha1 of a tensor's raw bytes (dtype-agnostic: fp8 is viewed as uint8)."""
    t = t.detach().contiguous().cpu()
    raw = t.view(torch.uint8) if t.element_size() == 1 else t.reshape(-1).view(torch.uint8)
    return hashlib.sha1(raw.numpy().tobytes()).hexdigest()


def iter_sync_tensors(
    model: nn.Module,
    gather: Callable[[list[nn.Parameter]], ContextManager] | None = None,
    fp8: bool = True,
) -> Iterator[SyncTensor]:
    """Yield every tensor a rollout engine needs, module by module.

    `gather(params)` is a context manager that materializes partitioned parameters
    (DeepSpeed ZeRO-3: `deepspeed.zero.GatheredParameters(params)`); tensors are yielded
    inside it, so consume each before asking for the next. With `fp8=False` every weight
    travels in high precision (the bf16 baseline, or fp8_rollout where the engine quantizes).
    """
    gather = gather or (lambda params: contextlib.nullcontext())
    for fqn, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        prefix = canonical_name(fqn)
        with gather([p for _, p in params]):
            for pname, p in params:
                name = f"{prefix}.{pname}" if prefix else pname
                if fp8 and isinstance(module, Fp8Linear) and pname == "weight" and module.fprop.weight.is_fp8:
                    wq = module.quantized_weight(p)
                    yield SyncTensor(name, wq.data, wq.scale, wq.block)
                else:
                    yield SyncTensor(name, p.detach())


def sync_nbytes(model: nn.Module, fp8: bool = True) -> int:
    return sum(t.nbytes() for t in iter_sync_tensors(model, fp8=fp8))
