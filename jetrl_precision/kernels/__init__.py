"""Triton kernels for the GPU path: byte-exact FP8 quantizers, fused producers, a block-scaled GEMM.

Importing this package needs no Triton; `register()` (called lazily by `jetrl_precision.ops`) adds
the Triton quantize implementation when Triton imports, and does nothing otherwise, so CPU-only
installs keep the reference quantizer.

Submodules (import them only where Triton is installed):
    quant  - 1x128 / 128x128 (+ transpose) / 128x1 (+ transposed, + requantize from 1x128) quantizers
    fused  - silu_mul_quantize, silu_mul_backward, rmsnorm_quantize, rmsnorm_backward
    swiglu_probe - whether silu_mul_backward gives autograd's bytes on a device (no Triton needed)
    rmsnorm_probe - whether the fused RMSNorm kernels hold their contract on a device (no Triton needed)
    padding_probe - whether the quantizers write token-padded WGrad operands exactly on a device (no Triton needed)
    gemm   - fp8_gemm_nt, the Triton GEMM behind the `triton` backend
    impl   - TritonQuantizeImpl, the object registered with ops
    invariant_norm, invariant_softmax, invariant_attention - the batch-invariant RMSNorm, log-softmax and
             attention of the bitwise mode (jetrl_precision.batch_invariant wires them into a model)
    layout - pure-torch scale-layout helpers used by the vendor GEMM backends
"""

from __future__ import annotations

import logging

__all__ = ["register", "triton_available", "silu_mul_quantize", "rmsnorm_quantize", "transpose_quantized"]

logger = logging.getLogger(__name__)
_registered: list[bool] = []


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken triton install is "not available"
        return False
    return True


def register() -> bool:
    """Register the Triton quantizers with `jetrl_precision.ops`. Returns True if they are registered."""
    if _registered:
        return _registered[0]
    ok = False
    if triton_available():
        try:
            from ..ops import register_quantize_impl
            from .impl import TritonQuantizeImpl

            register_quantize_impl(TritonQuantizeImpl())
            ok = True
        except Exception as e:  # noqa: BLE001 - never break the reference path
            logger.warning("jetrl_precision: Triton kernels failed to load (%s: %s); using the reference quantizer", type(e).__name__, e)
    _registered.append(ok)
    return ok


def silu_mul_quantize(*args, **kwargs):
    """See `jetrl_precision.kernels.fused.silu_mul_quantize` (needs Triton and a CUDA GPU)."""
    from .fused import silu_mul_quantize as fn

    return fn(*args, **kwargs)


def rmsnorm_quantize(*args, **kwargs):
    """See `jetrl_precision.kernels.fused.rmsnorm_quantize` (needs Triton and a CUDA GPU)."""
    from .fused import rmsnorm_quantize as fn

    return fn(*args, **kwargs)


def transpose_quantized(qt):
    """`qt.t()`, with the FP8 bytes transposed by a Triton kernel on CUDA (same bytes, faster than torch's 1-byte copy)."""
    if qt.data.is_cuda and qt.data.dim() == 2 and register():
        from .quant import transpose_quantized as fn

        return fn(qt)
    return qt.t()
