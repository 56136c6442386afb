"""`InvariantLinear`: the high-precision linears (lm_head; every linear under bf16) with row-invariant forwards."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .common import require_triton

__all__ = ["InvariantLinear"]

# Rows per float64 block in InvariantLinear: bounds the float64 output to ~64 MiB whatever the batch.
_FP64_OUT_ELEMS = 1 << 23


def _fp64_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    w = weight.double().t()
    b = None if bias is None else bias.double()
    rows = max(1, _FP64_OUT_ELEMS // max(weight.shape[0], 1))
    out = x2.new_empty(x2.shape[0], weight.shape[0])
    for start in range(0, x2.shape[0], rows):  # row blocks: a row's result is the same in any block
        y = x2[start : start + rows].double() @ w
        out[start : start + rows] = (y if b is None else y + b).to(x2.dtype)
    return out


_GEMM_DTYPES = (torch.bfloat16, torch.float16)  # what the batch-invariant Triton GEMM multiplies


class _InvariantLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, triton_gemm: bool) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        ctx.save_for_backward(x2, weight)
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        if triton_gemm and x2.dtype in _GEMM_DTYPES and weight.dtype == x2.dtype:
            from ..kernels.invariant_gemm import linear_invariant  # K order fixed by K whatever M

            return linear_invariant(x2, weight, bias).reshape(*lead, weight.shape[0])
        return _fp64_linear(x2, weight, bias).reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        # The backward needs no invariance (nothing samples from it): ordinary kernels in the model dtype.
        x2, weight = ctx.saved_tensors
        gy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = (gy @ weight.to(gy.dtype)).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grad_w = (gy.t() @ x2.to(gy.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = gy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class InvariantLinear(nn.Linear):
    """nn.Linear whose forward gives each row the same bits whatever the batch.

    - `kernels="fp64"` (CPU): float64 accumulation, rounded once to the input dtype (invariant in practice);
    - `kernels="triton"` (CUDA): bf16/fp16 weights run `kernels.invariant_gemm.linear_invariant` (K order
      fixed by the weight's K, fp32 accumulation, invariant by construction); fp32 weights keep fp64.
    `backend` names which one it runs (the precision graph records it). Build it with
    `InvariantLinear.from_linear(linear, kernels)`: it adopts the same Parameter objects (optimizers, ZeRO
    partitioning and checkpoints see no change), as `Fp8Linear` does. The backward uses ordinary kernels."""

    kernels: str = "fp64"

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernels: str = "fp64") -> "InvariantLinear":
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        new.kernels = kernels
        for key in ("ds_id", "_z3_leaf"):
            if hasattr(linear, key):
                setattr(new, key, getattr(linear, key))
        return new

    @property
    def backend(self) -> str:
        return "triton_invariant" if self.kernels == "triton" and self.weight.dtype in _GEMM_DTYPES else "fp64"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"InvariantLinear: input last dim {x.shape[-1]} != in_features {self.in_features}")
        triton_gemm = self.backend == "triton_invariant"
        if triton_gemm:
            require_triton(x, "InvariantLinear")
        return _InvariantLinearFunction.apply(x, self.weight, self.bias, triton_gemm)
