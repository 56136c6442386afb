"""Shared Triton device functions: the reference quantizer's arithmetic, step by step.

Each helper mirrors one line of `quantize.quantize_fp8` so the bytes match exactly:
- amax is a max of |x| in fp32, floored at 1e-10, NaN kept visible (torch's amax propagates NaN): one
  NaN-propagating max reduction carries both (a separate NaN-flag reduction would cost the 128x1 kernels a
  second cross-warp round);
- scale = amax / 448 with IEEE round-to-nearest division (`div_rn`, not Triton's approximate `/`);
- pow2 rounding is frexp/ldexp on the bits (non-finite scales become 1.0, as torch.frexp makes them);
- q = e4m3(clamp(x / scale, -448, 448)), x / scale the IEEE quotient from a per-group reciprocal and one FMA
  correction (`quantize_values`). The clamp is the conversion's own: fp32 -> e4m3 compiles to
  `cvt.rn.satfinite.e4m3x2.f32` on sm89+, which rounds to nearest-even and saturates +-inf and anything past 448
  to +-448, and keeps NaN NaN - what clamp-then-convert gives, one instruction per element cheaper.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["abs_max", "group_scale", "quantize_values"]


@triton.jit
def _max_propagate_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def abs_max(x, axis: tl.constexpr):
    """max |x| along `axis`; NaN if the group holds a NaN (tl.max would drop it)."""
    return tl.reduce(tl.abs(x), axis, _max_propagate_nan)


@triton.jit
def group_scale(amax, POW2: tl.constexpr):
    """fp32 scale from a group's `abs_max` (NaN stays NaN)."""
    amax = tl.maximum(amax, 1e-10, propagate_nan=tl.PropagateNan.ALL)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        expo = bits & 0x7F800000
        # scale = 1.f * 2^E: an exact power of two (f == 0) stays, anything else rounds up to 2^(E+1).
        up = tl.where((bits & 0x7FFFFF) != 0, expo + 0x800000, expo)
        pow2 = up.to(tl.float32, bitcast=True)
        scale = tl.where(expo != 0x7F800000, pow2, 1.0)
    return scale


@triton.jit
def quantize_values(x, scale, POW2: tl.constexpr):
    """e4m3(clamp(x / scale, -448, 448)) with x / scale the IEEE quotient RN(x / scale) and RNE conversion.

    The clamp is left to the saturating conversion (module docstring): one SASS instruction per element fewer,
    which the bandwidth-bound 128x1^T writer feels.

    The quotient takes one correctly rounded reciprocal per group, y = RN(1 / scale), then one FMA correction
    per element (none under POW2), q -= RN(q * scale - x) * y. That is RN(x / scale) exactly: x * y is within
    one ulp of the quotient, its residual is exact, and with y correctly rounded one correction lands on the
    correctly rounded quotient (Markstein's theorem; `div.rn`'s fast path needs two, since it starts from an
    approximate reciprocal). It is *not* x * (1 / scale), which differs in the last bit. Where y == 0
    (scale = inf) the residual uses 0 for the scale, so x / inf stays a signed zero, and writing the residual
    as q * scale - x keeps x = -0 negative. `benchmarks/division_exactness.py` checks this in exact rational
    arithmetic; the GPU tests compare every kernel's bytes with `quantize_fp8`. The kernels compile to fewer
    SASS instructions than with a per-element `div_rn` (`benchmarks/sass_count.py`).
    """
    recip = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)  # per group, before the broadcast
    s_res = tl.where(recip == 0.0, 0.0, scale)
    x, recip = tl.broadcast(x, recip)
    q = x * recip
    if not POW2:
        # A power-of-two scale (2^-42 .. 2^120, or 1.0 for a non-finite one) has an exact reciprocal, so x * y
        # already is the IEEE quotient (+-inf included); any other scale needs the correction.
        x, s_res = tl.broadcast(x, s_res)
        # Negation as `* -1.0`: Triton's unary minus is 0 - v, which turns -0 into +0 (and costs an FADD).
        # One correction suffices (Markstein): recip is the correctly rounded 1/scale and x * recip is within
        # one ulp of the quotient, so q - RN(q*scale - x) * recip, rounded once, is RN(x / scale).
        q = tl.math.fma(tl.math.fma(q, s_res, x * -1.0) * -1.0, recip, q)
    return q.to(tl.float8e4nv)
