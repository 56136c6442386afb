"""Whether the fused SwiGLU backward gives autograd's bytes on this device, checked once per (device, dtype).

`fused.silu_mul_backward` follows torch's CUDA kernels op by op (the fp32 math, the rounding points, the one fma of
torch's silu_backward), but those kernels are compiled by nvcc and the fused one by Triton: a compiler that contracts
or orders one operation differently changes a last bit. The probe runs both on values that cover the range a SwiGLU
sees (both saturating tails of silu, values near zero, outliers) and the layer uses the fused kernel only where every
byte agrees, as the torch GEMM backend does for its direct cuBLASLt calls.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

from ._probe import device_key, verdict_once

__all__ = ["probe_values", "mismatch", "fused_backward_ok"]

logger = logging.getLogger(__name__)

Backward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_verdicts: dict[tuple[str, torch.dtype, str], bool] = {}
_reasons: dict[tuple[str, torch.dtype, str], str] = {}


def probe_values(device: torch.device | str, dtype: torch.dtype, rows: int = 256, cols: int = 1024):
    """(dh, gate, up): normal values times log-normal row scales, 1% outliers x30, and a fixed sweep of gate values
    from -100 to 100 (silu's tails, where exp over- and underflows) with values near zero."""
    g = torch.Generator().manual_seed(1234)

    def draw():
        x = torch.randn(rows, cols, generator=g) * torch.exp(0.7 * torch.randn(rows, 1, generator=g))
        return torch.where(torch.rand(rows, cols, generator=g) < 0.01, x * 30, x)

    dh, gate, up = draw(), draw() * 2, draw()
    sweep = torch.cat([torch.linspace(-100, 100, cols // 2), torch.logspace(-8, 0, cols // 4), -torch.logspace(-8, 0, cols // 4)])
    gate[0] = sweep[:cols]
    return tuple(t.to(device=device, dtype=dtype) for t in (dh, gate, up))


def mismatch(fn: Backward, dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> int:
    """How many elements of fn's (dgate, dup) differ in bytes from autograd's kernels for silu(gate) * up."""
    dgate, dup = fn(dh, gate, up)
    ref_dgate, ref_dup = torch.ops.aten.silu_backward(dh * up, gate), dh * F.silu(gate)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[gate.dtype]
    return int((dgate.view(bits) != ref_dgate.view(bits)).sum() + (dup.view(bits) != ref_dup.view(bits)).sum())


def fused_backward_ok(fn: Backward, device: torch.device, dtype: torch.dtype, kernel: str = "plain") -> bool:
    """The probe's verdict for `fn` (one of the fused backward kernels, named by `kernel`: "plain", or "quantizing"
    for the one that also quantizes the stacked dY) on (device, dtype), computed on first use; a mismatch is logged
    once."""

    def check() -> str:
        bad = mismatch(fn, *probe_values(device, dtype))
        return f"differs from autograd's kernels in {bad} probe values" if bad else ""

    def warn(why: str) -> None:
        logger.warning(
            "jetrl_precision: the fused SwiGLU backward (%s kernel) %s on %s (%s); SwiGLU MLPs run %s there instead "
            "(same result, more memory traffic)", kernel, why, device, dtype,
            "autograd's four elementwise kernels" if kernel == "plain" else "the plain fused kernel and a separate quantizer",
        )

    return verdict_once(_verdicts, _reasons, (device_key(device), dtype, kernel), check, warn)
