"""The batch-invariant GEMM kernels (kernels/invariant_gemm.py) run for real on CPU in Triton's interpreter.

Needs triton: the CI venv has none, so every test here skips there (importorskip). Run them with a venv that
has CPU torch and triton (TRITON_INTERPRET=1 is set by the fixture while the kernels are imported):

    PYTHONPATH=$PWD python -m pytest -q tests/precision/test_invariant_gemm_interpret.py

What they prove on CPU: the kernels' indexing, masking (N, K not multiples of 128), split-K and the fixed
reduction against a float64 reference within a rounding bound derived from K (docs/testing.md, kind 2), that a
row's bits do not depend on M, on the rows beside it, or on the tile (which follows N and M's bucket), that a
fused projection's columns are the separate projections' bits, that the numerics are a function of (K, dtype)
alone (kind 1), and that the vLLM forward (EngineLinear and its custom op) on this backend runs exactly the
kernel. The interpreter's tl.dot is numpy's,
whose sums depend on a row's position in the tile, so under the interpreter the kernels form each K step's dot
in float64 (exact for e4m3 products); everything around it is the real kernel. The MMA's own invariance is the
GPU tests' job (tests/gpu/test_invariant_gemm_gpu.py).
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from precision_testutil import assert_within, matmul_bound, outlier_data, unit_roundoff
from jetrl_precision import quantize_fp8

_MOD = "jetrl_precision.kernels.invariant_gemm"
E4M3 = torch.float8_e4m3fn
# SmolLM2-135M projections as (N, K): hidden 576 and 192-wide k/v are not multiples of 128.
SMOL = {"o": (576, 576), "kv": (192, 576), "up": (1536, 576), "down": (576, 1536)}


@pytest.fixture(scope="module")
def ig():
    """The kernel module imported under TRITON_INTERPRET=1 (Triton decides at decoration), dropped afterwards so
    no later import in this process gets interpreted kernels."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the compiled kernels in tests/gpu/test_invariant_gemm_gpu.py")
    sys.modules.pop(_MOD, None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        pytest.importorskip("triton", reason="triton is not installed (the CI venv): the interpreter tests need it")
        mod = importlib.import_module(_MOD)
        yield mod
    sys.modules.pop(_MOD, None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _operands(m: int, n: int, k: int, b_block: tuple[int, int], seed: int):
    a = quantize_fp8(outlier_data((m, k), generator=_gen(seed)), (1, 128))
    b = quantize_fp8(outlier_data((n, k), generator=_gen(seed + 1)) * 0.02, b_block)
    return a, b


def _fp8(ig, a, b, out_dtype, config=None):
    return ig.fp8_gemm_nt_invariant(a.data, a.scale, b.data, b.scale, b.block[0], out_dtype, config)


def _fp8_bound(a64, b64, k: int, splits: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Worst-case error of the kernel's arithmetic against the exact product, any order within each sum.

    A term a_k b_k sa sb meets at most: 127 fp32 additions inside its 128-wide group (e4m3 products are exact in
    fp32), the rounding of sa * sb, the FMA into the accumulator and the ceil(K/128) - 1 additions after it,
    and splits - 1 additions of the partials: fewer than K + ceil(K/128) + splits + 2 roundings for K >= 128.
    A bf16 output adds one rounding of the result: one ulp (2u) here, since the interpreter's fp32 -> bf16 cast
    truncates where the GPU rounds to nearest."""
    groups = -(-k // 128)
    return _out_rounding(matmul_bound(a64, b64.t(), roundings=groups + splits + 2), a64 @ b64.t(), out_dtype)


def _out_rounding(fp32_bound: torch.Tensor, ref: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if out_dtype == torch.float32:
        return fp32_bound
    ulp = 2 * unit_roundoff(out_dtype)
    return fp32_bound * (1 + ulp) + ulp * ref.abs()


# Every projection with fp32 output and 128x128 weights; bf16 output and 1x128 weights on two of them.
REF_CASES = [(p, torch.float32, (128, 128)) for p in sorted(SMOL)] + [
    ("o", torch.bfloat16, (1, 128)), ("down", torch.bfloat16, (128, 128)), ("kv", torch.float32, (1, 128))]


@pytest.mark.parametrize("proj,out_dtype,b_block", REF_CASES, ids=lambda v: str(v).replace("torch.", "").replace(", ", "x"))
def test_fp8_matches_float64_reference(ig, proj, out_dtype, b_block):
    n, k = SMOL[proj]
    a, b = _operands(37, n, k, b_block, seed=n + k)
    cfg = ig.invariant_config(n, k, E4M3)
    got = _fp8(ig, a, b, out_dtype)
    assert got.shape == (37, n) and got.dtype == out_dtype
    a64, b64 = a.dequantize(torch.float64), b.dequantize(torch.float64)
    ref = a64 @ b64.t()
    bound = _fp8_bound(a64, b64, k, cfg.split_k, out_dtype)
    assert_within(got, ref, bound, f"{proj} {out_dtype} B {b_block}")
    # The bound can fail: B's scales of two K groups swapped is a real, small error it must catch.
    sb = b.scale.clone()
    sb[:, [0, 1]] = sb[:, [1, 0]]
    wrong = ig.fp8_gemm_nt_invariant(a.data, a.scale, b.data, sb, b.block[0], out_dtype)
    with pytest.raises(AssertionError):
        assert_within(wrong, ref, bound)


@pytest.mark.parametrize("split_k,block_m", [(1, 64), (2, 16), (3, 16), (8, 64)])
def test_fp8_every_config_meets_the_bound(ig, split_k, block_m):
    """Configurations the benchmark may pick (an odd split, a split past the K groups, a narrow M tile) are
    all correct; K = 1536 - 80 leaves a partial last group."""
    n, k = 200, 1456
    a, b = _operands(70, n, k, (128, 128), seed=3)
    cfg = ig.InvariantConfig(block_n=64, block_m=block_m, split_k=split_k)
    got = _fp8(ig, a, b, torch.float32, cfg)
    a64, b64 = a.dequantize(torch.float64), b.dequantize(torch.float64)
    assert_within(got, a64 @ b64.t(), _fp8_bound(a64, b64, k, split_k, torch.float32), f"split {split_k}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so -0 != +0 and NaN == NaN as bytes are compared."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _rows_alone_equal_rows_in_batch(gemm, x: torch.Tensor, sizes=(1, 3, 64, 130, 256), batch: int = 300):
    """Row i of gemm(x[:m]) equals, bit for bit, row i of x placed at a random position of a `batch`-row input
    whose other rows are different data, for every m in `sizes`."""
    g = _gen(1234)
    mixed = outlier_data((batch, x.shape[1]), generator=g, dtype=x.dtype)
    pos = torch.randperm(batch, generator=g)[: max(sizes)]
    mixed[pos] = x[: max(sizes)]
    together = gemm(mixed)[pos]
    for m in sizes:
        alone = gemm(x[:m])
        assert torch.equal(_bits(alone), _bits(together[:m])), (
            f"M={m}: {int((_bits(alone) != _bits(together[:m])).sum())} elements differ from the same rows in a "
            f"{batch}-row batch")


# (N of the full weight, K, weight rows run here). A row's reduction is set by K and the configuration, which
# comes from the full (N, K): cutting the weight to a few 64-row slabs keeps that while the interpreter stays
# fast. SmolLM2's K (576, 1536) run whole; Llama-3.1-8B's qkv runs its K = 4096 with M in {1, 130}.
INVARIANCE = {
    "smol_kv": (192, 576, 192), "smol_o": (576, 576, 192), "smol_down": (576, 1536, 192),
    "llama8b_qkv": (6144, 4096, 64),
}


@pytest.mark.parametrize("shape", sorted(INVARIANCE))
def test_fp8_rows_do_not_depend_on_the_batch(ig, shape):
    """With the tile following M: each M runs the tile of the full weight's (N, K) and M's bucket, so the sizes
    below run different tiles, and the rows must still be the same bits."""
    n_full, k, n = INVARIANCE[shape]
    w = quantize_fp8(outlier_data((n, k), generator=_gen(7)) * 0.02, (128, 128))
    x = outlier_data((256, k), generator=_gen(8))

    def gemm(rows):
        xq = quantize_fp8(rows, (1, 128))
        cfg = ig.invariant_config(n_full, k, E4M3, rows.shape[0])
        return ig.fp8_gemm_nt_invariant(xq.data, xq.scale, w.data, w.scale, 128, torch.bfloat16, cfg)

    sizes = (1, 130) if shape.startswith("llama") else (1, 3, 64, 130, 256)
    batch = 300 if shape.startswith("smol") else 140
    assert len({ig.invariant_tile(n_full, k, E4M3, m) for m in (*sizes, batch)}) > 1, "the sizes must cross tiles"
    _rows_alone_equal_rows_in_batch(gemm, x, sizes, batch=batch)


# Tiles of different block_n, block_m, warps and stages (the candidates' extremes), one numerics each.
TILE_SET = [(64, 16, 4, 4), (128, 32, 8, 4), (64, 128, 4, 3), (128, 64, 8, 4)]


@pytest.mark.parametrize("dtype", [E4M3, torch.bfloat16], ids=["fp8", "bf16"])
def test_every_tile_gives_the_same_bits_at_every_m(ig, dtype):
    """The rule the configuration split rests on: under one numerics (here a split K with a partial last step),
    a row's bits are the same whichever tile runs it and whatever M is, so row i at M = 1 under the narrowest
    tile equals row i at M = 70 under the widest. fp32 outputs: no final rounding hides a difference."""
    n, k = 200, 1456
    w = outlier_data((n, k), generator=_gen(50)) * 0.02
    x = outlier_data((70, k), generator=_gen(51))
    if dtype == E4M3:
        wq = quantize_fp8(w, (128, 128))

        def run(rows, cfg):
            xq = quantize_fp8(rows, (1, 128))
            return ig.fp8_gemm_nt_invariant(xq.data, xq.scale, wq.data, wq.scale, 128, torch.float32, cfg)
    else:
        wb = w.bfloat16()

        def run(rows, cfg):
            return ig.bf16_gemm_nt_invariant(rows.bfloat16(), wb, torch.float32, cfg)

    numerics = ig.InvariantNumerics(block_k=128 if dtype == E4M3 else 64, split_k=3)
    outs = {t: run(x, ig.InvariantConfig.of(numerics, ig.InvariantTile(*t))) for t in TILE_SET}
    first = _bits(outs[TILE_SET[0]])
    for t, out in outs.items():
        assert torch.equal(_bits(out), first), f"tile {t} differs from tile {TILE_SET[0]} under {numerics}"
    for m, t in ((1, TILE_SET[2]), (3, TILE_SET[1]), (17, TILE_SET[3])):
        alone = run(x[:m], ig.InvariantConfig.of(numerics, ig.InvariantTile(*t)))
        assert torch.equal(_bits(alone), first[:m]), f"M={m} under tile {t}"
    other = run(x, ig.InvariantConfig.of(ig.InvariantNumerics(numerics.block_k, 1), ig.InvariantTile(*TILE_SET[0])))
    assert not torch.equal(_bits(other), first), "another split must change some bits, or this test proves nothing"


# Fused projections as the engine runs them and the parts the trainer runs: (parts' rows, K). FP8 parts are
# 128-row aligned (one 128x128 scale grid for the fused weight); BF16 parts need not be.
FUSED = {"fp8_qkv": ([256, 128, 128], 384, E4M3), "fp8_gate_up": ([256, 256], 256, E4M3),
         "bf16_qkv": ([192, 64, 64], 320, torch.bfloat16), "bf16_gate_up": ([320, 320], 320, torch.bfloat16)}


@pytest.mark.parametrize("case", sorted(FUSED))
def test_fused_projection_columns_are_the_separate_projections(ig, case):
    """q, k, v (or gate, up) as separate GEMMs give, bit for bit, the column slices of the fused GEMM, at a
    decode M and a larger one: the numerics do not depend on N, and the tile N chooses does not change bits.
    The tile table gives the fused shape and its parts different tiles, as a measured table may."""
    parts, k, dtype = FUSED[case]
    name = str(dtype).removeprefix("torch.")
    tiles = dict(ig.TUNED_TILES)
    tiles[(sum(parts), k, name)] = {1: ig.InvariantTile(128, 16, 8, 4), 33: ig.InvariantTile(64, 128, 4, 3)}
    for n in parts:
        tiles[(n, k, name)] = {1: ig.InvariantTile(64, 32, 4, 4), 33: ig.InvariantTile(128, 64, 8, 4)}
    ig._tile_for_bucket.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ig, "TUNED_TILES", tiles)
            _check_fused(ig, parts, k, dtype, case)
    finally:
        ig._tile_for_bucket.cache_clear()  # no patched tile outlives the test


def _check_fused(ig, parts, k, dtype, case):
    ws = [outlier_data((n, k), generator=_gen(60 + i)) * 0.02 for i, n in enumerate(parts)]
    x = outlier_data((70, k), generator=_gen(70))
    if dtype == E4M3:
        qs = [quantize_fp8(w, (128, 128)) for w in ws]
        fused = quantize_fp8(torch.cat(ws), (128, 128))
        assert torch.equal(_bits(fused.data), _bits(torch.cat([q.data for q in qs]))), "aligned parts quantize alike"
        xq = quantize_fp8(x, (1, 128))

        def run(m, w):
            return ig.fp8_gemm_nt_invariant(xq.data[:m], xq.scale[:m], w.data, w.scale, 128, torch.float32)
    else:
        qs = [w.bfloat16() for w in ws]
        fused = torch.cat(qs)
        xb = x.bfloat16()

        def run(m, w):
            return ig.bf16_gemm_nt_invariant(xb[:m], w, torch.float32)

    n_all = sum(parts)
    for m in (2, 70):
        assert ig.invariant_tile(n_all, k, dtype, m) != ig.invariant_tile(parts[0], k, dtype, m)
        whole = run(m, fused)
        cols = torch.split(whole, parts, dim=1)
        for i, (col, q) in enumerate(zip(cols, qs)):
            assert torch.equal(_bits(run(m, q)), _bits(col.contiguous())), f"{case} part {i} at M={m}"


@pytest.mark.parametrize("dtype", [E4M3, torch.bfloat16, torch.float16], ids=["fp8", "bf16", "fp16"])
def test_numerics_depend_on_k_and_dtype_only(ig, dtype):
    """For every K (the tabled ones and others), the numerics of every (N, M) are `invariant_numerics(K, dtype)`:
    fused and separate projections, decode and training batches sum each output in one order."""
    import inspect

    assert list(inspect.signature(ig.invariant_numerics).parameters) == ["k", "dtype"]
    g = _gen(80)
    ks = sorted({k for k, _ in ig.TUNED_NUMERICS} | {k for _, k, _ in ig.TUNED_TILES}
                | {int(v) for v in torch.randint(16, 20000, (12,), generator=g)})
    ns = sorted({n for n, _, _ in ig.TUNED_TILES} | {int(v) for v in torch.randint(1, 200000, (12,), generator=g)})
    for k in ks:
        nu = ig.invariant_numerics(k, dtype)
        for n in ns:
            for m in (1, 16, 17, 100, 256, 257, 8192):
                assert ig.invariant_config(n, k, dtype, m).numerics == nu, (n, k, m)
        assert all(c.numerics in ig.candidate_numerics(k, dtype) for c in ig.candidate_configs(300, k, dtype))


@pytest.mark.parametrize("n,k", [(576, 576), (1000, 1536), (300, 200)], ids=["smol_o", "wide", "tiny_k"])
def test_bf16_matches_float64_reference_and_is_batch_invariant(ig, n, k):
    x = outlier_data((300, k), generator=_gen(5), dtype=torch.bfloat16)
    w = (outlier_data((n, k), generator=_gen(6)) * 0.02).bfloat16()
    cfg = ig.invariant_config(n, k, torch.bfloat16)
    got = ig.bf16_gemm_nt_invariant(x[:41], w, torch.float32)
    x64, w64 = x[:41].double(), w.double()
    steps = -(-k // cfg.block_k)
    # bf16 products are exact in fp32: K additions, splits - 1 partial sums.
    assert_within(got, x64 @ w64.t(), matmul_bound(x64, w64.t(), roundings=min(steps, cfg.split_k) + 1), f"bf16 {n}x{k}")
    _rows_alone_equal_rows_in_batch(lambda rows: ig.bf16_gemm_nt_invariant(rows, w), x, sizes=(1, 3, 130))


def test_linear_invariant_is_f_linear_with_one_rounding(ig):
    """N-D input and a bias: the fp32 GEMM plus the bias, rounded once to bf16 (within the fp32 bound plus one
    bf16 ulp of the result, the interpreter's cast truncating), and a token's row is the same in any batch."""
    k, n = 192, 200
    w = (outlier_data((n, k), generator=_gen(40)) * 0.02).bfloat16()
    bias = outlier_data((1, n), generator=_gen(41)).bfloat16()[0]
    x = outlier_data((2, 9, k), generator=_gen(42)).bfloat16()
    got = ig.linear_invariant(x, w, bias)
    assert got.shape == (2, 9, n) and got.dtype == torch.bfloat16
    x64, w64 = x.reshape(-1, k).double(), w.double()
    ref = x64 @ w64.t() + bias.double()
    fp32 = matmul_bound(x64, w64.t(), bias.double(), roundings=2)
    bound = _out_rounding(fp32, ref, torch.bfloat16)
    assert_within(got.reshape(-1, n), ref, bound, "linear_invariant")
    with pytest.raises(AssertionError):  # the bound catches a dropped bias
        assert_within(ig.linear_invariant(x, w).reshape(-1, n), ref, bound)
    assert torch.equal(_bits(ig.linear_invariant(x[1, 4:5], w, bias)), _bits(got[1, 4:5]))


def test_configuration_ignores_m_and_edges(ig):
    # M picks only a tile, by bucket: every M of one bucket gets one configuration.
    for lo, hi in zip(ig.M_BUCKETS, (*ig.M_BUCKETS[1:], 1 << 20)):
        assert {ig.invariant_config(960, 576, E4M3, m) for m in (lo, hi - 1)} == {ig.invariant_config(960, 576, E4M3, lo)}
        assert ig.m_bucket(lo) == ig.m_bucket(hi - 1) == lo
    # A tabled shape reads its table: an M between tabled buckets takes the largest bucket below it.
    table = ig.TUNED_TILES[(28672, 4096, "float8_e4m3fn")]
    below = lambda m: table[max(b for b in table if b <= ig.m_bucket(m))]  # noqa: E731
    assert len(table) >= 2 and all(ig.invariant_tile(28672, 4096, E4M3, m) == below(m) for m in (1, 20, 100, 300, 9000))
    a, b = _operands(4, 192, 576, (128, 128), seed=1)
    assert ig.fp8_gemm_nt_invariant(a.data[:0], a.scale[:0], b.data, b.scale, 128, torch.bfloat16).shape == (0, 192)
    with pytest.raises(ValueError, match="block_n 256 > 128"):
        _fp8(ig, *_operands(4, 192, 576, (128, 128), seed=1), torch.bfloat16, ig.InvariantConfig(block_n=256))
    with pytest.raises(ValueError, match="same K"):
        ig.fp8_gemm_nt_invariant(a.data, a.scale, b.data[:, :512], b.scale, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 or both fp16"):
        ig.bf16_gemm_nt_invariant(torch.ones(2, 8), torch.ones(3, 8))
    with pytest.raises(ValueError, match="power of two"):
        ig.InvariantConfig(block_m=24)
    assert all(c.block_k == 128 for c in ig.candidate_configs(4096, 4096, E4M3))
    assert ig.candidate_configs(4096, 4096, E4M3)[0].numerics == ig.invariant_numerics(4096, E4M3)


def test_engine_linear_on_this_backend_is_the_kernel_and_the_trainers_rows(ig, monkeypatch):
    """The vLLM forward (EngineLinear, and its custom op) with backend triton_invariant, SmolLM2's fused qkv_proj
    (q 576 | k 192 | v 192 rows: partial block rows, so one kernel call per part): the kernel's bytes on the
    reference quantizer's input; a decode row's bytes equal the same row in a 140-row batch; and the engine's
    rows equal the trainer's Fp8Linear forward of the whole batch on the same backend (what the bitwise mode
    needs). The backend refuses CPUs, so the trainer's resolution is pointed at the same kernel here."""
    from torch import nn

    from jetrl_precision import Fp8Linear, get_recipe
    from jetrl_precision.gemm import dispatch
    from jetrl_precision.integrations import vllm_plugin  # noqa: F401  (registers torch.ops.jetrl.fp8_linear)
    from jetrl_precision.integrations.engine_linear import EngineLinear

    recipe = get_recipe("jet_fp8").replace(gemm_backend="triton_invariant")
    parts, k = [576, 192, 192], 576
    ws = [(outlier_data((n, k), generator=_gen(20 + i)) * 0.02).bfloat16() for i, n in enumerate(parts)]
    qs = [quantize_fp8(w, (128, 128)) for w in ws]
    weight, scale = torch.cat([q.data for q in qs]), torch.cat([q.scale for q in qs])
    groups = [(n, q.scale.shape[0], 128) for n, q in zip(parts, qs)]
    eng = EngineLinear(weight, scale, groups, 128, recipe.rollout.input, "triton_invariant")
    x = outlier_data((3, k), generator=_gen(30)).bfloat16()
    y = eng(x)
    xq = quantize_fp8(x, (1, 128))
    direct = torch.cat([_fp8(ig, xq, q, torch.bfloat16) for q in qs], dim=-1)
    assert y.is_contiguous() and torch.equal(_bits(y), _bits(direct))
    op = torch.ops.jetrl.fp8_linear(x, weight, scale, *eng.op_args)
    assert torch.equal(_bits(op), _bits(y)), "the custom op and the eager path must be one implementation"
    batch = outlier_data((130, k), generator=_gen(31)).bfloat16()
    _rows_alone_equal_rows_in_batch(eng, batch, sizes=(1, 130), batch=140)

    dispatch._ensure_registered()
    real = dispatch._REGISTRY["triton_invariant"]
    monkeypatch.setitem(dispatch._REGISTRY, "triton_invariant", dispatch.GemmBackend(real.name, real.gemm_nt, lambda d: None))
    trainers = []
    for w in ws:
        lin = nn.Linear(k, w.shape[0], bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w)
        trainers.append(Fp8Linear.from_linear(lin, recipe.train_fprop, recipe.train_backward, gemm_backend="triton_invariant"))
    with torch.no_grad():
        full = torch.cat([t(batch) for t in trainers], dim=-1)
    assert torch.equal(_bits(eng(batch[:1])), _bits(full[:1])), "a decode row must be the trainer's row"
