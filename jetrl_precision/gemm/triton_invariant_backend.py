"""The `triton_invariant` backend: a batch-invariant, decode-fast block-scaled FP8 GEMM (kernels.invariant_gemm).

Row m of the result has the same bits whatever M is and whichever rows run beside it: the kernel's tiling,
split-K and reduction order depend on (N, K) only. That is what lets a rollout engine decoding a few rows and a
trainer multiplying thousands produce identical outputs on a GPU (the bitwise mode). Its swap-AB tiling reads
each weight byte once per M tile, so decode-sized GEMMs stream the FP8 weight near memory speed.

Never picked by `auto`: ask for it with `gemm_backend="triton_invariant"` (recipe or --precision.gemm_backend).
Asking where it cannot run (no CUDA, no Triton, pre-sm89) fails with one line saying why.
"""

from __future__ import annotations

import logging

import torch

from ..formats import QuantizedTensor
from .dispatch import GemmBackend, register_backend

__all__ = ["NAME", "triton_invariant_gemm_nt", "unavailable_reason"]

NAME = "triton_invariant"
logger = logging.getLogger(__name__)
_warned: set[str] = set()


def triton_invariant_gemm_nt(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    if a.block != (1, 128) or b.block not in ((128, 128), (1, 128)):
        raise ValueError(
            f"the {NAME} GEMM supports A 1x128 x B 128x128 or 1x128 along K; got A {a.block} and B {b.block}. "
            "Use gemm_backend='emulated' for other granularities."
        )
    from ..kernels.invariant_gemm import fp8_gemm_nt_invariant

    # The kernel needs K contiguous (vectorized loads); a transposed view is copied once, not per K step.
    a_data = a.data if a.data.stride(1) == 1 else a.data.contiguous()
    b_data = b.data if b.data.stride(1) == 1 else b.data.contiguous()
    return fp8_gemm_nt_invariant(a_data, a.scale, b_data, b.scale, b.block[0], out_dtype)


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available in this torch build or machine"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken triton install is "not available" too
        reason = f"triton is not importable ({type(e).__name__}: {e}); pip install triton"
        if reason not in _warned:  # a CUDA machine without Triton is a broken install, not a CPU run: say so once
            _warned.add(reason)
            logger.warning("jetrl_precision GEMM: %s cannot run: %s", NAME, reason)
        return reason
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return f"FP8 tensor cores need sm89 or newer; this GPU is sm{cap[0]}{cap[1]}"
    return None


register_backend(GemmBackend(NAME, triton_invariant_gemm_nt, unavailable_reason))
