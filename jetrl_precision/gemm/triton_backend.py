"""The `triton` backend: our own block-scaled FP8 GEMM (jetrl_precision.kernels.gemm).

Correct for any M (decode included, with deterministic split-K), and for K or N that are not
multiples of 128 (masked edges, no padding copies). It is the portable fallback on sm89+ GPUs.
"""

from __future__ import annotations

import torch

from ..formats import QuantizedTensor
from .dispatch import GemmBackend, register_backend

__all__ = ["triton_gemm_nt"]


def triton_gemm_nt(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    if a.block != (1, 128) or b.block not in ((128, 128), (1, 128)):
        raise ValueError(
            f"the triton GEMM supports A 1x128 x B 128x128 or 1x128 along K; got A {a.block} and B {b.block}. "
            "Use gemm_backend='emulated' for other granularities."
        )
    from ..kernels.gemm import fp8_gemm_nt

    a_data = a.data if a.data.stride(1) == 1 else a.data.contiguous()
    b_data = b.data if b.data.stride(1) == 1 else b.data.contiguous()
    return fp8_gemm_nt(a_data, a.scale, b_data, b.scale, b.block[0], out_dtype)


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available in this torch build or machine"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install triton)"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return f"FP8 tensor cores need sm89 or newer; this GPU is sm{cap[0]}{cap[1]}"
    return None


register_backend(GemmBackend("triton", triton_gemm_nt, unavailable_reason))
