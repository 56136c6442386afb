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

Sibling layers that read one input (q/k/v, gate/up) can run as one stacked GEMM: a layer tied into a
`grouped.Fp8LinearGroup` asks its group first, and the backward below serves both (`_input_and_weight_grads`).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .formats import QuantizedTensor
from .gemm import gemm_nt, prepare_gemm, resolve_backend
from .kernels import transpose_quantized
from .recipe import BackwardSpec, FpropSpec

__all__ = ["Fp8Linear", "mark_weights_updated"]

logger = logging.getLogger(__name__)
_lost_group_logged: list[str] = []  # the first layer that found its group gone (the warning is logged once)

# Bumped by `mark_weights_updated`: writers that bypass torch's version counter (DeepSpeed
# copies optimizer results in through `.data`) must call it after each optimizer step.
_generation = itertools.count()
_current_generation = [next(_generation)]


# Called by `mark_weights_updated` after the generation moves on: holders of FP8 weights derived from several layers
# (the stacked weights of `grouped.Fp8LinearGroup`) drop them there.
_weights_updated_hooks: list[Callable[[], None]] = []


def mark_weights_updated() -> int:
    """Invalidate every cached FP8 weight quantization. Call after each optimizer step.

    It also drops the activation quantizations kept for sibling sharing (`ops.release_shared_results`): they
    belong to the step that just ended, and would otherwise hold their bytes into the next one.
    """
    _current_generation[0] = next(_generation)
    ops.release_shared_results()
    for hook in _weights_updated_hooks:
        hook()
    return _current_generation[0]


def _is_zero3_param(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def _gather_if_partitioned(p: torch.Tensor) -> None:
    # DeepSpeed's backward hooks normally re-gather; this mirrors its own linear's safety net.
    status = getattr(p, "ds_status", None)
    if status is not None and getattr(status, "name", "") == "NOT_AVAILABLE":
        p.all_gather()


class _StepPlan:
    """What a step of one layer on one device derives from its recipe and backend, resolved once.

    The quantizers are bound to their implementation (`ops.quantizer` and friends: no per-call dispatch on block,
    device or implementation) and the GEMMs are the backend's `PreparedGemm`, which reads the layer's weight
    operands from the weight cache. Every call gives the bytes the unplanned calls (`ops.quantize`, `gemm_nt`) give.
    """

    __slots__ = ("requested", "backend", "gemm", "bwd_backend", "bwd_gemm", "quantize_x", "quantize_dy", "quantize_dy_t",
                 "quantize_dy_dual", "requantize_x_t", "quantize_x_t", "fp8_x", "fp8_w", "fp8_dgrad", "fp8_wgrad", "save_fp8")

    def __init__(self, layer: "Fp8Linear", device: torch.device) -> None:
        fp, bw = layer.fprop, layer.backward_spec or BackwardSpec()
        self.requested = (layer.gemm_backend, layer.backward_gemm_backend)
        self.backend = resolve_backend(layer.gemm_backend, device)
        self.gemm = prepare_gemm(self.backend, device)
        # DGrad and WGrad: the forward's backend unless the layer names another (batch-invariant numerics constrain
        # the forward only, so a bitwise model runs its backward on the fastest backend).
        bwd = layer.backward_gemm_backend
        self.bwd_backend = self.backend if bwd is None else resolve_backend(bwd, device)
        self.bwd_gemm = self.gemm if self.bwd_backend == self.backend else prepare_gemm(self.bwd_backend, device)
        self.fp8_x, self.fp8_w = fp.input.is_fp8, fp.weight.is_fp8
        self.quantize_x = ops.quantizer(fp.input, device) if self.fp8_x else None
        self.fp8_dgrad = bw.dgrad_grad_output.is_fp8
        self.fp8_wgrad = bw.wgrad_grad_output.is_fp8 and bw.wgrad_input.is_fp8
        self.save_fp8 = bw.saved_input.is_fp8 and self.fp8_x
        self.quantize_dy = ops.quantizer(bw.dgrad_grad_output, device) if self.fp8_dgrad else None
        # WGrad's operands come with their token count padded as the backward GEMM wants it (cuBLASLt and DeepGEMM:
        # a multiple of 128), zeros written by the quantizers, instead of the GEMM copying both into padded buffers.
        pad = self.bwd_gemm.wgrad_k_multiple
        self.quantize_dy_t = ops.transposed_quantizer(bw.wgrad_grad_output, device, pad) if self.fp8_wgrad else None
        # Both layouts of dY in one call, so an implementation can produce them from one read.
        self.quantize_dy_dual = (ops.dual_quantizer(bw.dgrad_grad_output, bw.wgrad_grad_output, device, pad)
                                 if self.fp8_dgrad and self.fp8_wgrad else None)
        # WGrad's input: the saved FP8 input re-grouped along tokens, or (no FP8 input saved) the saved one quantized so.
        self.requantize_x_t = ops.transposed_requantizer(bw.wgrad_input, device, pad) if self.fp8_wgrad else None
        self.quantize_x_t = ops.transposed_quantizer(bw.wgrad_input, device, pad) if self.fp8_wgrad else None


def _fprop(layer: "Fp8Linear", plan: _StepPlan, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype):
    """y = Q(x) . Q(W)^T (+ bias) as the layer's fprop spec says; returns y, the quantized x, and the quantized W
    when the layer keeps it cached (else None)."""
    xq = plan.quantize_x(x2) if plan.fp8_x else None
    if plan.fp8_w:
        wq, prepared, cached = layer._weight_operands(weight, plan)
        if xq is not None:
            y = plan.gemm.nt_weight(xq, prepared, wq, out_dtype)
        else:
            y = _mm(x2, wq, out_dtype)
    else:
        wq, cached = None, False
        y = _mm(xq if xq is not None else x2, weight, out_dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y, xq, wq if cached else None


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: "Fp8Linear",
                plan: _StepPlan) -> torch.Tensor:
        # x is 2-D: the caller flattens (and reshapes y) outside, so y is no view made in here, which autograd would
        # refuse a model's in-place write to (nn.Linear's output takes one).
        y, xq, wq = _fprop(layer, plan, x, weight, bias, x.dtype)
        ctx.layer, ctx.plan, ctx.x_dtype, ctx.has_bias = layer, plan, x.dtype, bias is not None
        # The forward's quantized weight, when the layer caches it anyway (not under ZeRO-3, where holding it from
        # forward to backward would keep a gathered FP8 copy of every layer alive): DGrad transposes it.
        ctx.wq = wq
        if any(ctx.needs_input_grad):
            saved_fp8 = plan.save_fp8 and xq is not None
            ctx.saved_fp8 = saved_fp8
            if saved_fp8:
                ctx.x_block = xq.block
                ctx.save_for_backward(xq.data, xq.scale, weight)
            else:
                ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        layer: Fp8Linear = ctx.layer
        if ctx.saved_fp8:
            xdata, xscale, weight = ctx.saved_tensors
            xq, x_hp = QuantizedTensor.trusted(xdata, xscale, ctx.x_block), None
        else:
            x_hp, weight = ctx.saved_tensors
            xq = None
        _gather_if_partitioned(weight)
        gy = grad_out
        grad_x, grad_w = _input_and_weight_grads(
            layer, ctx.plan, ctx.wq, weight, xq, x_hp, gy, ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.x_dtype
        )
        grad_b = gy.sum(0).to(layer.bias.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def _input_and_weight_grads(owner: Any, plan: _StepPlan, wq: QuantizedTensor | None, weight: torch.Tensor,
                            xq: QuantizedTensor | None, x_hp: torch.Tensor | None, gy: torch.Tensor,
                            need_dx: bool, need_dw: bool, x_dtype: torch.dtype):
    """(dX, dW) of y = x . W^T for the 2-D gradient gy, each None where not needed.

    `owner` supplies DGrad's operands (`_dgrad_operands`): one layer, or a group of sibling layers whose weights run
    as one stacked GEMM (`grouped.Fp8LinearGroup`, weight = the stacked weight there). `wq` is the forward's Q(W)
    when the owner keeps it cached; the FP8 input `xq` (or, unquantized, `x_hp`) is what the forward saved.
    """
    grad_x = grad_w = None
    gy_q = gy_t = None
    if need_dx and need_dw and plan.quantize_dy_dual is not None:
        gy_q, gy_t = plan.quantize_dy_dual(gy)
    if need_dx:
        if plan.fp8_dgrad:
            wq_t, prepared = owner._dgrad_operands(wq, weight, plan)
            gy_q = gy_q if gy_q is not None else plan.quantize_dy(gy)
            grad_x = plan.bwd_gemm.nt_weight(gy_q, prepared, wq_t, x_dtype)
        else:
            grad_x = (gy @ weight.to(gy.dtype)).to(x_dtype)
    if need_dw:
        if plan.fp8_wgrad:
            gy_t = gy_t if gy_t is not None else plan.quantize_dy_t(gy)
            x_t = plan.requantize_x_t(xq) if xq is not None else plan.quantize_x_t(x_hp)
            # The GEMM accumulates in fp32 and rounds once to the weight dtype: the same bytes as an
            # fp32 output cast afterwards, without the extra pass over dW.
            grad_w = plan.bwd_gemm.nt(gy_t, x_t, weight.dtype)
        else:
            x_in = xq.dequantize(gy.dtype) if xq is not None else x_hp.to(gy.dtype)
            grad_w = (gy.t() @ x_in).to(weight.dtype)
    return grad_x, grad_w


def transposed_entry(holder: Any, wq: QuantizedTensor, keep: bool = False) -> tuple:
    """(Q(W), Q(W)^T, {backend: prepared operands}) for a holder of a weight cache (`_wq_cache`, whose [1] is Q(W),
    and `_wq_t_cache`): a layer, or a group of stacked layers. Only the transpose of the cached Q(W) is kept (`keep`
    forces it: installed weights), not a ZeRO-3 gather's."""
    cached = holder._wq_t_cache
    if cached is not None and cached[0] is wq:
        return cached
    entry = (wq, transpose_quantized(wq), {})  # == wq.t(); a fast kernel on CUDA
    if keep or (holder._wq_cache is not None and holder._wq_cache[1] is wq):
        holder._wq_t_cache = entry
    return entry


def dgrad_operands(holder: Any, wq: QuantizedTensor, plan: _StepPlan, keep: bool = False) -> tuple[QuantizedTensor, object]:
    """(Q(W)^T, the plan's DGrad operands derived from it) for `holder`'s Q(W) `wq`, through `transposed_entry`."""
    entry = holder._wq_t_cache
    if entry is None or entry[0] is not wq:
        entry = transposed_entry(holder, wq, keep)
    prepared = entry[2]
    name = plan.bwd_backend
    if name not in prepared:
        prepared[name] = plan.bwd_gemm.weight(entry[1])
    return entry[1], prepared[name]


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
        self.backward_gemm_backend: str | None = None  # None: the forward's
        # Keep Q(W) (and, after a backward, Q(W)^T) between calls until the weight changes: 1 byte per weight each.
        # False: quantize in every call instead, as under ZeRO-3 (same bytes; no weight memory beyond BF16's).
        self.cache_weights = True
        self.fqn = ""
        self._resolved: dict[str, str] = {}
        self._plans: dict[torch.device, _StepPlan] = {}
        # (cache key, Q(W), {backend: prepared GEMM operands}); the transpose's entry is keyed by Q(W) itself.
        self._wq_cache: tuple[tuple, QuantizedTensor, dict] | None = None
        self._wq_t_cache: tuple[QuantizedTensor, QuantizedTensor, dict] | None = None
        self._installed: tuple[QuantizedTensor, dict] | None = None
        self._frozen_block: tuple[int, int] | None = None  # set by `freeze`: Q(W) lives in buffers, W is gone
        # Set by `grouped.fuse_projections`: the sibling group this layer's GEMM runs in (q/k/v, gate/up), and why a
        # group it would belong to could not be fused. Weak: the group holds its members and the members' parent
        # holds the group, so no reference cycle keeps a deleted model's GPU memory until the garbage collector runs.
        self._group_ref: weakref.ref | None = None
        self._group_skipped: str | None = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        fprop: FpropSpec,
        backward: BackwardSpec | None = None,
        gemm_backend: str = "auto",
        fqn: str = "",
        cache_weights: bool = True,
    ) -> "Fp8Linear":
        # Build on the meta device, then adopt the original Parameters (no copy, same objects).
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        new.fprop, new.backward_spec, new.gemm_backend, new.fqn = fprop, backward, gemm_backend, fqn
        new.cache_weights = cache_weights
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
        device = self.weight_device if self.weight_device.type != "meta" else torch.device("cpu")
        return resolve_backend(self.gemm_backend, device)

    def _plan(self, device: torch.device) -> _StepPlan:
        plan = self._plans.get(device)
        if plan is None or plan.requested != (self.gemm_backend, self.backward_gemm_backend):
            plan = self._plans[device] = _StepPlan(self, device)
            self._resolved[str(device)] = plan.backend
        return plan

    # ---- weight quantization cache ---------------------------------------------------
    def _cache_key(self, weight: torch.Tensor) -> tuple | None:
        if not self.cache_weights or _is_zero3_param(weight):
            # Not kept: the caller asked for no weight memory, or the gathered ZeRO-3 buffer is transient.
            # Quantizing is deterministic, so every call still sees the same bytes.
            return None
        return (weight.data_ptr(), weight._version, weight.shape, weight.dtype, _current_generation[0])

    def quantized_weight(self, weight: torch.Tensor | None = None) -> QuantizedTensor:
        """Q(W, fprop.weight): cached until the weight changes. The weight sync sends exactly these bytes."""
        if self._installed is not None:
            return self._installed[0]
        return self._quantized_weight_entry(self.weight if weight is None else weight)[1]

    def _quantized_weight_entry(self, weight: torch.Tensor) -> tuple:
        """(cache key or None, Q(W), {backend: prepared GEMM operands}): the cached entry while the weight is unchanged."""
        key = self._cache_key(weight)
        cached = self._wq_cache
        if key is not None and cached is not None and cached[0] == key:
            return cached
        with torch.no_grad():
            wq = ops.quantize(weight.detach(), self.fprop.weight)
        entry = (key, wq, {})
        if key is not None:
            self._wq_cache = entry
            # The transpose of the old weight is stale too. Dropped now, not at the next backward, so it does not
            # sit through the forward (the memory peak): 1 byte per weight, ~7 GB for an 8B model.
            self._wq_t_cache = None
        return entry

    def _weight_operands(self, weight: torch.Tensor, plan: _StepPlan) -> tuple[QuantizedTensor, object, bool]:
        """(Q(W), the plan's GEMM operands derived from it, whether the layer keeps them cached)."""
        if self._installed is not None:
            wq, prepared = self._installed
            cached = True
        else:
            key, wq, prepared = self._quantized_weight_entry(weight)
            cached = key is not None
        name = plan.backend
        if name not in prepared:
            prepared[name] = plan.gemm.weight(wq)
        return wq, prepared[name], cached

    def quantized_weight_t(self, weight: torch.Tensor | None = None) -> QuantizedTensor:
        """The exact transpose of `quantized_weight` (for DGrad), cached alongside it."""
        return self._transposed_entry(self.quantized_weight(weight))[1]

    def _transposed_entry(self, wq: QuantizedTensor) -> tuple:
        return transposed_entry(self, wq, self._installed is not None)

    def _dgrad_operands(self, wq: QuantizedTensor | None, weight: torch.Tensor, plan: _StepPlan) -> tuple[QuantizedTensor, object]:
        """(Q(W)^T, its prepared GEMM operands) for DGrad; `wq` is the forward's Q(W) when the layer caches it."""
        return dgrad_operands(self, wq if wq is not None else self.quantized_weight(weight), plan, self._installed is not None)

    def invalidate_cache(self) -> None:
        """Drop the cached FP8 weights (and the step plans, rebuilt at the next forward)."""
        self._wq_cache = self._wq_t_cache = None
        self._plans.clear()

    def install_quantized_weight(self, wq: QuantizedTensor | None) -> None:
        """Rollout-side modules: run on FP8 bytes received from the trainer, never re-quantizing.

        The installed tensor wins over the (stale) high-precision weight until the next install;
        `None` returns the module to quantizing its own weight.
        """
        if self.frozen:
            raise ValueError(f"{self.fqn or 'Fp8Linear'}: frozen (its FP8 weight is all it holds); freeze a fresh copy instead")
        if wq is not None:
            if tuple(wq.shape) != (self.out_features, self.in_features):
                raise ValueError(f"{self.fqn}: installed FP8 weight has shape {tuple(wq.shape)}, expected {(self.out_features, self.in_features)}")
            if wq.block != self.fprop.weight.granularity.block(tuple(wq.shape)):
                raise ValueError(f"{self.fqn}: installed FP8 weight has block {wq.block}, this layer's recipe wants {self.fprop.weight.granularity.value}")
        self._installed = None if wq is None else (wq, {})
        self.invalidate_cache()

    # ---- frozen (inference-only) layers ---------------------------------------------------
    @property
    def frozen(self) -> bool:
        """Whether `freeze` replaced the high-precision weight by its FP8 quantization."""
        return self._frozen_block is not None

    def freeze(self, device: torch.device | str | None = None) -> int:
        """Keep Q(W) and drop the high-precision weight: for models that never train (a reference policy).

        The forward runs on the bytes it would have quantized and cached (the same output); the layer then holds
        1 byte per weight instead of the weight's 2-4 plus the cached byte. Q(W) is kept as two non-persistent
        buffers (`weight_fp8`, `weight_fp8_scale`) that `.to()` moves with the module, never changing their dtype.
        `weight` stays readable for its shape and dtype, as a meta tensor: code that reads its values fails loudly.
        Freeze after moving the model to the device it runs on (quantizing there is fast), or pass `device` to
        quantize there and keep the result where the weight is (a model kept on the CPU; the same bytes either way).
        Returns the high-precision weight's bytes (freed unless something else still references it).
        """
        name = self.fqn or "Fp8Linear"
        if self.frozen:
            return 0
        w = self._parameters.get("weight")
        if not self.fprop.weight.is_fp8:
            raise ValueError(f"{name}: its recipe runs the forward on the high-precision weight; nothing to freeze to")
        if w is None or w.device.type == "meta" or _is_zero3_param(w):
            raise ValueError(f"{name}: no materialized weight to freeze (ZeRO-3 partitioned or meta); freeze a model that holds "
                             "its weights")
        if w.requires_grad:
            raise ValueError(f"{name}: its weight requires grad: a frozen layer cannot train; call requires_grad_(False) first")
        if self._group is not None:
            raise ValueError(f"{name}: part of a stacked projection group; freeze through freeze_fp8_weights(model)")
        with torch.no_grad():
            src = w.detach() if device is None else w.detach().to(device)
            wq = ops.quantize(src, self.fprop.weight)
            if wq.data.device != w.device:
                wq = QuantizedTensor.trusted(wq.data.to(w.device), wq.scale.to(w.device), wq.block)
        freed = w.numel() * w.element_size()
        self.invalidate_cache()
        del self._parameters["weight"]
        self.register_buffer("weight_fp8", wq.data, persistent=False)
        self.register_buffer("weight_fp8_scale", wq.scale, persistent=False)
        self.weight = torch.empty(w.shape, dtype=w.dtype, device="meta")  # a plain attribute: shape and dtype only
        self._frozen_block = wq.block
        self._installed = (wq, {})
        return freed

    def _apply(self, fn: Callable, recurse: bool = True):
        if not self.frozen:
            return super()._apply(fn, recurse)
        # `.to(dtype)`, `.half()` would turn the e4m3 bytes and fp32 scales into another format: move them, never cast.
        data, scale = self._buffers.pop("weight_fp8"), self._buffers.pop("weight_fp8_scale")
        try:
            super()._apply(fn, recurse)
            device = fn(torch.empty(0, device=data.device)).device
        finally:
            self._buffers["weight_fp8"], self._buffers["weight_fp8_scale"] = data, scale
        if device != data.device:
            data, scale = data.to(device), scale.to(device)
            self._buffers["weight_fp8"], self._buffers["weight_fp8_scale"] = data, scale
            self._installed = (QuantizedTensor.trusted(data, scale, self._frozen_block), {})  # plans are per device: kept
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.frozen:  # a checkpoint without the weight would load as a silently re-initialised layer
            raise RuntimeError(f"{self.fqn or prefix.rstrip('.') or 'Fp8Linear'}: frozen (FP8 weights only): no high-precision "
                               "weight to save; save the model before freeze_fp8_weights")
        super()._save_to_state_dict(destination, prefix, keep_vars)

    @property
    def _group(self) -> Any:
        """The `grouped.Fp8LinearGroup` this layer's GEMM runs in, or None."""
        ref = self._group_ref
        group = None if ref is None else ref()
        if group is None and ref is not None:
            self._group_lost()
        return group

    def _group_lost(self) -> None:
        # Module surgery replaced the parent that held this layer's group: run alone (same forward bytes), loudly.
        why = "its stacked-GEMM group went with the parent module that held it; call fuse_projections(model) again"
        self._group_ref, self._group_skipped = None, why
        if not _lost_group_logged:
            _lost_group_logged.append(self.fqn)
            logger.warning("%s: %s (logged once; the precision graph records it per layer)", self.fqn or "Fp8Linear", why)

    def __getstate__(self) -> dict:
        # Pickling / deepcopy keep the weights and settings, not what is derived from them: the step plans (bound
        # to this layer and its device; rebuilt at the next forward) and the cached FP8 weights. A weak reference
        # neither pickles nor deep-copies into the copy's group: the group's own __setstate__ points its (copied)
        # members back at it, and a layer copied without its group runs on its own.
        state = dict(super().__getstate__())
        state.update(_plans={}, _wq_cache=None, _wq_t_cache=None, _group_ref=None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.pop("_group", None)  # pickled before the reference was weak: the group re-points it
        self.__dict__.setdefault("_group_ref", None)

    @property
    def weight_device(self) -> torch.device:
        """The device the layer's weight (or, frozen, its FP8 weight) is on."""
        return self._buffers["weight_fp8"].device if self.frozen else self.weight.device

    # ---- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fprop.is_fp8:
            return F.linear(x, self.weight, self.bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.fqn or 'Fp8Linear'}: input last dim {x.shape[-1]} != in_features {self.in_features}")
        if x.numel() == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        ref = self._group_ref
        if ref is not None:
            group = ref()
            if group is None:
                self._group_lost()
            else:
                y = group.output_for(self, x)
                if y is not None:  # this layer's columns of the stacked GEMM its group ran for x
                    return y
        plan = self._plan(x.device)
        weight, bias = self.weight, self.bias
        if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
            # Rollout / reference / logprob passes: the same math without autograd's bookkeeping.
            if x.dim() == 2:
                return _fprop(self, plan, x, weight, bias, x.dtype)[0]
            y = _fprop(self, plan, x.reshape(-1, x.shape[-1]), weight, bias, x.dtype)[0]
            return y.reshape(*x.shape[:-1], y.shape[-1])
        if self.frozen:
            raise RuntimeError(f"{self.fqn or 'Fp8Linear'}: frozen (forward only), but its input requires grad; run frozen "
                               "models under torch.no_grad()")
        if x.dim() == 2:
            return _Fp8LinearFunction.apply(x, weight, bias, self, plan)
        y = _Fp8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, self, plan)
        return y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        bw = self.backward_spec
        bw_s = "bf16" if bw is None or not bw.is_fp8 else f"dgrad={bw.dgrad_grad_output.short_str()},wgrad={bw.wgrad_input.short_str()}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"x={self.fprop.input.short_str()}, W={self.fprop.weight.short_str()}, bwd={bw_s}, backend={self.gemm_backend}"
            + (f", backward_backend={self.backward_gemm_backend}" if self.backward_gemm_backend is not None else "")
            + (f", fused_gemm={self._group.label}" if self._group is not None else "")
            + (", frozen" if self.frozen else "")
        )
