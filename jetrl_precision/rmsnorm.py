"""RMSNorms that quantize their output for the FP8 projections they feed, in the same kernel (Llama/Qwen/Mistral).

A decoder layer's `input_layernorm` feeds q/k/v and its `post_attention_layernorm` feeds gate/up. In eager PyTorch
transformers' RMSNorm is a chain of elementwise and reduction kernels (the fp32 cast, the square, the mean, rsqrt,
the scaling, the cast back, the weight), and the FP8 projections then read its output once more to quantize it.
`FusedRMSNorm` computes the norm and its consumers' 1x128 quantization in one Triton kernel
(`kernels.fused.rmsnorm_quantize`) and hands Q(y) to them through the quantize implementation's share cache. Its
backward is one kernel as well (`kernels.fused.rmsnorm_backward`), and it saves x alone, where autograd keeps x in
fp32 beside the normalized x.

Numerics: the rounding points are transformers', the mean's summation order is the kernel's, so y may differ from
the eager formula by one ulp on a few elements. Every forward of a converted model runs the same kernel (the
policy's training forward, its old-logprob pass, the reference), so they agree with each other. The bitwise mode
replaces these norms with its batch-invariant kernel (`batch_invariant.make_batch_invariant`), which the engine
runs too. Without the kernels (CPU, no Triton) the forward is transformers' formula itself.

    fuse_rmsnorm(model)            # after convert_to_fp8 (which calls it unless fuse_rmsnorm=False)
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import nn

from . import ops
from .formats import Granularity
from .linear import Fp8Linear
from .recipe import TensorSpec

__all__ = ["RMSNORM_CLASSES", "NORM_CONSUMERS", "FusedRMSNorm", "rms_norm", "rms_norm_formula", "formula_grads", "fuse_rmsnorm"]

logger = logging.getLogger(__name__)

# Norm classes whose forward is transformers' Llama formula, weight * (x.float() * rsqrt(var + eps)).to(x.dtype);
# matched by class name so no model package has to be imported.
RMSNORM_CLASSES: tuple[str, ...] = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")

# Which norm of a decoder layer feeds which projections: (norm attribute, consumer block, projections).
NORM_CONSUMERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("input_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj")),
    ("post_attention_layernorm", "mlp", ("gate_proj", "up_proj")),
)


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward in torch ops: the definition every norm kernel of this package follows."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def formula_grads(x: torch.Tensor, weight: torch.Tensor, eps: float, dy: torch.Tensor,
                  needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight) of `rms_norm_formula` at (x, weight) for `dy`, by autograd, each None where `needs` (an autograd
    Function's `needs_input_grad`) says it is not wanted: the unfused module's gradients, for a norm kernel's
    backward where it has none of its own."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(needs[0])
        wg = weight.detach().requires_grad_(needs[1])
        inputs = [t for t in (xg, wg) if t.requires_grad]
        grads = iter(torch.autograd.grad(rms_norm_formula(xg, wg, eps), inputs, dy)) if inputs else iter(())
    return (next(grads) if needs[0] else None), (next(grads) if needs[1] else None)


class _FusedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, spec: TensorSpec) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = ops.rmsnorm_quantized(x2, weight, eps, spec)
        ctx.fused = y is not None
        if y is None:
            y = rms_norm_formula(x2, weight, eps)
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return y.view(x.shape[:-1] + y.shape[-1:])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        h = x.shape[-1]
        if ctx.fused:
            grads = ops.rmsnorm_backward(dy.reshape(-1, h), x.reshape(-1, h), weight, ctx.eps)
            if grads is not None:
                dx, dw = grads
                return (dx.view(x.shape) if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None, None
        return (*formula_grads(x, weight, ctx.eps, dy, ctx.needs_input_grad), None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, spec: TensorSpec | None = None) -> torch.Tensor:
    """transformers' Llama RMSNorm of x; with `spec` (the consumers' 1x128 FP8 input spec), where the quantize
    implementation has the kernels (CUDA), one kernel that also quantizes y for the consumers, and one kernel for the
    backward; elsewhere the formula and autograd's gradients of it."""
    if spec is None or x.numel() == 0:
        return rms_norm_formula(x, weight, eps)
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        # Nothing to differentiate (the reference and old-logprob passes): the kernel without an autograd node.
        y = ops.rmsnorm_quantized(x.reshape(-1, x.shape[-1]), weight, eps, spec)
        return rms_norm_formula(x, weight, eps) if y is None else y.view(x.shape[:-1] + y.shape[-1:])
    return _FusedRMSNormFunction.apply(x, weight, eps, spec)


def _consumer_spec(block: nn.Module | None, projections: tuple[str, ...]) -> TensorSpec | None:
    """The projections' common FP8 input spec when the fused kernel can produce it (1x128 e4m3), else None."""
    specs = set()
    for name in projections:
        layer = getattr(block, name, None) if block is not None else None
        if not isinstance(layer, Fp8Linear) or not layer.fprop.input.is_fp8:
            return None
        specs.add(layer.fprop.input)
    if len(specs) != 1:
        return None
    spec = specs.pop()
    return spec if spec.granularity == Granularity.BLOCK_1x128 else None


def _eps_of(norm: nn.Module) -> float | None:
    for key in ("variance_epsilon", "eps"):
        v = getattr(norm, key, None)
        if isinstance(v, (int, float)):
            return float(v)
    return None


class FusedRMSNorm(nn.Module):
    """A Llama-family RMSNorm that quantizes its output for the FP8 projections it feeds, in the same kernel.

    It adopts the original norm's weight Parameter (names, the state dict and ZeRO partitioning are unchanged);
    `source_class` records what it replaced, `spec` the consumers' FP8 input spec."""

    def __init__(self, norm: nn.Module, spec: TensorSpec) -> None:
        super().__init__()
        eps = _eps_of(norm)
        if not isinstance(getattr(norm, "weight", None), nn.Parameter) or eps is None:
            raise ValueError(f"FusedRMSNorm adopts a norm with a weight Parameter and an epsilon, got {type(norm).__name__}")
        self.weight = norm.weight
        self.variance_epsilon = eps
        self.spec = spec
        self.source_class = type(norm).__name__
        for key in ("ds_id", "_z3_leaf"):  # DeepSpeed's bookkeeping, when converted after it
            if hasattr(norm, key):
                setattr(self, key, getattr(norm, key))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, self.spec)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, source={self.source_class}"


def fuse_rmsnorm(model: nn.Module, classes: Iterable[type | str] = ()) -> int:
    """Replace (in place) every decoder layer's RMSNorm that feeds FP8 projections only by a `FusedRMSNorm`;
    returns how many were replaced.

    A norm qualifies when its class is in `RMSNORM_CLASSES` or `classes` (types or class names), it sits in a
    module as one of `NORM_CONSUMERS`' norm attributes, and every projection that attribute names is an Fp8Linear
    with one 1x128 FP8 input spec. Call it after `convert_to_fp8`, which calls it by default."""
    names = set(RMSNORM_CLASSES) | {c if isinstance(c, str) else c.__name__ for c in classes}
    replaced = 0
    for fqn, module in list(model.named_modules()):
        for norm_attr, block_attr, projections in NORM_CONSUMERS:
            norm = module._modules.get(norm_attr)
            if norm is None or type(norm).__name__ not in names:
                continue
            spec = _consumer_spec(module._modules.get(block_attr), projections)
            if spec is None:
                logger.debug("fuse_rmsnorm: %s.%s feeds projections that are not all 1x128 FP8; left as is", fqn, norm_attr)
                continue
            setattr(module, norm_attr, FusedRMSNorm(norm, spec))
            replaced += 1
    if replaced:
        logger.info("fuse_rmsnorm: %d RMSNorms fused with their consumers' FP8 quantization (one kernel each way on CUDA)", replaced)
    return replaced
