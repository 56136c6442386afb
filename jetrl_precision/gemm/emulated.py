"""The `emulated` backend: dequantize both operands, multiply in fp32, round once to the output dtype.

It runs anywhere and is the numerical reference the hardware backends are checked against
(their error against it is the bf16 output-rounding floor, about 1.7e-3 relative).
"""

from __future__ import annotations

import torch

from ..formats import QuantizedTensor
from .dispatch import GemmBackend, register_backend

__all__ = ["emulated_gemm_nt"]


def emulated_gemm_nt(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    a32 = a.dequantize(torch.float32)
    b32 = b.dequantize(torch.float32)
    return (a32 @ b32.t()).to(out_dtype)


register_backend(GemmBackend("emulated", emulated_gemm_nt, lambda device: None))
