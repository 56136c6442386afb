"""What every part of the batch-invariant numerics shares: the names, the refusal, where Triton can run."""

from __future__ import annotations

import os

import torch

__all__ = [
    "INVARIANT_ATTENTION",
    "TRITON_ATTENTION",
    "INVARIANT_GEMM_BACKENDS",
    "CUDA_INVARIANT_GEMM_BACKENDS",
    "BitwiseUnavailable",
]

INVARIANT_ATTENTION = "jetrl_invariant"  # float64 attention (CPU)
TRITON_ATTENTION = "jetrl_invariant_triton"  # the Triton kernel shared with the engine (CUDA)
# FP8 GEMM backends whose per-row result does not depend on M: float64 accumulation (emulated, invariant in
# practice), and the fixed-tiling Triton GEMM (jetrl_precision/kernels/invariant_gemm.py).
INVARIANT_GEMM_BACKENDS = frozenset({"emulated", "triton_invariant"})
# On CUDA the FP8 linears must run the fixed-tiling kernel; the float64 emulation is a CPU reference.
CUDA_INVARIANT_GEMM_BACKENDS = frozenset({"triton_invariant"})
class BitwiseUnavailable(RuntimeError):
    """Batch-invariant numerics cannot run here; the message names what is missing."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_missing(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None when they can."""
    from ..kernels import triton_available

    if not triton_available():
        return "Triton is not installed (pip install triton)"
    if device.type != "cuda" and not _interpreting():
        return f"the Triton kernels run on CUDA (or on CPU under TRITON_INTERPRET=1), not on {device.type}"
    return None


def require_triton(t: torch.Tensor, what: str) -> None:
    why = triton_missing(t.device)
    if why:
        raise BitwiseUnavailable(f"{what}: {why}")
