"""The `triton` backend: our own block-scaled FP8 GEMM (jetrl_precision.kernels.gemm).

Correct for any M (decode included, with deterministic split-K), and for K or N that are not
multiples of 128 (masked edges, no padding copies). It is the portable fallback on sm89+ GPUs.
"""

from __future__ import annotations

import torch

from ..formats import QuantizedTensor
from ._triton_common import k_contiguous_operands, triton_unavailable
from .dispatch import GemmBackend, register_backend

__all__ = ["NAME", "triton_gemm_nt", "unavailable_reason"]

NAME = "triton"


def triton_gemm_nt(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    a_data, b_data = k_contiguous_operands(a, b, NAME)
    from ..kernels.gemm import fp8_gemm_nt

    return fp8_gemm_nt(a_data, a.scale, b_data, b.scale, b.block[0], out_dtype)


def unavailable_reason(device: torch.device) -> str | None:
    return triton_unavailable(device, NAME)


register_backend(GemmBackend(NAME, triton_gemm_nt, unavailable_reason))
