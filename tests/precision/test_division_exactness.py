"""The quantizers' division (per-group reciprocal + one FMA correction) is the IEEE quotient.

`benchmarks/division_exactness.py` models `kernels/_common.quantize_values` step for step in exact rational
arithmetic. Here it must find no byte and no fp32 quotient that differs from RN(x / scale), and it must find
differences when the corrections are left out (so the check can fail). The GPU tests compare the kernels' bytes.
"""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "division_exactness.py"


@pytest.fixture(scope="module")
def dx():
    spec = importlib.util.spec_from_file_location("division_exactness", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["division_exactness"] = mod
    spec.loader.exec_module(mod)
    return mod


def _cases(dx, n: int, seed: int):
    rnd = random.Random(seed)
    out = list(dx.cases_special())
    for cast in (dx.bf16, dx.f32):
        for gen in (dx.cases_random, dx.cases_midpoints, dx.cases_binade_edges):
            out += gen(n, rnd, cast)
    return out


def _differences(dx, cases, steps: int) -> int:
    ref = [dx.div32(x, s) for x, s in cases]
    got = [dx.reciprocal_divide(x, s, steps) for x, s in cases]
    return sum(a != b for a, b in zip(dx.e4m3_bytes(ref), dx.e4m3_bytes(got)))


def test_one_correction_reproduces_the_ieee_quotient_bytes(dx):
    cases = _cases(dx, 1500, seed=5)
    assert _differences(dx, cases, steps=1) == 0
    assert _differences(dx, cases, steps=2) == 0  # `div.rn`'s count: a second correction changes nothing


def test_one_correction_gives_the_fp32_quotient_bit_for_bit(dx):
    """Stronger than the bytes: the corrected fp32 quotient is RN(x / s) itself wherever e4m3 is not zero."""
    for x, s in _cases(dx, 800, seed=8):
        ref, got = dx.div32(x, s), dx.reciprocal_divide(x, s, 1)
        if not math.isnan(ref) and abs(ref) >= 2.0 ** -10:
            assert dx._bits(ref) == dx._bits(got), (x, s, ref, got)


def test_signed_zero_and_infinite_scale_follow_ieee(dx):
    s = dx._scale(3.0)
    assert str(dx.reciprocal_divide(-0.0, s, 1)) == "-0.0"
    assert str(dx.reciprocal_divide(0.0, s, 1)) == "0.0"
    assert str(dx.reciprocal_divide(-5.0, float("inf"), 1)) == "-0.0"
    assert dx.reciprocal_divide(float("inf"), float("inf"), 1) != dx.reciprocal_divide(float("inf"), float("inf"), 1)  # NaN
    # pow2 turns a non-finite scale into 1.0: an infinite x then stays infinite (IEEE inf / 1). The kernels run no
    # correction under pow2; one would turn it into inf - inf = NaN.
    assert dx.reciprocal_divide(float("-inf"), 1.0, 0) == float("-inf")
    assert dx.reciprocal_divide(float("-inf"), 1.0, 1) != dx.reciprocal_divide(float("-inf"), 1.0, 1)


def test_pow2_scales_need_no_correction(dx):
    rnd = random.Random(7)
    cases = dx.cases_pow2(3000, rnd, dx.bf16) + dx.cases_pow2(3000, rnd, dx.f32)
    assert all(s == 2.0 ** round(math.log2(s)) for _, s in cases)
    assert _differences(dx, cases, steps=0) == 0


def test_the_check_catches_a_plain_reciprocal_multiply(dx):
    cases = _cases(dx, 1500, seed=6)
    assert _differences(dx, cases, steps=0) > 0
