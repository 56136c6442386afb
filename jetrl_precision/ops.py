"""Quantization ops used on the hot path, dispatched to a fast kernel when one is registered.

The reference quantizer (`quantize.quantize_fp8`) defines the bytes. A fast implementation
(e.g. the Triton kernels for CUDA) registers itself with `register_quantize_impl`; it must
produce the same bytes, which the GPU tests check. When none is registered for a device,
the reference runs and `kernel_name(device)` says so (it is recorded in the precision graph).
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

import torch

from .formats import Block, Granularity, QuantizedTensor
from .kernels.layout import pad_columns
from .quantize import quantize_fp8, requantize_fp8
from .recipe import TensorSpec

__all__ = [
    "QuantizeImpl",
    "register_quantize_impl",
    "kernel_name",
    "quantize",
    "requantize",
]

logger = logging.getLogger(__name__)


class QuantizeImpl(Protocol):
    name: str

    def supports(self, device: torch.device) -> bool: ...

    def quantize(self, x: torch.Tensor, block: Block, pow2_scale: bool) -> QuantizedTensor: ...

    def requantize(self, qt: QuantizedTensor, block: Block, pow2_scale: bool) -> QuantizedTensor: ...


_IMPLS: list[QuantizeImpl] = []
_loaded_optional = False
_warned: set[str] = set()


def register_quantize_impl(impl: QuantizeImpl) -> None:
    _IMPLS.insert(0, impl)


def _load_optional() -> None:
    global _loaded_optional
    if _loaded_optional:
        return
    _loaded_optional = True
    try:  # Triton kernels are optional: CUDA only.
        from .kernels import register as _register_kernels
    except ImportError:
        return
    _register_kernels()


def _impl_for(device: torch.device) -> QuantizeImpl | None:
    _load_optional()
    for impl in _IMPLS:
        if impl.supports(device):
            return impl
    if device.type == "cuda" and "cuda" not in _warned:
        _warned.add("cuda")
        logger.warning(
            "jetrl_precision: no fast FP8 quantization kernel for %s (is triton installed?); using the reference "
            "quantizer in plain torch, which is much slower. Bytes are identical.",
            device,
        )
    return None


def kernel_name(device: torch.device | str) -> str:
    impl = _impl_for(torch.device(device))
    return impl.name if impl is not None else "reference"


def quantize(x: torch.Tensor, spec: TensorSpec) -> QuantizedTensor:
    """Quantize a 2-D tensor as `spec` says, on the fastest byte-exact implementation available."""
    block = spec.granularity.block(tuple(x.shape))
    impl = _impl_for(x.device)
    if impl is not None and spec.granularity in (Granularity.BLOCK_1x128, Granularity.BLOCK_128x128, Granularity.BLOCK_128x1):
        return impl.quantize(x, block, spec.pow2_scale)
    return quantize_fp8(x, block, pow2_scale=spec.pow2_scale, nonfinite="propagate")


def requantize(qt: QuantizedTensor, spec: TensorSpec) -> QuantizedTensor:
    block = spec.granularity.block(tuple(qt.shape))
    impl = _impl_for(qt.data.device)
    if impl is not None:
        return impl.requantize(qt, block, spec.pow2_scale)
    return requantize_fp8(qt, block, pow2_scale=spec.pow2_scale)



def quantize_transposed(x: torch.Tensor, spec: TensorSpec) -> QuantizedTensor:
    """quantize(x, spec).t(): fast kernels write the transposed layout directly (WGrad operands)."""
    impl = _impl_for(x.device)
    fn = getattr(impl, "quantize_transposed", None)
    if fn is not None:
        return fn(x, spec.granularity.block(tuple(x.shape)), spec.pow2_scale)
    return quantize(x, spec).t()


def requantize_transposed(qt: QuantizedTensor, spec: TensorSpec) -> QuantizedTensor:
    impl = _impl_for(qt.data.device)
    fn = getattr(impl, "requantize_transposed", None)
    if fn is not None:
        return fn(qt, spec.granularity.block(tuple(qt.shape)), spec.pow2_scale)
    return requantize(qt, spec).t()


def quantize_dual(x: torch.Tensor, spec: TensorSpec, t_spec: TensorSpec) -> tuple[QuantizedTensor, QuantizedTensor]:
    """(quantize(x, spec), quantize_transposed(x, t_spec)): the two dY layouts of the backward pass.

    An implementation may produce both together (the Triton one keeps dY out of its sibling-share
    cache); the bytes are those of the two separate calls.
    """
    impl = _impl_for(x.device)
    fn = getattr(impl, "quantize_dual", None)
    if fn is not None:
        shape = tuple(x.shape)
        out = fn(x, spec.granularity.block(shape), spec.pow2_scale, t_spec.granularity.block(shape), t_spec.pow2_scale)
        if out is not None:
            return out
    return quantize(x, spec), quantize_transposed(x, t_spec)


def silu_mul_quantized(gate: torch.Tensor, up: torch.Tensor, spec: TensorSpec) -> torch.Tensor | None:
    """h = silu(gate) * up for 2-D operands, with quantize(h, spec) computed in the same kernel and kept for the
    consumer's next `quantize(h, spec)` call. None when no implementation can (the caller computes h itself).

    h is bit-for-bit `F.silu(gate) * up`; the consumer's quantization is the one it would have computed.
    """
    impl = _impl_for(gate.device)
    fn = getattr(impl, "silu_mul_quantized", None)
    if fn is None or not spec.is_fp8:
        return None
    return fn(gate, up, spec.granularity.block(tuple(gate.shape)), spec.pow2_scale)


def silu_mul_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(dgate, dup) of h = silu(gate) * up for 2-D operands from a fused kernel, byte-equal to autograd's kernels
    for that expression; None when no implementation can (the caller runs autograd's ops)."""
    fn = getattr(_impl_for(gate.device), "silu_mul_backward", None)
    return None if fn is None else fn(dh, gate, up)


def silu_mul_backward_quantized(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                                spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(dgate, dup) as `silu_mul_backward` gives them, for gate and up the halves of one stacked gate/up GEMM output,
    with quantize(dY, spec) of the stacked dY = [dgate, dup] computed in the same kernel and kept for that GEMM's
    DGrad. None when no implementation can (the caller runs `silu_mul_backward`)."""
    fn = getattr(_impl_for(gate.device), "silu_mul_backward_quantized", None)
    if fn is None or not spec.is_fp8:
        return None
    return fn(dh, gate, up, spec.granularity.block((gate.shape[0], 2 * gate.shape[1])), spec.pow2_scale)


def rmsnorm_quantized(x: torch.Tensor, weight: torch.Tensor, eps: float, spec: TensorSpec) -> torch.Tensor | None:
    """transformers' Llama-family RMSNorm of a 2-D x, with quantize(y, spec) computed in the same kernel and kept
    for the consumers' next `quantize(y, spec)` call. None when no implementation can (the caller computes y).

    y may differ from transformers' eager formula by an ulp where the mean's summation order rounds differently;
    the consumers' quantization is the reference quantizer's of this y."""
    impl = _impl_for(x.device)
    fn = getattr(impl, "rmsnorm_quantized", None)
    if fn is None or not spec.is_fp8:
        return None
    return fn(x, weight, eps, spec.granularity.block(tuple(x.shape)), spec.pow2_scale)


def rmsnorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(dx, dweight) of that RMSNorm for 2-D operands from a fused kernel; None when no implementation can (the
    caller differentiates the formula)."""
    fn = getattr(_impl_for(x.device), "rmsnorm_backward", None)
    return None if fn is None else fn(dy, x, weight, eps)


def release_shared_results() -> None:
    """Drop the quantizations implementations keep for sibling layers and fused producers.

    Each keeps only its last result, but that result's FP8 bytes stay alive after the step that made them (about
    1.2 GB for a Llama-3.1-8B layer at 65K tokens). `linear.mark_weights_updated` calls this after every optimizer
    step; call it yourself to free that memory between phases (rollout, then training).
    """
    for impl in _IMPLS:
        fn = getattr(impl, "release_shared", None)
        if fn is not None:
            fn()


# ---- bound entry points -----------------------------------------------------------------------------------
# The functions above dispatch on every call (implementation, block, device). A layer's step plan resolves that once
# per device: these return a function of the 2-D input alone, giving the very bytes of the call they name. The
# caller guarantees a 2-D input with at least one element (Fp8Linear handles empty inputs before quantizing).
_FAST_GRANULARITIES = (Granularity.BLOCK_1x128, Granularity.BLOCK_128x128, Granularity.BLOCK_128x1)


def _bindable(spec: TensorSpec, device: torch.device, method: str):
    """(impl's binder, block) when the implementation for `device` binds `spec`, else (None, None)."""
    if not spec.is_fp8 or spec.granularity not in _FAST_GRANULARITIES:
        return None, None
    impl = _impl_for(torch.device(device))
    fn = getattr(impl, method, None) if impl is not None else None
    return fn, spec.granularity.block((1, 1))


def quantizer(spec: TensorSpec, device: torch.device | str) -> Callable[[torch.Tensor], QuantizedTensor]:
    """`lambda x: quantize(x, spec)` for inputs on `device`, resolved once."""
    fn, block = _bindable(spec, device, "bind_quantize")
    if fn is not None:
        return fn(block, spec.pow2_scale)
    return lambda x: quantize(x, spec)


# `pad_to` below: the transposed (WGrad) result's columns, the tokens, zero-padded to a multiple of it (a multiple of
# 128): the operand a GEMM backend that needs K % 128 == 0 would otherwise copy into a padded buffer per call.
# The Triton implementation's kernels write the zeros in the same pass; other implementations pad afterwards.


def dual_quantizer(spec: TensorSpec, t_spec: TensorSpec, device: torch.device | str, pad_to: int = 0):
    """`lambda x: quantize_dual(x, spec, t_spec)` for inputs on `device`, resolved once."""
    fn, block = _bindable(spec, device, "bind_quantize_dual")
    t_fn, t_block = _bindable(t_spec, device, "bind_quantize_dual")
    if fn is not None and t_fn is not None:
        bound = fn(block, spec.pow2_scale, t_block, t_spec.pow2_scale, torch.device(device), pad_to)
        if bound is not None:
            return bound
    if pad_to > 1:
        def padded(x: torch.Tensor) -> tuple[QuantizedTensor, QuantizedTensor]:
            q, qt = quantize_dual(x, spec, t_spec)
            return q, pad_columns(qt, pad_to)

        return padded
    return lambda x: quantize_dual(x, spec, t_spec)


def transposed_quantizer(spec: TensorSpec, device: torch.device | str, pad_to: int = 0):
    """`lambda x: quantize_transposed(x, spec)` for inputs on `device`, resolved once."""
    impl = _impl_for(torch.device(device)) if spec.is_fp8 else None
    fn = getattr(impl, "quantize_transposed", None) if impl is not None else None
    if fn is not None and spec.granularity in _FAST_GRANULARITIES:
        block, pow2 = spec.granularity.block((1, 1)), spec.pow2_scale
        quantize_t = lambda x: fn(x, block, pow2)  # noqa: E731
    else:
        quantize_t = lambda x: quantize_transposed(x, spec)  # noqa: E731
    return _padded(quantize_t, pad_to)


def transposed_requantizer(spec: TensorSpec, device: torch.device | str, pad_to: int = 0):
    """`lambda qt: requantize_transposed(qt, spec)` for inputs on `device`, resolved once."""
    fn, block = _bindable(spec, device, "bind_requantize_transposed")
    if fn is not None:
        return fn(block, spec.pow2_scale, torch.device(device), pad_to=pad_to)
    return _padded(lambda qt: requantize_transposed(qt, spec), pad_to)


def _padded(fn: Callable[..., QuantizedTensor], pad_to: int) -> Callable[..., QuantizedTensor]:
    """`fn` with its result's columns padded by `pad_columns`; `fn` itself when nothing is padded (a hot path)."""
    if pad_to <= 1:
        return fn
    return lambda t: pad_columns(fn(t), pad_to)


__all__ += ["quantize_transposed", "requantize_transposed", "quantize_dual", "silu_mul_quantized", "silu_mul_backward",
            "silu_mul_backward_quantized", "rmsnorm_quantized", "rmsnorm_backward", "release_shared_results",
            "quantizer", "dual_quantizer", "transposed_quantizer", "transposed_requantizer"]
