"""Whether the quantizer kernels write token-padded WGrad operands byte for byte, checked once per device.

A backward GEMM that needs WGrad's K (the token count) in multiples of 128 gets its operands padded by the kernels
that produce them (`quant.quantize_128x1_t`, the requantizers, with `pad_to`): zero columns written in the same
pass. The probe runs each kernel with and without `pad_to` on inputs whose token counts are not multiples of 128
(outliers and non-finite values included) and requires the padded result to equal the unpadded one padded by
`layout.pad_columns`. Where any byte differs, or a kernel fails, the layers pad with that copy instead (the bytes
the GEMM's own padding gives), and say so once.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..formats import QuantizedTensor
from ._probe import device_key, verdict_once
from .layout import pad_columns

__all__ = ["probe_inputs", "mismatch", "kernels_pad_ok", "failure"]

logger = logging.getLogger(__name__)

# name -> fn(x [tokens, features] bf16, pad_to) -> the transposed operand [features, tokens (padded)]
Producer = Callable[[torch.Tensor, int], QuantizedTensor]

_verdicts: dict[str, bool] = {}
_reasons: dict[str, str] = {}


def probe_inputs(device: torch.device | str) -> list[torch.Tensor]:
    """Token counts 200 (not a multiple of 16) and 272 (a multiple of 16, the CUDA requantizer's), log-normal row
    scales, 1% outliers x30, one NaN and one inf."""
    g = torch.Generator().manual_seed(4321)
    out = []
    for rows, cols in ((200, 384), (272, 512)):
        x = torch.randn(rows, cols, generator=g) * torch.exp(0.7 * torch.randn(rows, 1, generator=g))
        x = torch.where(torch.rand(rows, cols, generator=g) < 0.01, x * 30, x)
        x[1, 2], x[rows - 1, cols - 1] = float("nan"), float("inf")
        out.append(x.to(device=device, dtype=torch.bfloat16))
    return out


def mismatch(producers: dict[str, Producer], inputs: list[torch.Tensor], pad_to: int = 128) -> dict[str, int]:
    """Per producer, how many bytes (data and scales) of its padded output differ from its unpadded output padded
    by `pad_columns` (a shape difference counts as every byte)."""
    out = {}
    for name, fn in producers.items():
        bad = 0
        for x in inputs:
            got, want = fn(x, pad_to), pad_columns(fn(x, 0), pad_to)
            if got.data.shape != want.data.shape or got.scale.shape != want.scale.shape:
                bad += want.data.numel()
                continue
            bad += int((got.data.view(torch.uint8) != want.data.view(torch.uint8)).sum())
            bad += int((got.scale.view(torch.int32) != want.scale.view(torch.int32)).sum())
        out[name] = bad
    return out


def kernels_pad_ok(device: torch.device, producers: Callable[[], dict[str, Producer]]) -> bool:
    """The probe's verdict on `device`, computed on first use (`producers()` builds the kernels to check)."""

    def check() -> str:
        bad = {k: v for k, v in mismatch(producers(), probe_inputs(device)).items() if v}
        return "; ".join(f"{k} differs in {v} bytes" for k, v in bad.items())

    def warn(why: str) -> None:
        logger.warning(
            "jetrl_precision: the quantizers' token padding of WGrad operands is wrong on %s (%s); the operands "
            "are padded by a copy instead (same bytes, one more pass over each)", device, why,
        )

    return verdict_once(_verdicts, _reasons, device_key(device), check, warn)


def failure(device: torch.device | str) -> str | None:
    """Why the probe refused the kernels' padding on `device`, if it ran there and did (for the precision graph)."""
    return _reasons.get(str(device)) if _verdicts.get(str(device)) is False else None
