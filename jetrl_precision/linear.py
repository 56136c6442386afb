"""The FP8 linear layer: one autograd Function carrying the whole Jet-RL flow.

fprop   y  = Q(x, 1x128) . Q(W, 128x128)                      -> out dtype = x.dtype
save    Q(x, 1x128) in FP8 (about half the bytes of bf16), not x
dgrad   dX = Q(dY, 1x128) . Q(W, 128x128)^T   (exact block transpose, no re-quantization)
wgrad   dW = Q(dY, 128x1)^T . R(Q(x,1x128), 128x1)^T   (R: re-quantize the saved FP8 along tokens)
Gradients leave the Function in the model dtype (bf16 in training), never in FP8.

The module owns the *same* Parameter objects as the nn.Linear it replaces, so optimizers,
DeepSpeed ZeRO partitioning and checkpoints see no difference. The 128x128 weight
quantization is cached until the weight changes, so a rollout and the following training
forward use the very same bytes (and the weight sync sends those bytes).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .formats import QuantizedTensor
from .gemm import gemm_nt, resolve_backend
from .kernels import transpose_quantized
from .recipe import BackwardSpec, FpropSpec

__all__ = ["Fp8Linear", "mark_weights_updated"]

# Bumped by `mark_weights_updated`: writers that bypass torch's version counter (DeepSpeed
# copies optimizer results in through `.data`) must call it after each optimizer step.
_generation = itertools.count()
_current_generation = [next(_generation)]


def mark_weights_updated() -> int:
    """Invalidate every cached FP8 weight quantization. Call after each optimizer step.

    It also drops the activation quantizations kept for sibling sharing (`ops.release_shared_results`): they
    belong to the step that just ended, and would otherwise hold their bytes into the next one.
    """
    _current_generation[0] = next(_generation)
    ops.release_shared_results()
    return _current_generation[0]


def _is_zero3_param(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def _gather_if_partitioned(p: torch.Tensor) -> None:
    # DeepSpeed's backward hooks normally re-gather; this mirrors its own linear's safety net.
    status = getattr(p, "ds_status", None)
    if status is not None and getattr(status, "name", "") == "NOT_AVAILABLE":
        p.all_gather()


def _fprop(layer: "Fp8Linear", x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, backend: str):
    """y = Q(x) . Q(W)^T (+ bias) as the layer's fprop spec says; returns y and the quantized x."""
    fprop = layer.fprop
    xq = ops.quantize(x2, fprop.input) if fprop.input.is_fp8 else None
    wq = layer.quantized_weight(weight) if fprop.weight.is_fp8 else None
    y = _mm(xq if xq is not None else x2, wq if wq is not None else weight, out_dtype, backend)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y, xq


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: "Fp8Linear") -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        backend = layer.backend_for(x.device)
        y, xq = _fprop(layer, x2, weight, bias, x.dtype, backend)
        ctx.layer, ctx.backend, ctx.x_shape, ctx.x_dtype, ctx.has_bias = layer, backend, x.shape, x.dtype, bias is not None
        if any(ctx.needs_input_grad):
            saved_fp8 = layer.backward_spec is not None and layer.backward_spec.saved_input.is_fp8 and xq is not None
            ctx.saved_fp8 = saved_fp8
            if saved_fp8:
                ctx.x_block = xq.block
                ctx.save_for_backward(xq.data, xq.scale, weight)
            else:
                ctx.save_for_backward(x2, weight)
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        layer: Fp8Linear = ctx.layer
        bw = layer.backward_spec or BackwardSpec()
        if ctx.saved_fp8:
            xdata, xscale, weight = ctx.saved_tensors
            xq = QuantizedTensor(xdata, xscale, ctx.x_block)
            x_hp = None
        else:
            x_hp, weight = ctx.saved_tensors
            xq = None
        _gather_if_partitioned(weight)
        n = grad_out.shape[-1]
        gy = grad_out.reshape(-1, n)
        grad_x = grad_w = grad_b = None

        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp8_wgrad = bw.wgrad_grad_output.is_fp8 and bw.wgrad_input.is_fp8
        gy_q = gy_t = None
        if need_dx and need_dw and bw.dgrad_grad_output.is_fp8 and fp8_wgrad:
            # Both layouts of dY in one call, so a kernel can produce them from one read.
            gy_q, gy_t = ops.quantize_dual(gy, bw.dgrad_grad_output, bw.wgrad_grad_output)

        if need_dx:
            if bw.dgrad_grad_output.is_fp8:
                wq_t = layer.quantized_weight_t(weight)
                gy_q = gy_q if gy_q is not None else ops.quantize(gy, bw.dgrad_grad_output)
                grad_x = gemm_nt(gy_q, wq_t, ctx.x_dtype, ctx.backend)
            else:
                grad_x = (gy @ weight.to(gy.dtype)).to(ctx.x_dtype)
            grad_x = grad_x.reshape(ctx.x_shape)

        if need_dw:
            if fp8_wgrad:
                gy_t = gy_t if gy_t is not None else ops.quantize_transposed(gy, bw.wgrad_grad_output)
                x_t = ops.requantize_transposed(xq, bw.wgrad_input) if xq is not None else ops.quantize_transposed(x_hp, bw.wgrad_input)
                # The GEMM accumulates in fp32 and rounds once to the weight dtype: the same bytes as an
                # fp32 output cast afterwards, without the extra pass over dW.
                grad_w = gemm_nt(gy_t, x_t, weight.dtype, ctx.backend)
            else:
                x_in = xq.dequantize(gy.dtype) if xq is not None else x_hp.to(gy.dtype)
                grad_w = (gy.t() @ x_in).to(weight.dtype)

        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = gy.sum(0).to(layer.bias.dtype)
        return grad_x, grad_w, grad_b, None


def _mm(a: torch.Tensor | QuantizedTensor, b: torch.Tensor | QuantizedTensor, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """a @ b^T where either side may be FP8; mixed pairs dequantize the FP8 side (fp8_rollout-style W8A16 is not a recipe)."""
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        return gemm_nt(a, b, out_dtype, backend)
    a_hp = a.dequantize(torch.float32) if isinstance(a, QuantizedTensor) else a.float()
    b_hp = b.dequantize(torch.float32) if isinstance(b, QuantizedTensor) else b.float()
    return (a_hp @ b_hp.t()).to(out_dtype)


class Fp8Linear(nn.Linear):
    """Drop-in replacement for nn.Linear that runs its GEMMs in FP8 as a recipe says.

    Build it with `Fp8Linear.from_linear(linear, fprop, backward)`; `convert_to_fp8` does it
    for a whole model.
    """

    fprop: FpropSpec
    backward_spec: BackwardSpec | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # use from_linear
        super().__init__(*args, **kwargs)
        self.fprop = FpropSpec()
        self.backward_spec = None
        self.gemm_backend = "auto"
        self.fqn = ""
        self._resolved: dict[str, str] = {}
        self._wq_cache: tuple[tuple, QuantizedTensor] | None = None
        self._wq_t_cache: tuple[tuple, QuantizedTensor] | None = None
        self._installed: tuple[QuantizedTensor, QuantizedTensor | None] | None = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        fprop: FpropSpec,
        backward: BackwardSpec | None = None,
        gemm_backend: str = "auto",
        fqn: str = "",
    ) -> "Fp8Linear":
        # Build on the meta device, then adopt the original Parameters (no copy, same objects).
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        new.fprop, new.backward_spec, new.gemm_backend, new.fqn = fprop, backward, gemm_backend, fqn
        # Carry over hooks/attributes DeepSpeed or PEFT may have set on the module itself.
        for key in ("ds_id", "_z3_leaf"):
            if hasattr(linear, key):
                setattr(new, key, getattr(linear, key))
        return new

    # ---- backend ----------------------------------------------------------------------
    def backend_for(self, device: torch.device) -> str:
        key = str(device)
        if key not in self._resolved:
            self._resolved[key] = resolve_backend(self.gemm_backend, device)
        return self._resolved[key]

    @property
    def resolved_backend(self) -> str:
        """The backend this layer runs on (resolved for its weight's device if no forward ran yet)."""
        if self._resolved:
            return next(iter(self._resolved.values()))
        device = self.weight.device if self.weight.device.type != "meta" else torch.device("cpu")
        return resolve_backend(self.gemm_backend, device)

    # ---- weight quantization cache ---------------------------------------------------
    def _cache_key(self, weight: torch.Tensor) -> tuple | None:
        if _is_zero3_param(weight):
            return None  # the gathered buffer is transient under ZeRO-3; quantizing is deterministic anyway
        return (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, _current_generation[0])

    def quantized_weight(self, weight: torch.Tensor | None = None) -> QuantizedTensor:
        """Q(W, fprop.weight): cached until the weight changes. The weight sync sends exactly these bytes."""
        if self._installed is not None:
            return self._installed[0]
        weight = self.weight if weight is None else weight
        key = self._cache_key(weight)
        if key is not None and self._wq_cache is not None and self._wq_cache[0] == key:
            return self._wq_cache[1]
        with torch.no_grad():
            wq = ops.quantize(weight.detach(), self.fprop.weight)
        if key is not None:
            self._wq_cache = (key, wq)
        if self._wq_t_cache is not None and self._wq_t_cache[0] != key:
            # The transpose of the old weight is stale too. Dropped now, not at the next backward, so it does not
            # sit through the forward (the memory peak): 1 byte per weight, ~7 GB for an 8B model.
            self._wq_t_cache = None
        return wq

    def quantized_weight_t(self, weight: torch.Tensor | None = None) -> QuantizedTensor:
        """The exact transpose of `quantized_weight` (for DGrad), cached alongside it."""
        weight = self.weight if weight is None else weight
        key = self._cache_key(weight)
        if key is not None and self._wq_t_cache is not None and self._wq_t_cache[0] == key:
            return self._wq_t_cache[1]
        wq_t = transpose_quantized(self.quantized_weight(weight))  # == .t(); a fast kernel on CUDA
        if key is not None:
            self._wq_t_cache = (key, wq_t)
        return wq_t

    def invalidate_cache(self) -> None:
        self._wq_cache = self._wq_t_cache = None

    def install_quantized_weight(self, wq: QuantizedTensor | None) -> None:
        """Rollout-side modules: run on FP8 bytes received from the trainer, never re-quantizing.

        The installed tensor wins over the (stale) high-precision weight until the next install;
        `None` returns the module to quantizing its own weight.
        """
        if wq is not None:
            if tuple(wq.shape) != (self.out_features, self.in_features):
                raise ValueError(f"{self.fqn}: installed FP8 weight has shape {tuple(wq.shape)}, expected {(self.out_features, self.in_features)}")
            if wq.block != self.fprop.weight.granularity.block(tuple(wq.shape)):
                raise ValueError(f"{self.fqn}: installed FP8 weight has block {wq.block}, this layer's recipe wants {self.fprop.weight.granularity.value}")
        self._installed = None if wq is None else (wq, None)
        self.invalidate_cache()

    # ---- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fprop.is_fp8:
            return F.linear(x, self.weight, self.bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.fqn or 'Fp8Linear'}: input last dim {x.shape[-1]} != in_features {self.in_features}")
        if x.numel() == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        if not torch.is_grad_enabled() or not (x.requires_grad or self.weight.requires_grad):
            # Rollout / reference / logprob passes: the same math without autograd's bookkeeping.
            y, _ = _fprop(self, x.reshape(-1, x.shape[-1]), self.weight, self.bias, x.dtype, self.backend_for(x.device))
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return _Fp8LinearFunction.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        bw = self.backward_spec
        bw_s = "bf16" if bw is None or not bw.is_fp8 else f"dgrad={bw.dgrad_grad_output.short_str()},wgrad={bw.wgrad_input.short_str()}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"x={self.fprop.input.short_str()}, W={self.fprop.weight.short_str()}, bwd={bw_s}, backend={self.gemm_backend}"
        )
