"""Exponential moving average of a model's parameters (--train.enable_ema), kept in fp32 in host memory.

After every applied optimizer step, `ema = beta * ema + (1 - beta) * param`. Under ZeRO-3 each rank
averages its own partition (`param.ds_tensor`), so no gather runs per step and the host memory is
split across ranks; `state_dict()` gathers the partitions once, at export. Otherwise every rank holds
whole parameters, and rank 0 alone keeps the average. fp32, because at beta = 0.992 a bf16 average
would round most updates away.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ParameterEMA"]

logger = logging.getLogger(__name__)


def _partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_tensor")


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of `p`, as an fp32 host tensor (a copy)."""
    t = p.ds_tensor if _partitioned(p) else p.data
    return t.detach().to("cpu", torch.float32, copy=True)


class ParameterEMA:
    """The moving average of `model`'s parameters (names as in `model.named_parameters()`)."""

    def __init__(self, model: nn.Module, beta: float, rank: int, device: torch.device) -> None:
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"EMA beta must be in (0, 1], got {beta}")
        self.beta, self.rank, self.device = beta, rank, device
        self.params = dict(model.named_parameters())
        canonical = {id(p): n for n, p in self.params.items()}
        # tied weights (lm_head = embed_tokens) appear once in named_parameters, twice in a state dict
        self.aliases = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if n not in self.params}
        self.zero3 = any(_partitioned(p) for p in self.params.values())
        self.shadow: dict[str, torch.Tensor] = {}
        self.reset()

    @property
    def holds_state(self) -> bool:
        return self.zero3 or self.rank == 0

    def reset(self) -> None:
        """Restart the average at the current weights."""
        self.shadow = {n: _local(p) for n, p in self.params.items()} if self.holds_state else {}

    @torch.no_grad()
    def update(self) -> None:
        """Fold in the current weights; call after each optimizer step that changed them."""
        for name, avg in self.shadow.items():
            avg.mul_(self.beta).add_(_local(self.params[name]), alpha=1.0 - self.beta)

    @torch.no_grad()
    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The averaged parameters, whole, in each parameter's dtype: on rank 0 (None elsewhere).
        Under ZeRO-3 every rank must call it (it gathers the partitions)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            if self.zero3:
                shard = self.shadow[name].to(self.device)
                parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, shard)
                if self.rank == 0:
                    out[name] = torch.cat(parts)[: p.ds_numel].view(p.ds_shape).to("cpu", p.dtype)
            elif self.rank == 0:
                out[name] = self.shadow[name].to(p.dtype)
        if self.rank != 0:
            return None
        out.update({alias: out[name] for alias, name in self.aliases.items()})
        return out

    def _file(self, folder: Path) -> Path:
        return Path(folder) / f"ema_rank{self.rank}.pt"

    def save(self, folder: Path) -> None:
        """Write this rank's part into a checkpoint folder (so a resumed run keeps averaging)."""
        if self.holds_state:
            torch.save({"beta": self.beta, "shadow": self.shadow}, self._file(folder))

    def load(self, folder: Path) -> None:
        """Read this rank's part back; without a matching one (a checkpoint saved without EMA, or at another
        world size) the average restarts at the loaded weights, and the log says so."""
        if not self.holds_state:
            return
        f = self._file(folder)
        saved = torch.load(f, map_location="cpu") if f.is_file() else None
        shapes_match = saved is not None and saved["shadow"].keys() == self.shadow.keys() and all(
            saved["shadow"][n].shape == t.shape for n, t in self.shadow.items()
        )
        if shapes_match:
            self.shadow = saved["shadow"]
            return
        why = "it has no EMA state" if saved is None else "its EMA state was saved at another world size or for another model"
        logger.warning("--train.enable_ema: checkpoint %s: %s; the average restarts at the loaded weights", folder, why)
        self.reset()
