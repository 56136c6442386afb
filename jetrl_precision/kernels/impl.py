"""The Triton quantize implementation registered with `jetrl_precision.ops`."""

from __future__ import annotations

import logging
import os

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..formats import Block, QuantizedTensor
from ..quantize import quantize_fp8, requantize_fp8
from . import cast_transpose, fused, padding_probe, quant, quant_cuda, rmsnorm_probe, swiglu_probe
from ._probe import device_key, verdict_once
from .layout import column_blocks_of_one, pad_columns

__all__ = ["TritonQuantizeImpl"]

logger = logging.getLogger(__name__)


def _fp8_capable(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    # The e4m3 conversion instruction (cvt.rn.satfinite.e4m3x2.f32) needs sm89 or newer.
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never, where this torch has no CUDA)."""
    return _HAS_CUDA and torch.cuda.is_current_stream_capturing()


_HAS_CUDA = torch.cuda.is_available()


def _stacked_swiglu_grads(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizing SwiGLU backward's (dgate, dup), for its device probe (`swiglu_probe`)."""
    d = fused.silu_mul_backward_quantize(dh, gate, up)[0]
    return d[:, : gate.shape[1]], d[:, gate.shape[1]:]


def _stacked_swiglu_probe(device: torch.device, dtype: torch.dtype) -> bool:
    return swiglu_probe.fused_backward_ok(_stacked_swiglu_grads, device, dtype, "quantizing")


_dual_verdicts: dict[tuple, bool] = {}
_dual_reasons: dict[tuple, str] = {}


def _one_read_dual_ok(device: torch.device, pow2: bool, t_pow2: bool, pad_to: int, inputs: list | None = None) -> bool:
    """Whether the one-read dual kernel writes the two kernels' bytes and scale bits on this device (checked once per
    device and options, on `quant_cuda.probe_inputs`: outliers, zero groups, NaN, +-inf and partial blocks, unless
    `inputs` are given); logged once where not."""
    if _capturing():  # the check reads results back: never inside a graph capture (the two kernels run there)
        return False

    def check() -> str:
        for x in inputs if inputs is not None else quant_cuda.probe_inputs(torch.bfloat16, device):
            pairs = zip(quant.quantize_dual_1x128_128x1_t(x, pow2, t_pow2, pad_to=pad_to),
                        (quant.quantize_1x128(x, pow2), quant.quantize_128x1_t(x, t_pow2, pad_to=pad_to)), ("1x128", "128x1^T"))
            for got, want, what in pairs:
                if not (torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
                        and torch.equal(got.scale.contiguous().view(torch.int32), want.scale.contiguous().view(torch.int32))):
                    return f"its {what} layout differs from the two kernels' at shape {tuple(x.shape)}"
        return ""

    def warn(why: str) -> None:
        logger.warning("jetrl_precision: JETRL_DUAL_QUANT_FUSED=1 asked for the one-read dual quantizer, but %s on %s; "
                       "dY's two layouts come from the two kernels there (same bytes, one more read of dY)", why, device)

    return verdict_once(_dual_verdicts, _dual_reasons, (device_key(device), pow2, t_pow2, pad_to), check, warn)


class _LastResult:
    """Remembers the last quantization of one input, so sibling layers reading the same tensor share it.

    q/k/v projections (and gate/up) quantize the very same normed activation; with this they launch
    one kernel and autograd saves one FP8 copy instead of three. A hit needs the same live storage
    (checked through a weak reference, so freed-and-reused memory never matches), offset, shape,
    strides, dtype, version counter (bumped by any in-place write) and options.

    Nothing is kept or reused while a CUDA graph is being captured: a hit would leave the quantize kernel out
    of the graph (a replay would read the bytes of the input seen at capture), and a kept result would live in
    the graph's private memory pool, which replays overwrite.
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.ref: StorageWeakRef | None = None
        self.value: QuantizedTensor | None = None

    @staticmethod
    def _key(x: torch.Tensor, st, extra: tuple) -> tuple:
        return (st.data_ptr(), x.storage_offset(), x.shape, x.stride(), x.dtype, x._version, x.device, extra)

    def get(self, x: torch.Tensor, extra: tuple) -> QuantizedTensor | None:
        key = self.key
        if key is None or x.is_inference() or _capturing():
            return None
        if self._key(x, x.untyped_storage(), extra) != key or self.ref.expired():
            return None
        return self.value

    def put(self, x: torch.Tensor, extra: tuple, value: QuantizedTensor) -> QuantizedTensor:
        if x.is_inference() or _capturing():  # inference tensors have no version counter; never cache them
            self.key = self.ref = self.value = None
        else:
            st = x.untyped_storage()
            self.key, self.ref, self.value = self._key(x, st, extra), StorageWeakRef(st), value
        return value

    def take(self, x: torch.Tensor, extra: tuple) -> QuantizedTensor | None:
        """`get`, then forget the kept result: for a tensor read by one consumer (a stacked GEMM's dY), whose FP8
        bytes should not outlive that read."""
        value = self.get(x, extra)
        if value is not None:
            self.key = self.ref = self.value = None
        return value

    def lookup(self, x: torch.Tensor, extra: tuple, make, arg) -> QuantizedTensor:
        """The kept quantization of x if it is still valid, else `make(arg)`, kept: one storage lookup per call."""
        if x.is_inference() or _capturing():
            self.key = self.ref = self.value = None
            return make(arg)
        st = x.untyped_storage()
        key = self._key(x, st, extra)
        if key == self.key and not self.ref.expired():
            return self.value
        value = make(arg)
        self.key, self.ref, self.value = key, StorageWeakRef(st), value
        return value


class TritonQuantizeImpl:
    """Byte-exact Triton kernels for 1x128, 128x128 and 128x1 blocks; other blocks use the reference."""

    name = "triton"

    def __init__(self, share_results: bool = True) -> None:
        self._ok: dict[str, bool] = {}
        self._norm_verdicts: dict[tuple[torch.device, torch.dtype], bool] = {}
        self._swiglu_dy_verdicts: dict[tuple[torch.device, torch.dtype], bool] = {}
        self.share_results = share_results
        self.release_shared()

    def release_shared(self) -> None:
        """Drop the kept quantizations (they hold their FP8 bytes alive after their source is gone)."""
        self._last_q = _LastResult()
        self._last_rq_t = _LastResult()
        # A stacked GEMM's 1x128 dY that its producer wrote (the fused SwiGLU backward), for that GEMM's DGrad only;
        # its own slot, so the dY quantizers check it with one attribute read while it is empty.
        self._kept_dy = _LastResult()

    def supports(self, device: torch.device) -> bool:
        key = str(device)
        if key not in self._ok:
            self._ok[key] = _fp8_capable(torch.device(device))
        return self._ok[key]

    def quantize(self, x: torch.Tensor, block: Block, pow2_scale: bool) -> QuantizedTensor:
        if x.dim() == 2 and x.numel() > 0 and x.is_floating_point():
            if block == (1, 128):
                if not self.share_results:
                    return quant.quantize_1x128(x, pow2_scale)
                return self._last_q.lookup(x, (block, pow2_scale), lambda t: quant.quantize_1x128(t, pow2_scale), x)
            if block == (128, 128):
                return quant.quantize_128x128(x, pow2_scale)[0]
            if block == (128, 1):
                return quant.quantize_128x1(x, pow2_scale)
        return quantize_fp8(x, block, pow2_scale=pow2_scale, nonfinite="propagate")

    def requantize(self, qt: QuantizedTensor, block: Block, pow2_scale: bool) -> QuantizedTensor:
        if qt.block == (1, 128) and block == (128, 1):
            return quant.requantize_1x128_to_128x1(qt, transposed=False, pow2_scale=pow2_scale)
        return requantize_fp8(qt, block, pow2_scale=pow2_scale)

    def quantize_transposed(self, x: torch.Tensor, block: Block, pow2_scale: bool) -> QuantizedTensor:
        """quantize(x, block).t() with the transposed layout written directly."""
        if x.dim() == 2 and x.numel() > 0 and x.is_floating_point():
            if block == (128, 1):
                return quant.quantize_128x1_t(x, pow2_scale)
            if block == (128, 128):
                return quant.quantize_128x128(x, pow2_scale, write=False, write_t=True)[1]
        return self.quantize(x, block, pow2_scale).t()

    def quantize_dual(
        self, x: torch.Tensor, block: Block, pow2_scale: bool, t_block: Block, t_pow2_scale: bool
    ) -> tuple[QuantizedTensor, QuantizedTensor] | None:
        """(Q(x, 1x128), Q(x, 128x1).t()), outside the share cache (dY has no siblings); None for other pairs.

        Two kernels: one-read versions (a 128x128 tile reduced both ways; column-then-row slices re-read
        from L2) are byte-exact but slower on the H200.
        """
        if block == (1, 128) and t_block == (128, 1) and x.dim() == 2 and x.numel() > 0 and x.is_floating_point():
            return quant.quantize_1x128(x, pow2_scale), quant.quantize_128x1_t(x, t_pow2_scale)
        return None

    def silu_mul_quantized(self, gate: torch.Tensor, up: torch.Tensor, block: Block, pow2_scale: bool) -> torch.Tensor | None:
        """silu(gate) * up from the fused kernel, its Q(h) put in the share cache for the consumer; None if unfit.

        Only with the share cache on, so the quantization is never computed for nothing.
        """
        if not self.share_results or block != (1, 128) or gate.dim() != 2 or gate.numel() == 0:
            return None
        if gate.dtype not in fused.KERNEL_DTYPES:
            return None
        qt, h = fused.silu_mul_quantize(gate, up, pow2_scale, return_hp=True)
        self._last_q.put(h, (block, pow2_scale), qt)
        return h

    def rmsnorm_quantized(self, x: torch.Tensor, weight: torch.Tensor, eps: float, block: Block,
                          pow2_scale: bool) -> torch.Tensor | None:
        """transformers' Llama RMSNorm of x [M, H] from the fused kernel, its Q(y) put in the share cache for the
        consumers; None if unfit (the caller runs the formula). Only with the share cache on."""
        if not self.share_results or block != (1, 128) or x.dim() != 2 or x.numel() == 0:
            return None
        if x.dtype not in fused.KERNEL_DTYPES or weight.dtype != x.dtype or weight.shape != (x.shape[1],):
            return None
        if not self._verdict(self._norm_verdicts, x, rmsnorm_probe.fused_norm_ok):
            return None
        qt, y = fused.rmsnorm_quantize(x, weight, eps, pow2_scale, return_hp=True)
        self._last_q.put(y, (block, pow2_scale), qt)
        return y

    def rmsnorm_backward(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(dx, dweight) of that RMSNorm from one kernel; None for operands it does not take."""
        if x.dim() != 2 or x.numel() == 0 or x.dtype not in fused.KERNEL_DTYPES:
            return None
        if dy.shape != x.shape or dy.dtype != x.dtype or weight.dtype != x.dtype or weight.shape != (x.shape[1],):
            return None
        if not self._verdict(self._norm_verdicts, x, rmsnorm_probe.fused_norm_ok):
            return None
        return fused.rmsnorm_backward(dy, x, weight, eps)

    @staticmethod
    def _verdict(table: dict, x: torch.Tensor, probe) -> bool:
        """A device probe's verdict for x's (device, dtype), kept in `table` (one dict lookup per call after the
        first); `probe(device, dtype)` reads results back, so it never runs inside a graph capture, where an
        unprobed device takes the unfused path."""
        key = (x.device, x.dtype)
        ok = table.get(key)
        if ok is None:
            if _capturing():
                return False
            ok = table[key] = probe(x.device, x.dtype)
        return ok

    def silu_mul_backward(self, dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(dgate, dup) of silu(gate) * up from one fused kernel, where the device probe found its bytes equal to
        autograd's kernels (`swiglu_probe`); None otherwise, or for operands it does not take."""
        if gate.dim() != 2 or gate.numel() == 0 or gate.dtype not in fused.KERNEL_DTYPES:
            return None
        if not (dh.shape == gate.shape == up.shape) or not (dh.dtype == up.dtype == gate.dtype):
            return None
        if not swiglu_probe.fused_backward_ok(fused.silu_mul_backward, gate.device, gate.dtype):
            return None
        return fused.silu_mul_backward(dh, gate, up)

    def silu_mul_backward_quantized(self, dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, block: Block,
                                    pow2_scale: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(dgate, dup) as the halves of the stacked gate/up GEMM's dY, from the fused kernel that also writes
        Q(dY, 1x128); that is kept for the GEMM's DGrad, whose dY quantizer takes it (`bind_quantize_dual`). None
        unless gate and up are the halves of one stacked output (only then is dY read as one tensor), or for operands
        the kernel does not take, or where the SwiGLU probe failed. Only with the share cache on."""
        if not self.share_results or block != (1, 128) or gate.dim() != 2 or gate.numel() == 0:
            return None
        if gate.dtype not in fused.KERNEL_DTYPES or not (dh.dtype == up.dtype == gate.dtype):
            return None
        if not (dh.shape == gate.shape == up.shape) or gate.shape[1] % 128:
            return None
        if dh.stride(1) != 1 or gate.stride(1) != 1 or up.stride(1) != 1:
            return None
        if not self._verdict(self._swiglu_dy_verdicts, gate, _stacked_swiglu_probe):
            return None
        if not column_blocks_of_one([gate, up]):
            return None
        d, qt = fused.silu_mul_backward_quantize(dh, gate, up, pow2_scale)
        self._kept_dy.put(d, (block, pow2_scale), qt)
        cols = gate.shape[1]
        return d[:, :cols], d[:, cols:]

    # ---- bound entry points: resolved once per (block, scale rule, device) by a layer's step plan --------------
    # Each returns a function of the 2-D floating input only (no per-call dispatch on block, dtype or device) that
    # gives the bytes of the matching method above; the caller guarantees a 2-D input with at least one element.
    def bind_quantize(self, block: Block, pow2_scale: bool):
        if block == (1, 128):
            extra = (block, pow2_scale)

            def make(x):
                return quant.quantize_1x128(x, pow2_scale)

            def quantize_shared(x: torch.Tensor) -> QuantizedTensor:
                if not x.is_floating_point():
                    return quantize_fp8(x, block, pow2_scale=pow2_scale, nonfinite="propagate")
                if self._kept_dy.key is not None:  # a DGrad-only backward of the stacked gate/up GEMM
                    kept = self._kept_dy.take(x, extra)
                    if kept is not None:
                        return kept
                return self._last_q.lookup(x, extra, make, x) if self.share_results else make(x)

            return quantize_shared
        return lambda x: self.quantize(x, block, pow2_scale)

    @staticmethod
    def _kernel_pad(device: torch.device, pad_to: int) -> int:
        """`pad_to` where the probe found the kernels' padded outputs byte-exact on `device`, else 0 (the callers
        then pad with `pad_columns`, a copy)."""
        if pad_to <= 1:
            return pad_to
        if _capturing():  # the probe reads results back: never inside a graph capture
            return 0

        def producers():
            cuda = cast_transpose.kernel_for(device, False) if cast_transpose.usable(device) else None
            out = {
                "128x1^T quantizer": lambda x, p: quant.quantize_128x1_t(x, pad_to=p),
                "Triton requantizer": lambda x, p: quant.requantize_1x128_to_128x1(
                    quant.quantize_1x128(x), transposed=True, kernel="triton", pad_to=p),
            }
            if cuda is not None:
                out["CUDA requantizer"] = lambda x, p: cast_transpose.launch(quant.quantize_1x128(x[: x.shape[0] // 16 * 16]), cuda, p)
            return out

        return pad_to if padding_probe.kernels_pad_ok(device, producers) else 0

    def bind_quantize_dual(self, block: Block, pow2_scale: bool, t_block: Block, t_pow2_scale: bool, device: torch.device,
                           pad_to: int = 0):
        """`pad_to`: the transposed result's columns (the tokens) zero-padded to a multiple of it, by the kernel where
        the device's probe passed. JETRL_DUAL_QUANT_FUSED=1 runs both layouts in one kernel that reads x once (same
        bytes, checked at first use); opt-in, because it runs slower than the two kernels on an H100 (heavier programs,
        each reducing a 128x128 tile both ways)."""
        if block == (1, 128) and t_block == (128, 1):
            kpad = self._kernel_pad(device, pad_to)
            extra = (block, pow2_scale)
            # A dY whose 1x128 bytes its producer already wrote (the fused SwiGLU backward, `_kept_dy`) needs only
            # the 128x1^T layout; the empty slot costs one attribute read.
            if os.environ.get("JETRL_DUAL_QUANT_FUSED") == "1" and _one_read_dual_ok(device, pow2_scale, t_pow2_scale, kpad):
                def dual(x: torch.Tensor) -> tuple[QuantizedTensor, QuantizedTensor]:
                    if self._kept_dy.key is not None and (q := self._kept_dy.take(x, extra)) is not None:
                        return q, quant.quantize_128x1_t(x, t_pow2_scale, pad_to=kpad)
                    return quant.quantize_dual_1x128_128x1_t(x, pow2_scale, t_pow2_scale, pad_to=kpad)
            else:
                def dual(x: torch.Tensor) -> tuple[QuantizedTensor, QuantizedTensor]:
                    if self._kept_dy.key is not None and (q := self._kept_dy.take(x, extra)) is not None:
                        return q, quant.quantize_128x1_t(x, t_pow2_scale, pad_to=kpad)
                    return quant.quantize_1x128(x, pow2_scale), quant.quantize_128x1_t(x, t_pow2_scale, pad_to=kpad)

            if kpad == pad_to:
                return dual

            def dual_copy_padded(x: torch.Tensor) -> tuple[QuantizedTensor, QuantizedTensor]:
                q, qt = dual(x)
                return q, pad_columns(qt, pad_to)

            return dual_copy_padded
        return None

    def bind_requantize_transposed(self, block: Block, pow2_scale: bool, device: torch.device, pad_to: int = 0):
        """requantize_transposed for 1x128 inputs: the CUDA kernel (resolved once) where the input's layout fits
        it, else the Triton one; kept for siblings that saved the same FP8 input (q/k/v). `pad_to` as in
        `bind_quantize_dual`."""
        if block != (128, 1):
            return lambda qt: pad_columns(self.requantize_transposed(qt, block, pow2_scale), pad_to)
        cuda_kernel = cast_transpose.kernel_for(device, pow2_scale) if cast_transpose.usable(device) else None
        kpad = self._kernel_pad(device, pad_to)

        def make_for(qt: QuantizedTensor):
            if cuda_kernel is not None and cast_transpose.supported_shape(qt):
                out = cast_transpose.launch(qt, cuda_kernel, kpad)
            else:
                out = quant.requantize_1x128_to_128x1(qt, transposed=True, pow2_scale=pow2_scale, kernel="triton", pad_to=kpad)
            return out if kpad == pad_to else pad_columns(out, pad_to)

        def requantize_t(qt: QuantizedTensor) -> QuantizedTensor:
            if qt.block != (1, 128):
                return pad_columns(self.requantize_transposed(qt, block, pow2_scale), pad_to)
            if not self.share_results:
                return make_for(qt)
            extra = (block, pow2_scale, pad_to, qt.scale.data_ptr(), qt.scale.stride())
            return self._last_rq_t.lookup(qt.data, extra, make_for, qt)

        return requantize_t

    def requantize_transposed(self, qt: QuantizedTensor, block: Block, pow2_scale: bool) -> QuantizedTensor:
        if qt.block == (1, 128) and block == (128, 1):
            if not self.share_results:
                return quant.requantize_1x128_to_128x1(qt, transposed=True, pow2_scale=pow2_scale)
            # Keyed on the FP8 bytes' storage; the scale lives and dies with them in the saved activation.
            extra = (block, pow2_scale, qt.scale.data_ptr(), qt.scale.stride())
            hit = self._last_rq_t.get(qt.data, extra)
            if hit is not None:
                return hit
            return self._last_rq_t.put(qt.data, extra, quant.requantize_1x128_to_128x1(qt, transposed=True, pow2_scale=pow2_scale))
        return self.requantize(qt, block, pow2_scale).t()
