"""What the two Triton GEMM backends (`triton`, `triton_invariant`) share: the operands their kernels take and
where they can run. Each backend passes its own name, so every message names the backend that was asked for."""

from __future__ import annotations

import logging

import torch

from ..formats import QuantizedTensor

__all__ = ["k_contiguous_operands", "triton_unavailable"]

logger = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()


def k_contiguous_operands(a: QuantizedTensor, b: QuantizedTensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A's and B's FP8 data with K contiguous, after refusing block shapes the kernels were not written for."""
    if a.block != (1, 128) or b.block not in ((128, 128), (1, 128)):
        raise ValueError(
            f"the {name} GEMM supports A 1x128 x B 128x128 or 1x128 along K; got A {a.block} and B {b.block}. "
            "Use gemm_backend='emulated' for other granularities."
        )
    # The kernels need K contiguous (vectorized loads); a transposed view is copied once, not per K step.
    a_data = a.data if a.data.stride(1) == 1 else a.data.contiguous()
    b_data = b.data if b.data.stride(1) == 1 else b.data.contiguous()
    return a_data, b_data


def triton_unavailable(device: torch.device, name: str) -> str | None:
    """None where backend `name` can launch its Triton kernel on `device`, else the one-line reason."""
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available in this torch build or machine"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken triton install is "not available" too
        reason = f"triton is not importable ({type(e).__name__}: {e}); pip install triton"
        if (name, reason) not in _warned:  # a CUDA machine without Triton is a broken install, not a CPU run: say so once
            _warned.add((name, reason))
            logger.warning("jetrl_precision GEMM: %s cannot run: %s", name, reason)
        return reason
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return f"FP8 tensor cores need sm89 or newer; this GPU is sm{cap[0]}{cap[1]}"
    return None
