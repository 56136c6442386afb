"""fp32 -> bf16 rounding spelled out in integer ops, so one kernel rounds the same way everywhere.

On the GPU `x.to(tl.bfloat16)` is `cvt.rn.bf16.f32` (round to nearest, ties to even), but Triton's CPU interpreter
truncates instead, which would make the interpreter tests of the batch-invariant kernels compare a different
rounding. Rounding the fp32 bits to nearest-even first makes the value exactly representable, so the final
cast is exact under either implementation and the result is the RNE value on both (NaN stays NaN).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["cast_rn"]


@triton.jit
def _bf16_rne(x):
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def cast_rn(x, DTYPE: tl.constexpr):
    """x (fp32) rounded to nearest-even in DTYPE (tl.bfloat16 or tl.float32)."""
    if DTYPE == tl.bfloat16:
        return _bf16_rne(x).to(tl.bfloat16)
    else:
        return x.to(DTYPE)
