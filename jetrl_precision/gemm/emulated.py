"""The `emulated` backend: dequantize both operands, multiply with float64 accumulation, round once.

It runs anywhere and is the numerical reference the hardware backends are checked against
(their error against it is the bf16 output-rounding floor, about 1.7e-3 relative).

Float64 accumulation also makes it batch-invariant in practice: the exact result is the same
whichever way BLAS blocks the M dimension, and a float64 sum is close enough to it that the
final rounding to fp32/bf16 almost never differs. A rollout engine decoding one row at a time
and a trainer multiplying thousands of rows at once therefore get identical outputs, which
is what lets the unified FP8 flow be verified bit for bit on CPU.
"""

from __future__ import annotations

import torch

from ..formats import QuantizedTensor
from .dispatch import GemmBackend, register_backend

__all__ = ["emulated_gemm_nt"]


def emulated_gemm_nt(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()).to(out_dtype)


register_backend(GemmBackend("emulated", emulated_gemm_nt, lambda device: None))
