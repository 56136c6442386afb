"""`InvariantRMSNorm`: a Llama-family RMSNorm on the batch-invariant Triton kernel (`kernels.invariant_norm`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..rmsnorm import RMSNORM_CLASSES, formula_grads
from .common import require_triton

__all__ = ["InvariantRMSNorm", "NORM_CLASSES"]

# weight * x/rms, cast first; FusedRMSNorm (an FP8 model's norms) computes the same formula
NORM_CLASSES = (*RMSNORM_CLASSES, "FusedRMSNorm")


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from ..kernels.invariant_norm import rms_norm

        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        # Nothing samples from the backward: transformers' formula in torch ops, differentiated by autograd.
        x, weight = ctx.saved_tensors
        return (*formula_grads(x, weight, ctx.eps, grad_out, ctx.needs_input_grad), None)


class InvariantRMSNorm(nn.Module):
    """A Llama-family RMSNorm whose forward is the batch-invariant Triton kernel (`kernels.invariant_norm`).

    `InvariantRMSNorm.from_norm(norm)` adopts the same weight Parameter and epsilon; the rounding points are
    transformers' (`weight * (x.float() * rsqrt(var + eps)).to(x.dtype)`), the backward is transformers' formula."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = float(eps)

    @classmethod
    def from_norm(cls, norm: nn.Module) -> "InvariantRMSNorm":
        new = cls(norm.weight, norm.variance_epsilon)
        for key in ("ds_id", "_z3_leaf"):
            if hasattr(norm, key):
                setattr(new, key, getattr(norm, key))
        return new

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        require_triton(hidden_states, "InvariantRMSNorm")
        return _RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
