"""Batch-invariant RMSNorm (and residual add + RMSNorm) for bitwise on-policy rollout.

One program per row; the row is read in fixed chunks of `HIDDEN_BLOCK` columns, whatever the hidden size or
the number of rows, and the sum of squares is reduced in one fixed order: a `HIDDEN_BLOCK`-wide fp32 vector
accumulates the chunks in ascending order, then a fixed pairwise tree (`_tree.pairwise_sum`, not `tl.sum`, whose
order follows the register layout Triton picks from the input's dtype, alignment and strides). A row's bits
therefore depend only on that row and the weight, never on M, on where the row sits in the batch, or on whether
it arrives as a fresh tensor or a view.

The rounding points are those of transformers' `LlamaRMSNorm` (also Qwen2/Qwen3/Mistral's), the trainer's
definition of the op:
    h   = x.float()                                  (+ residual: r = (x + residual) rounded to x's dtype first,
                                                       the unfused `residual + hidden_states` of the decoder layer)
    var = mean(h * h)                                fp32 (sum of fp32 squares, divided by H)
    h   = h * rsqrt(var + eps)                       fp32
    y   = weight * h.to(x.dtype)                     computed in fp32, rounded to promote(weight, x) dtype
rsqrt is formed as an IEEE-rounded `1 / sqrt_rn(var + eps)`: two correctly rounded operations, the same on every
device and in the interpreter (torch's CUDA `rsqrt` is approximate). The summation order of the mean differs
from torch's reduction, so `y` may differ from transformers' eager op by an ulp; bitwise equality holds
between the trainer and the engine because both call this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._rounding import cast_rn
from ._tree import pairwise_sum

__all__ = ["HIDDEN_BLOCK", "NUM_WARPS", "rms_norm", "fused_add_rms_norm"]

# Fixed for every launch: the reduction order is a function of these constants and the hidden size only.
HIDDEN_BLOCK = 1024
NUM_WARPS = 4

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}  # the model dtypes of this project


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, H, h_f, eps,
    sx, sres, sy, sres_out,
    BLOCK: tl.constexpr, HAS_RES: tl.constexpr, X_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, H, BLOCK):  # pass 1: the sum of squares, chunks in ascending order
        c = start + cols
        m = c < H
        h = tl.load(x_ptr + row * sx + c, mask=m, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * sres + c, mask=m, other=0.0)
            h = cast_rn(h.to(tl.float32) + r.to(tl.float32), X_DTYPE)  # rounded as the unfused add rounds it
            tl.store(res_out_ptr + row * sres_out + c, h, mask=m)
        h = h.to(tl.float32)
        acc += h * h
    var = tl.math.div_rn(pairwise_sum(acc, LEVELS=BLOCK.bit_length() - 1), h_f)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
    for start in range(0, H, BLOCK):  # pass 2: normalize, round to x's dtype, multiply by the weight in fp32
        c = start + cols
        m = c < H
        if HAS_RES:
            h = tl.load(res_out_ptr + row * sres_out + c, mask=m, other=0.0)
        else:
            h = tl.load(x_ptr + row * sx + c, mask=m, other=0.0)
        hn = cast_rn(h.to(tl.float32) * rstd, X_DTYPE).to(tl.float32)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * sy + c, cast_rn(w * hn, Y_DTYPE), mask=m)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor, what: str) -> None:
    if x.dim() < 1 or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"{what}: x [..., H] and weight [H] needed, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _TL_DTYPE or weight.dtype not in _TL_DTYPE:
        raise TypeError(f"{what}: bf16/fp32 tensors needed, got x {x.dtype} and weight {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"{what}: x is on {x.device} and weight on {weight.device}")


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    x2 = _rows(x, hidden)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if residual is not None:
        res2 = _rows(residual, hidden)
        res_out = torch.empty_like(x2)
    else:
        res2 = res_out = x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), y, res_out, hidden, float(hidden), float(eps),
            x2.stride(0), res2.stride(0), y.stride(0), res_out.stride(0),
            BLOCK=HIDDEN_BLOCK, HAS_RES=residual is not None, X_DTYPE=_TL_DTYPE[x.dtype], Y_DTYPE=_TL_DTYPE[out_dtype],
            num_warps=NUM_WARPS,
        )
    return y.reshape(*x.shape[:-1], hidden), res_out.reshape(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`LlamaRMSNorm(x)` with a batch-invariant reduction: x [..., H], weight [H]; returns promote(weight, x) dtype."""
    _check(x, weight, "rms_norm")
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(r), r) with r = x + residual rounded to x's dtype: the decoder layer's add, then its norm."""
    _check(x, weight, "fused_add_rms_norm")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"fused_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype} on one device"
        )
    return _launch(x, residual, weight, eps)
