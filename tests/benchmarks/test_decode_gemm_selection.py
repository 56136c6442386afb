"""benchmarks/decode_gemm_triton.py's table derivation, on made-up times (no device, no triton).

The rules it must keep: one numerics per (K, dtype) for every N sharing that K (fused and separate projections
must sum alike), chosen by the least time summed over those shapes with each (shape, M) at its best tile; tiles
per (N, K, dtype, M bucket) under that numerics only; and the printed literals must be what invariant_gemm.py
reads.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_gemm_triton as dg  # noqa: E402

BUCKETS = (1, 17, 33, 65, 129, 257)


def _bucket(m: int) -> int:
    return max(b for b in BUCKETS if b <= max(m, 1))


S1, S2 = (128, 1), (128, 2)
NARROW, WIDE, MID = (64, 16, 4, 4), (64, 128, 4, 3), (128, 32, 8, 4)


def _shape(n, times, k=4096, ms=(1, 64, 256)):
    return dict(n=n, k=k, dtype="float8_e4m3fn", ms=list(ms), times=times, label=f"{n}")


def test_numerics_minimize_the_summed_per_m_best_over_the_shapes_of_one_k():
    # Shape A alone prefers split 2 (11 vs 17); shape B prefers split 1 by less (28 vs 37): together split 1 (45 vs 48).
    a = _shape(6144, {(S1, NARROW): [5, 9, 30], (S1, WIDE): [9, 8, 4], (S2, NARROW): [3, 5, 30], (S2, WIDE): [8, 7, 3]})
    b = _shape(28672, {(S1, NARROW): [10, 12, 30], (S1, WIDE): [20, 10, 8], (S2, NARROW): [12, 14, 40], (S2, WIDE): [25, 14, 11]})
    numerics, tiles, totals = dg.derive_tables([a, b], BUCKETS, _bucket)
    assert totals[(4096, "float8_e4m3fn")] == {S1: 5 + 8 + 4 + 10 + 10 + 8, S2: 3 + 5 + 3 + 12 + 14 + 11}
    assert numerics == {(4096, "float8_e4m3fn"): S1}
    # Tiles under split 1 only, per bucket; a bucket whose tile equals the one below it is left out.
    assert tiles[(6144, 4096, "float8_e4m3fn")] == {1: NARROW, 33: WIDE}
    assert tiles[(28672, 4096, "float8_e4m3fn")] == {1: NARROW, 33: WIDE}
    # A numerics timed for only some shapes of a K cannot win it.
    b_only_s1 = dict(b, times={key: t for key, t in b["times"].items() if key[0] == S1})
    a_cheap_s2 = dict(a, times={**a["times"], (S2, MID): [0.1, 0.1, 0.1]})
    numerics, _, totals = dg.derive_tables([a_cheap_s2, b_only_s1], BUCKETS, _bucket)
    assert numerics[(4096, "float8_e4m3fn")] == S1 and set(totals[(4096, "float8_e4m3fn")]) == {S1}


def test_tiles_sum_the_ms_of_one_bucket_and_other_ks_choose_alone():
    ms = (1, 16, 300, 1024)
    c = _shape(576, {(S1, NARROW): [1, 2, 50, 200], (S1, MID): [2, 1.5, 40, 220], (S1, WIDE): [3, 3, 45, 150]}, k=576, ms=ms)
    numerics, tiles, _ = dg.derive_tables([c], BUCKETS, _bucket)
    assert numerics == {(576, "float8_e4m3fn"): S1}
    # Bucket 1 holds M = 1 and 16: NARROW 3 < MID 3.5; bucket 257 holds 300 and 1024: WIDE 195 < MID 260.
    assert tiles[(576, 576, "float8_e4m3fn")] == {1: NARROW, 257: WIDE}


def test_printed_tables_are_the_module_literals():
    numerics = {(4096, "float8_e4m3fn"): S1, (576, "bfloat16"): (64, 1)}
    tiles = {(6144, 4096, "float8_e4m3fn"): {1: NARROW, 129: WIDE}}
    text = dg.format_tables(numerics, tiles)

    class _Numerics(dict):
        def __init__(self, block_k, split_k):
            super().__init__(block_k=block_k, split_k=split_k)

    scope = {"InvariantNumerics": _Numerics, "InvariantTile": tuple, "_t": lambda *t: t}
    exec(text, scope)  # the printed block is valid Python in the module's spelling
    assert scope["TUNED_NUMERICS"] == {(4096, "float8_e4m3fn"): {"block_k": 128, "split_k": 1},
                                       (576, "bfloat16"): {"block_k": 64, "split_k": 1}}
    assert scope["TUNED_TILES"] == {(6144, 4096, "float8_e4m3fn"): {1: NARROW, 129: WIDE}}
