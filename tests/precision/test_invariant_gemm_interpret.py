"""The batch-invariant GEMM kernels (kernels/invariant_gemm.py) run for real on CPU in Triton's interpreter.

Needs triton: the CI venv has none, so every test here skips there (importorskip). Run them with a venv that
has CPU torch and triton (TRITON_INTERPRET=1 is set by the fixture while the kernels are imported):

    PYTHONPATH=$PWD python -m pytest -q tests/precision/test_invariant_gemm_interpret.py

What they prove on CPU: the kernels' indexing, masking (N, K not multiples of 128), split-K and the fixed
reduction against a float64 reference within a rounding bound derived from K (docs/testing.md, kind 2), that a
row's bits do not depend on M or on the rows beside it (kind 1), and that the vLLM forward (EngineLinear and its
custom op) on this backend runs exactly the kernel. The interpreter's tl.dot is numpy's,
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
    n_full, k, n = INVARIANCE[shape]
    cfg = ig.invariant_config(n_full, k, E4M3)
    w = quantize_fp8(outlier_data((n, k), generator=_gen(7)) * 0.02, (128, 128))
    x = outlier_data((256, k), generator=_gen(8))

    def gemm(rows):
        xq = quantize_fp8(rows, (1, 128))
        return ig.fp8_gemm_nt_invariant(xq.data, xq.scale, w.data, w.scale, 128, torch.bfloat16, cfg)

    sizes = (1, 130) if shape.startswith("llama") else (1, 3, 64, 130, 256)
    _rows_alone_equal_rows_in_batch(gemm, x, sizes, batch=300 if shape.startswith("smol") else 140)


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
    # The configuration is a function of (N, K, dtype) alone: its signature has no M to depend on.
    import inspect

    assert list(inspect.signature(ig.invariant_config).parameters) == ["n", "k", "dtype"]
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
