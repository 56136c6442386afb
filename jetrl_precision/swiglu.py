"""SwiGLU MLPs whose product is quantized for the down projection in the same kernel (Llama/Qwen/Mistral).

`down_proj(silu(gate_proj(x)) * up_proj(x))` costs three elementwise passes in eager PyTorch (silu, the product,
then the down projection's 1x128 quantization of the product), and autograd keeps silu(gate) alive next to gate
and up. `SwiGLUMLP` computes h = silu(gate) * up and Q(h, 1x128) in one Triton kernel
(`kernels.fused.silu_mul_quantize`) and hands Q(h) to the down projection through the quantize implementation's
share cache, so that layer does not quantize h again. Its backward recomputes silu(gate) from the saved gate.

Nothing changes numerically: the kernel's h is bit-for-bit `F.silu(gate) * up` and its Q(h) is the reference
quantizer's (GPU tests). The backward gives the bytes of the aten ops autograd runs for the unfused expression: in
one kernel (`kernels.fused.silu_mul_backward`) where a probe on the device found every byte equal
(`kernels.swiglu_probe`), else those ops themselves. On a device without the kernels the forward is the plain
expression; only the saved-tensor saving remains.

Where gate and up run as one stacked GEMM (`grouped.py`), their gradients are that GEMM's dY, [M, 2I], which its
DGrad quantizes 1x128. The backward kernel then also writes Q(dY) (`kernels.fused.silu_mul_backward_quantize`,
the reference quantizer's bytes of the same dY), which the GEMM's dY quantizer takes instead of reading dY again:
dY is the block's widest gradient. The price is memory: Q(dY) is allocated while the backward's inputs are alive.

    fuse_swiglu(model)            # after convert_to_fp8 (which calls it unless fuse_swiglu=False)
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .formats import Granularity
from .grouped import adopt_projection_groups
from .linear import Fp8Linear
from .recipe import TensorSpec

__all__ = ["SWIGLU_MLP_CLASSES", "SwiGLUMLP", "silu_mul", "fuse_swiglu", "set_dy_quantization"]

logger = logging.getLogger(__name__)

# MLP classes whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)); matched by class name so no
# model package has to be imported. Other classes opt in through `fuse_swiglu(model, classes=...)`.
SWIGLU_MLP_CLASSES: tuple[str, ...] = (
    "LlamaMLP",
    "GraniteMLP",
    "Olmo2MLP",
    "MistralMLP",
    "Qwen2MLP",
    "Qwen3MLP",
    "Qwen2MoeMLP",
    "Qwen3MoeMLP",
)


class _SiluMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, spec: TensorSpec | None,
                dy_spec: TensorSpec | None) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.dy_spec = dy_spec
        if spec is not None:
            h = ops.silu_mul_quantized(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]), spec)
            if h is not None:
                return h.view(gate.shape)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
            width = gate.shape[-1]
            args = (dh.reshape(-1, width), gate.reshape(-1, width), up.reshape(-1, width))
            grads = None
            if ctx.dy_spec is not None:  # also quantizes the stacked dY for the gate/up GEMM's DGrad
                grads = ops.silu_mul_backward_quantized(*args, ctx.dy_spec)
            if grads is None:
                grads = ops.silu_mul_backward(*args)
            if grads is not None:  # one kernel, autograd's bytes (checked per device)
                return grads[0].view(gate.shape), grads[1].view(up.shape), None, None
        # The ops autograd records for F.silu(gate) * up, in its order: mul's backward, then silu's.
        dgate = torch.ops.aten.silu_backward(dh * up, gate) if ctx.needs_input_grad[0] else None
        dup = dh * F.silu(gate) if ctx.needs_input_grad[1] else None
        return dgate, dup, None, None


def silu_mul(gate: torch.Tensor, up: torch.Tensor, spec: TensorSpec | None = None,
             dy_spec: TensorSpec | None = None) -> torch.Tensor:
    """silu(gate) * up, saving only gate and up for backward; with `spec` (the consumer's 1x128 FP8 input spec)
    a fast implementation also quantizes the product in the same kernel and keeps Q(h) for the consumer. With
    `dy_spec` (the DGrad dY spec of the stacked gate/up GEMM that produced gate and up), the backward likewise
    quantizes [dgate, dup] for that GEMM's DGrad in its own kernel."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul needs gate and up of one shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
                         f"and {tuple(up.shape)} {up.dtype}")
    return _SiluMulFunction.apply(gate, up, spec, dy_spec)


def _is_silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is F.silu


def _consumer_spec(down_proj: nn.Module) -> TensorSpec | None:
    """The down projection's FP8 input spec when the fused kernel can produce it (1x128 e4m3), else None."""
    if isinstance(down_proj, Fp8Linear) and down_proj.fprop.input.is_fp8:
        spec = down_proj.fprop.input
        return spec if spec.granularity == Granularity.BLOCK_1x128 else None
    return None


def _stacked_dy_spec(gate_proj: nn.Module, up_proj: nn.Module) -> TensorSpec | None:
    """The DGrad dY spec of gate/up when they run as one stacked GEMM (`grouped.py`) whose DGrad takes 1x128 e4m3,
    else None. Whether a given call did run stacked is known from its outputs' layout, checked in the backward."""
    group = getattr(gate_proj, "_group", None)
    if not isinstance(gate_proj, Fp8Linear) or group is None or group.off is not None:
        return None
    if tuple(group.members) != (gate_proj, up_proj) or gate_proj.backward_spec is None:
        return None
    spec = gate_proj.backward_spec.dgrad_grad_output
    return spec if spec.is_fp8 and spec.granularity == Granularity.BLOCK_1x128 else None


class SwiGLUMLP(nn.Module):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))` with the product fused and quantized for down_proj.

    It adopts the original MLP's submodules, so parameter names, the state dict and ZeRO partitioning are
    unchanged; `source_class` records what it replaced. `quantize_dy` (default True): where gate and up run as one
    stacked GEMM, the backward kernel also writes that GEMM's 1x128 FP8 dY (same bytes as its own quantizer; one
    Q(dY) more of memory at the MLP backward's peak, False gives it back).
    """

    def __init__(self, mlp: nn.Module, quantize_dy: bool = True) -> None:
        super().__init__()
        self.gate_proj = mlp.gate_proj
        self.up_proj = mlp.up_proj
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn if isinstance(mlp.act_fn, nn.Module) else nn.SiLU()
        self.source_class = type(mlp).__name__
        self.quantize_dy = quantize_dy
        adopt_projection_groups(mlp, self)  # gate/up's stacked GEMM, if fuse_projections ran first

    @property
    def fused_quantization(self) -> bool:
        """True when the product's 1x128 quantization is produced by the SwiGLU kernel (on a capable device)."""
        return _consumer_spec(self.down_proj) is not None

    @property
    def fused_dy_quantization(self) -> bool:
        """True when the backward kernel also quantizes the stacked gate/up GEMM's dY (on a capable device)."""
        return self.quantize_dy and _stacked_dy_spec(self.gate_proj, self.up_proj) is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dy_spec = _stacked_dy_spec(self.gate_proj, self.up_proj) if self.quantize_dy else None
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x), _consumer_spec(self.down_proj), dy_spec))

    def extra_repr(self) -> str:
        return (f"source={self.source_class}, fused_quantization={self.fused_quantization}, "
                f"fused_dy_quantization={self.fused_dy_quantization}")


def fuse_swiglu(model: nn.Module, classes: Iterable[type | str] = ()) -> int:
    """Replace every SwiGLU MLP in `model` (in place) by a `SwiGLUMLP`; returns how many were replaced.

    An MLP qualifies when its class is in `SWIGLU_MLP_CLASSES` or `classes` (types or class names) and it has
    gate_proj/up_proj/down_proj submodules and a SiLU `act_fn`. Call it after `convert_to_fp8`, which calls it by
    default, so the fused module sees the FP8 down projection.
    """
    names = set(SWIGLU_MLP_CLASSES) | {c if isinstance(c, str) else c.__name__ for c in classes}
    replaced = 0
    for fqn, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child).__name__ not in names:
                continue
            if not all(isinstance(getattr(child, p, None), nn.Module) for p in ("gate_proj", "up_proj", "down_proj")):
                logger.warning("fuse_swiglu: %s.%s (%s) has no gate_proj/up_proj/down_proj; left as is",
                               fqn, child_name, type(child).__name__)
                continue
            if not _is_silu(getattr(child, "act_fn", None)):
                logger.info("fuse_swiglu: %s.%s uses %s, not SiLU; left as is", fqn, child_name,
                            type(getattr(child, "act_fn", None)).__name__)
                continue
            setattr(module, child_name, SwiGLUMLP(child))
            replaced += 1
    if replaced:
        logger.info("fuse_swiglu: %d SwiGLU MLPs fused (silu*up and its FP8 quantization in one kernel on CUDA)", replaced)
    return replaced


def set_dy_quantization(model: nn.Module, enabled: bool) -> int:
    """Turn the SwiGLU backward's quantization of gate/up's dY on or off in every `SwiGLUMLP` of `model` (off: the
    stacked GEMM's own quantizer reads dY again, and one Q(dY) less is alive at the MLP backward's peak); returns
    how many MLPs were set. The bytes are the same either way."""
    mlps = [m for m in model.modules() if isinstance(m, SwiGLUMLP)]
    for m in mlps:
        m.quantize_dy = enabled
    return len(mlps)
