"""Exact-arithmetic check of the FP8 quantizers' division (`kernels/_common.quantize_values`).

The bytes must equal the reference quantizer's `e4m3(clamp(x / scale))` with IEEE division. A per-element
`div_rn` is about a third of the SASS instructions each element costs (`sass_count.py`), so the kernels use a per-group reciprocal y = RN(1/s) plus one FMA correction per element,

    q = RN(x * y);  q = RN(q - RN(q*s - x) * y)

(s is replaced by 0 in the residual where y == 0, i.e. s = inf, so that x/inf comes out as IEEE says, and the
residual's sign convention keeps x = -0 negative). With y correctly rounded and RN(x * y) within one ulp of the
quotient, one correction gives the correctly rounded quotient (Markstein's theorem; `div.rn`'s fast path runs
two, since it starts from an approximate reciprocal). Under pow2 scales the reciprocal is exact and q = RN(x * y) is
the quotient itself, so the kernels skip the correction there, which the pow2 sets check. This script checks, in exact rational arithmetic (no float64 double
rounding), that the e4m3 bytes are then the reference's, on random groups, on quotients next to e4m3 rounding
midpoints, on scales whose reciprocal sits at a binade edge, and on the special values. Inputs are bf16
(quantization) or any fp32 (requantization). NaN bytes compare as one value: GPU arithmetic returns the canonical
NaN whatever the inputs' signs (the GPU tests compare the kernels' NaN bytes with the reference's on the device).

  python3 benchmarks/division_exactness.py [--cases 20000] [--steps 1]

Needs torch (CPU) only for the fp32 -> e4m3 conversion of the final quotients.
"""

from __future__ import annotations

import argparse
import math
import random
import struct
from fractions import Fraction

import torch

_TWO = Fraction(2)


def _bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def bf16(v: float) -> float:
    b = _bits(f32(v))
    return _from_bits((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000)


def rn32(x: Fraction, zero_sign: float = 1.0) -> float:
    """Round an exact rational to the nearest fp32 (ties to even), subnormals and overflow included."""
    if x == 0:
        return math.copysign(0.0, zero_sign)
    sign = -1.0 if x < 0 else 1.0
    x = abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if _TWO ** e > x:
        e -= 1
    elif _TWO ** (e + 1) <= x:
        e += 1
    quantum = _TWO ** (max(e, -126) - 23)
    m = x / quantum
    n, rem = divmod(m.numerator, m.denominator)
    if 2 * rem > m.denominator or (2 * rem == m.denominator and n % 2):
        n += 1
    v = n * quantum
    return sign * math.inf if v >= _TWO ** 128 else sign * float(v)


def _exact(v: float) -> Fraction | None:
    return None if math.isinf(v) or math.isnan(v) else Fraction(v)


def fma32(a: float, b: float, c: float) -> float:
    """RN(a*b + c) with IEEE special values and zero signs."""
    fa, fb, fc = _exact(a), _exact(b), _exact(c)
    if fa is None or fb is None or fc is None:
        return f32(a * b + c)  # inf/NaN operands: float arithmetic gives the IEEE special result
    exact = fa * fb + fc
    if exact == 0:
        prod_neg = math.copysign(1, a) * math.copysign(1, b) < 0
        if fa * fb == 0 and fc == 0:  # (+-0) + (+-0): -0 only when both are -0
            return -0.0 if (prod_neg and math.copysign(1, c) < 0) else 0.0
        return 0.0
    return rn32(exact)


def mul32(a: float, b: float) -> float:
    return fma32(a, b, -0.0)  # x*y + (-0) is exactly RN(x*y), signed zeros included


def div32(a: float, b: float) -> float:
    fa, fb = _exact(a), _exact(b)
    if fa is None or fb is None or fa == 0 or fb == 0:
        return f32(a / b) if b != 0 else math.copysign(math.inf, a) if a != 0 else math.nan
    return rn32(fa / fb)


def reciprocal_divide(x: float, s: float, steps: int) -> float:
    """The kernel arithmetic (`kernels/_common.quantize_values`), step for step.

    Per group: y = RN(1/s), and s_c = s, or 0 where y == 0 (s = inf: the residual would be 0*inf = NaN).
    Per element: q = RN(x*y), then `steps` times e = RN(q*s_c - x) (one FMA), q = RN(q + (-e)*y) (one FMA).
    The residual is formed as q*s - x so that x = -0 keeps its sign with no special case. The kernels take
    steps=1, or steps=0 under pow2 scales (an exact reciprocal; x = +-inf, whose scale is then 1.0, stays +-inf
    where a correction's inf - inf would give NaN).
    """
    y = div32(1.0, s)
    s_c = 0.0 if y == 0 else s
    q = mul32(x, y)
    for _ in range(steps):
        e = fma32(q, s_c, -x)
        q = fma32(-e, y, q)
    return q


def e4m3_bytes(values: list[float]) -> list[int]:
    """e4m3 bytes of fp32 values, NaN as the GPU's canonical 0x7F (its sign here is only Python's, not data)."""
    t = torch.tensor(values, dtype=torch.float32)
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")).abs(), t.clamp(-448.0, 448.0))
    return [0x7F if (b & 0x7F) == 0x7F else b for b in t.to(torch.float8_e4m3fn).view(torch.uint8).tolist()]


def _scale(amax: float) -> float:
    return div32(max(amax, f32(1e-10)), 448.0) if not math.isnan(amax) else math.nan


def _scale_pow2(amax: float) -> float:
    """The pow2 scale rule: amax/448 rounded up to a power of two; a non-finite scale becomes 1.0 (as torch.frexp)."""
    s = _scale(amax)
    if math.isinf(s) or math.isnan(s):
        return 1.0
    m, e = math.frexp(s)  # s = m * 2^e, m in [0.5, 1)
    return math.ldexp(1.0, e - 1) if m == 0.5 else math.ldexp(1.0, e)


def cases_pow2(n: int, rnd: random.Random, cast) -> list[tuple[float, float]]:
    """Random groups over the whole fp32 range with pow2 scales, plus infinite inputs (their scale is 1.0)."""
    out = [(x, _scale_pow2(amax)) for x, amax in ((math.inf, math.inf), (-math.inf, math.inf), (5.0, math.inf))]
    return (out + cases_random(n, rnd, cast, _scale_pow2))[:n]


def cases_random(n: int, rnd: random.Random, cast, scale_rule=None) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    while len(out) < n:
        mag = 10.0 ** rnd.uniform(-38, 38)
        group = []
        for _ in range(16):
            v = rnd.gauss(0, 1) * mag * (10.0 ** rnd.uniform(-6, 0) if rnd.random() < 0.3 else 1.0)
            v = rnd.choice((0.0, -0.0)) if rnd.random() < 0.02 else cast(v)
            if not math.isinf(v):
                group.append(v)
        if group:
            s = (scale_rule or _scale)(max(abs(v) for v in group))
            out += [(v, s) for v in group]
    return out[:n]


def _e4m3_midpoints() -> list[float]:
    vals = sorted({m / 8 * 2.0 ** -6 for m in range(8)} | {(1 + m / 8) * 2.0 ** e for e in range(-6, 9) for m in range(8)})
    vals = [v for v in vals if v <= 448]
    return [(a + b) / 2 for a, b in zip(vals, vals[1:])]


def cases_midpoints(n: int, rnd: random.Random, cast) -> list[tuple[float, float]]:
    mids, out = _e4m3_midpoints(), []
    while len(out) < n:
        s = f32(10.0 ** rnd.uniform(-12, 35) * rnd.uniform(1, 2))
        x0 = rn32(Fraction(rnd.choice(mids) * rnd.choice((1, -1))) * Fraction(s))
        for k in range(-2, 3):
            x = cast(_from_bits(_bits(x0) + k))
            if not (math.isinf(x) or math.isnan(x)) and abs(div32(x, s)) <= 449:
                out.append((x, s))
    return out[:n]


def cases_binade_edges(n: int, rnd: random.Random, cast) -> list[tuple[float, float]]:
    out = []
    while len(out) < n:
        mantissa = (1 << 23) - 1 - rnd.randint(0, 64) if rnd.random() < 0.5 else rnd.randint(0, 64)
        s = _from_bits(((rnd.randint(-40, 120) + 127) << 23) | mantissa)
        if not 0 < s < 1e35:
            continue
        for _ in range(8):
            q = rnd.choice((rnd.uniform(1.9, 2.0), rnd.uniform(0.99, 1.0), rnd.uniform(0.001, 448))) * 2.0 ** rnd.randint(-8, 7)
            x = cast(f32(min(q, 448.0) * s)) * rnd.choice((1, -1))
            if not math.isinf(x) and x != 0:
                out.append((x, s))
    return out[:n]


def cases_special() -> list[tuple[float, float]]:
    s = _scale(3.0)
    return [(0.0, s), (-0.0, s), (0.0, math.inf), (-0.0, math.inf), (5.0, math.inf), (-5.0, math.inf),
            (math.inf, math.inf), (-math.inf, math.inf), (1.0, math.nan), (0.0, math.nan), (math.nan, s),
            (1e-45, s), (-1e-45, s), (3.0, s), (-3.0, s), (f32(1e-10), _scale(f32(1e-10))),
            (math.nan, 1.0), (-7.0, 1.0)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=20000, help="cases per generator and input type")
    ap.add_argument("--steps", type=int, default=1, help="FMA corrections per element (the kernels run 1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    sets = {"special values": cases_special()}
    for cast_name, cast in (("bf16", bf16), ("fp32", f32)):
        for gen_name, gen in (("random groups", cases_random), ("e4m3 midpoints", cases_midpoints),
                              ("binade edges", cases_binade_edges)):
            sets[f"{cast_name} {gen_name}"] = gen(args.cases, rnd, cast)
    # Under pow2 scales the kernels skip the corrections: the reciprocal of a power of two is exact.
    sets.update({f"{c} pow2 scales, no corrections": cases_pow2(args.cases, rnd, f) for c, f in (("bf16", bf16), ("fp32", f32))})
    failed = 0
    for name, cases in sets.items():
        steps = 0 if "pow2" in name else args.steps
        ref = [div32(x, s) for x, s in cases]
        got = [reciprocal_divide(x, s, steps) for x, s in cases]
        byte_diff = sum(a != b for a, b in zip(e4m3_bytes(ref), e4m3_bytes(got)))
        # Where e4m3 can be nonzero, the fp32 quotients themselves must agree bit for bit.
        fp32_diff = sum(_bits(a) != _bits(b) for a, b in zip(ref, got)
                        if not math.isnan(a) and abs(a) >= 2.0 ** -10)
        failed += byte_diff + fp32_diff
        print(f"{name:34s} {len(cases):6d} cases: {byte_diff} e4m3 bytes and {fp32_diff} fp32 quotients >= 2^-10 differ")
    print("OK: the reciprocal form gives the reference bytes on every case" if failed == 0 else f"FAILED: {failed} differences")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
