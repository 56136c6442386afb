"""The batch-invariant GEMMs (kernels/invariant_gemm.py, backend `triton_invariant`) compiled on a GPU.

- against float64 at the Llama-3.1-8B and SmolLM2 shapes, within a worst-case bound (docs/testing.md, kind 2);
- row m's bits are the same computed alone (M in {1, 3, 64, 130, 256}) and inside a 300- or 2048-row batch
  with shuffled, different neighbours (kind 1, exact by construction);
- EngineLinear (the vLLM forward) on this backend gives the bytes of the kernel, of the custom op, and of the
  trainer's Fp8Linear on the same backend fed the whole batch: the engine's decode rows are the trainer's rows;
- the same under CUDA-graph capture and replay (vLLM's default mode);
- the premise of the configuration split: every candidate tile under one numerics gives the same bits, at every
  M, so the tile may follow N and M's bucket; and a fused projection's columns (qkv, gate_up) are the bits of the
  separate projections the trainer runs.

These tests are about the kernel itself, so the cuBLASLt route is off here (tests/gpu/test_vendor_route_gpu.py and
the bitwise model tests run with it).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision import Fp8Linear, get_recipe, quantize_fp8
from jetrl_precision.formats import QuantizedTensor
from jetrl_precision.gemm import available_backends, gemm_nt, vendor_route
from jetrl_precision.integrations import vllm_plugin  # noqa: F401  (registers torch.ops.jetrl.fp8_linear)
from jetrl_precision.integrations.engine_linear import EngineLinear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

NAME = "triton_invariant"
E4M3 = torch.float8_e4m3fn
RECIPE = get_recipe("jet_fp8").replace(gemm_backend=NAME)
# (N, K) of the projections; SmolLM2's 576 and 192 are not multiples of 128.
LLAMA8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOL = {"qkv": (960, 576), "kv": (192, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SHAPES = {f"8b_{p}": s for p, s in LLAMA8B.items()} | {f"smol_{p}": s for p, s in SMOL.items()}
SIZES = (1, 3, 64, 130, 256)
# Hopper's FP8 MMA keeps about 14 bits while it sums inside a K group (DeepSeek-V3 report, section 3.3.2), not
# fp32's 24: its unit roundoff is taken as 2^-13 (one bit of margin, truncation). BF16 MMAs sum in fp32 (2^-23,
# truncation allowed).
U_FP8_MMA = 2.0**-13
U_BF16_MMA = 2.0**-23


@pytest.fixture(autouse=True)
def _kernel_only(monkeypatch):
    monkeypatch.setenv(vendor_route.VENDOR_ROUTE_ENV, "off")
    vendor_route.reset()
    yield
    vendor_route.reset()


@pytest.fixture(scope="module")
def ig():
    reason = available_backends("cuda")[NAME]
    if reason is not None:
        pytest.skip(f"{NAME}: {reason}")
    from jetrl_precision.kernels import invariant_gemm

    return invariant_gemm


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _within(got, ref, bound, what):
    err = (got.double() - ref).abs()
    bad = ~(err <= bound)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {err.numel()} outside the bound; worst excess {float((err - bound).max()):.3e}"


def _weight(n, k, b_block=(128, 128), seed=1):
    return quantize_fp8(outlier_data(n, k, seed=seed) * 0.02, b_block)


def _fp8(ig, xq, wq, out_dtype=torch.bfloat16):
    return ig.fp8_gemm_nt_invariant(xq.data, xq.scale, wq.data, wq.scale, wq.block[0], out_dtype)


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["w128x128", "w1x128"])
@pytest.mark.parametrize("m", [1, 64, 256])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fp8_within_the_mma_bound_of_float64(ig, shape, m, b_block):
    n, k = SHAPES[shape]
    xq = quantize_fp8(outlier_data(m, k, seed=m), (1, 128))
    wq = _weight(n, k, b_block)
    cfg = ig.invariant_config(n, k, E4M3)
    a64, b64 = xq.dequantize(torch.float64), wq.dequantize(torch.float64)
    ref, mag = a64 @ b64.t(), a64.abs() @ b64.abs().t()
    # Inside a group: the MMA's sum (U_FP8_MMA); after it: sa * sb, the FMA, ceil(K/128) - 1 additions and the
    # split partials in fp32 (as in the interpreter tests' bound), on group sums at most (1 + gamma_128) too large.
    g_mma = _gamma(128, U_FP8_MMA)
    fp32 = (g_mma + _gamma(-(-k // 128) + cfg.split_k + 2, 2.0**-24) * (1 + g_mma)) * mag
    for out_dtype, u in ((torch.float32, 0.0), (torch.bfloat16, 2.0**-8)):
        got = _fp8(ig, xq, wq, out_dtype)
        bound = fp32 * (1 + u) + u * ref.abs()
        _within(got, ref, bound, f"{shape} M={m} {out_dtype}")
    # The bound catches a real error: two K groups' weight scales swapped.
    sb = wq.scale.clone()
    sb[:, [0, 1]] = sb[:, [1, 0]]
    wrong = ig.fp8_gemm_nt_invariant(xq.data, xq.scale, wq.data, sb, wq.block[0], torch.float32)
    assert ((wrong.double() - ref).abs() > fp32).any()


def _rows_alone_equal_rows_in_batches(gemm, k: int, seed: int):
    x = outlier_data(max(SIZES), k, seed=seed)
    for batch in (300, 2048):
        g = torch.Generator(device="cuda").manual_seed(batch)
        mixed = outlier_data(batch, k, seed=seed + batch)
        pos = torch.randperm(batch, generator=g, device="cuda")[: max(SIZES)]
        mixed[pos] = x
        together = gemm(mixed)[pos]
        for m in SIZES:
            alone = gemm(x[:m])
            diff = int((_bits(alone) != _bits(together[:m])).sum())
            assert diff == 0, f"M={m}: {diff} elements differ from the same rows in a {batch}-row batch"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fp8_rows_do_not_depend_on_the_batch(ig, shape):
    n, k = SHAPES[shape]
    wq = _weight(n, k)
    _rows_alone_equal_rows_in_batches(lambda rows: _fp8(ig, quantize_fp8(rows, (1, 128)), wq), k, seed=3)


@pytest.mark.parametrize("n,k", [(128256, 4096), (49152, 576), (576, 1536)], ids=["lm_head_8b", "lm_head_smol", "smol_down"])
def test_bf16_within_bound_and_rows_do_not_depend_on_the_batch(ig, n, k):
    w = (outlier_data(n, k, seed=5) * 0.02).bfloat16()
    x = outlier_data(64, k, seed=6)
    cfg = ig.invariant_config(n, k, torch.bfloat16)
    got = ig.bf16_gemm_nt_invariant(x, w, torch.float32)
    x64, w64 = x.double(), w.double()
    _within(got, x64 @ w64.t(), _gamma(k + cfg.split_k + 1, U_BF16_MMA) * (x64.abs() @ w64.abs().t()), f"bf16 {n}x{k}")
    _rows_alone_equal_rows_in_batches(lambda rows: ig.bf16_gemm_nt_invariant(rows, w), k, seed=7)


def test_linear_invariant_with_a_bias_keeps_rows_invariant(ig):
    n, k = 49152, 576
    w = (outlier_data(n, k, seed=8) * 0.02).bfloat16()
    bias = outlier_data(1, n, seed=9)[0]
    _rows_alone_equal_rows_in_batches(lambda rows: ig.linear_invariant(rows, w, bias), k, seed=10)
    x = outlier_data(4, k, seed=12)
    x64, w64, b64 = x.double(), w.double(), bias.double()
    ref = x64 @ w64.t() + b64
    # fp32: the MMA's K-term sum and the bias add; then one bf16 rounding of the result.
    fp32 = _gamma(k + 2, U_BF16_MMA) * (x64.abs() @ w64.abs().t() + b64.abs())
    _within(ig.linear_invariant(x, w, bias), ref, fp32 * (1 + 2.0**-8) + 2.0**-8 * ref.abs(), "linear_invariant")


def _engine(parts: list[int], k: int):
    ws = [outlier_data(n, k, seed=11 + i) * 0.02 for i, n in enumerate(parts)]
    qs = [quantize_fp8(w, (128, 128)) for w in ws]
    weight = torch.cat([q.data for q in qs]).contiguous()
    scale = torch.cat([q.scale for q in qs]).contiguous()
    groups = [(n, q.scale.shape[0], 128) for n, q in zip(parts, qs)]
    eng = EngineLinear(weight, scale, groups, 128, RECIPE.rollout.input, NAME)
    trainers = []
    for w in ws:
        lin = nn.Linear(k, w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w)
        trainers.append(Fp8Linear.from_linear(lin, RECIPE.train_fprop, RECIPE.train_backward, gemm_backend=NAME))
    return eng, trainers, qs


ENGINE_SHAPES = {"qkv_8b": ([6144], 4096), "down_8b": ([4096], 14336), "qkv_smol": ([576, 192, 192], 576),
                 "o_smol": ([576], 576)}


@pytest.mark.parametrize("shape", sorted(ENGINE_SHAPES))
def test_engine_decode_rows_are_the_trainers_batch_rows(ig, shape):
    parts, k = ENGINE_SHAPES[shape]
    eng, trainers, qs = _engine(parts, k)
    batch = outlier_data(2048, k, seed=13)
    with torch.no_grad():
        full = torch.cat([t(batch) for t in trainers], dim=-1)  # the trainer's forward over every token at once
    for m in SIZES:
        rows = torch.arange(0, 2048, 2048 // m, device="cuda")[:m]
        x = batch[rows]
        y = eng(x)
        assert y.is_contiguous() and y.shape == (m, sum(parts))
        xq = quantize_fp8(x, (1, 128))
        direct = torch.cat([gemm_nt(xq, q, torch.bfloat16, NAME) for q in qs], dim=-1)
        assert torch.equal(_bits(y), _bits(direct)), "EngineLinear must run the kernel on the reference quantizer's bytes"
        op = torch.ops.jetrl.fp8_linear(x, eng.weight, eng.weight_scale, *eng.op_args)
        assert torch.equal(_bits(op), _bits(y)), "the custom op and the eager path must be one implementation"
        diff = int((_bits(y) != _bits(full[rows])).sum())
        assert diff == 0, f"M={m}: {diff} elements of the engine's rows differ from the trainer's 2048-row forward"


@pytest.mark.parametrize("shape", ["down_8b", "qkv_smol"])
def test_cuda_graph_replay_gives_the_eager_bytes(ig, shape):
    """down_8b's numerics split K (a workspace and the ordered sum kernel are captured too)."""
    parts, k = {"down_8b": ([4096], 14336), "qkv_smol": ([576, 192, 192], 576)}[shape]
    eng, _, _ = _engine(parts, k)
    if shape == "down_8b":
        assert ig.invariant_numerics(14336, E4M3).split_k > 1
    w_bf16 = (outlier_data(sum(parts), k, seed=17) * 0.02).bfloat16()
    static = outlier_data(64, k, seed=19)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture compiles the kernels
        eng(static), ig.bf16_gemm_nt_invariant(static, w_bf16)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_fp8 = eng(static)
        y_bf16 = ig.bf16_gemm_nt_invariant(static, w_bf16)
    for seed in (23, 29):
        static.copy_(outlier_data(64, k, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bits(y_fp8), _bits(eng(static)))
        assert torch.equal(_bits(y_bf16), _bits(ig.bf16_gemm_nt_invariant(static, w_bf16)))


# (N, K, dtype) where every candidate tile is run under the tabled numerics and one other split: a split and
# an unsplit K, a K with a partial last group, the FP8 and BF16 kernels.
TILE_SHAPES = {"8b_o": (4096, 4096, E4M3), "8b_down": (4096, 14336, E4M3), "smol_qkv": (960, 576, E4M3),
               "smol_lm_head": (49152, 576, torch.bfloat16)}


@pytest.mark.parametrize("shape", sorted(TILE_SHAPES))
def test_every_tile_under_one_numerics_gives_the_same_bits(ig, shape):
    """The rule the tables rest on, re-proved on this GPU: under one numerics, every candidate tile gives the
    same bits (fp32 output: no final rounding hides a difference), and a row alone (M = 1) or among 63 others
    under any tile equals the same row of the 256-row product."""
    n, k, dtype = TILE_SHAPES[shape]
    x = outlier_data(256, k, seed=31)
    if dtype == E4M3:
        wq = _weight(n, k)

        def run(rows, cfg):
            xq = quantize_fp8(rows, (1, 128))
            return ig.fp8_gemm_nt_invariant(xq.data, xq.scale, wq.data, wq.scale, 128, torch.float32, cfg)
    else:
        w = (outlier_data(n, k, seed=32) * 0.02).bfloat16()

        def run(rows, cfg):
            return ig.bf16_gemm_nt_invariant(rows, w, torch.float32, cfg)

    tabled = ig.invariant_numerics(k, dtype)
    others = [nu for nu in ig.candidate_numerics(k, dtype) if nu != tabled][:1]
    for nu in [tabled, *others]:
        tiles = ig.candidate_tiles(n, k, dtype)
        first = _bits(run(x, ig.InvariantConfig.of(nu, tiles[0])))
        for i, tile in enumerate(tiles):
            cfg = ig.InvariantConfig.of(nu, tile)
            diff = int((_bits(run(x, cfg)) != first).sum())
            assert diff == 0, f"{shape} {nu}: tile {tile} differs from {tiles[0]} in {diff} elements"
            m = (1, 64)[i % 2]
            diff = int((_bits(run(x[:m], cfg)) != first[:m]).sum())
            assert diff == 0, f"{shape} {nu}: tile {tile} at M={m} differs from the 256-row product in {diff} elements"


# Fused projections and their parts: Llama-3.1-8B's qkv (q 4096, k 1024, v 1024) and gate_up (2 x 14336), K
# 4096; SmolLM2-135M's gate_up (2 x 1536), K 576; the BF16 kernel on the same qkv split.
FUSED = {"fp8_qkv_8b": ([4096, 1024, 1024], 4096, E4M3), "fp8_gate_up_8b": ([14336, 14336], 4096, E4M3),
         "fp8_gate_up_smol": ([1536, 1536], 576, E4M3), "bf16_qkv_8b": ([4096, 1024, 1024], 4096, torch.bfloat16)}


@pytest.mark.parametrize("case", sorted(FUSED))
def test_fused_projection_columns_are_the_separate_projections(ig, case):
    """What the bitwise vLLM path needs: the engine's fused GEMM (one weight of q + k + v rows) gives each column
    slice the bits of the trainer's separate GEMM, at decode and batch sizes (their tiles differ with N)."""
    parts, k, dtype = FUSED[case]
    x = outlier_data(256, k, seed=41)
    if dtype == E4M3:
        ws = [_weight(n, k, seed=42 + i) for i, n in enumerate(parts)]
        fused = QuantizedTensor(torch.cat([w.data for w in ws]), torch.cat([w.scale for w in ws]), ws[0].block)
        xq = quantize_fp8(x, (1, 128))

        def run(m, w):
            return ig.fp8_gemm_nt_invariant(xq.data[:m], xq.scale[:m], w.data, w.scale, 128, torch.bfloat16)
    else:
        ws = [(outlier_data(n, k, seed=42 + i) * 0.02).bfloat16() for i, n in enumerate(parts)]
        fused = torch.cat(ws)

        def run(m, w):
            return ig.bf16_gemm_nt_invariant(x[:m], w)

    for m in (1, 17, 64, 256):
        cols = torch.split(run(m, fused), parts, dim=1)
        for i, (col, w) in enumerate(zip(cols, ws)):
            diff = int((_bits(run(m, w)) != _bits(col.contiguous())).sum())
            assert diff == 0, f"{case} part {i} at M={m}: {diff} elements differ from the fused GEMM's columns"


@pytest.mark.parametrize("shape", ["8b_qkv", "8b_down"])
def test_bitwise_layer_keeps_its_forward_and_takes_the_fast_backward(ig, shape):
    """`backward_gemm_backend="auto"` (what make_batch_invariant sets): the forward's bits are triton_invariant's,
    and DGrad/WGrad are exactly those of a layer running auto throughout."""
    import copy

    n, k = SHAPES[shape]
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(outlier_data(n, k, seed=5) * 0.02)
    bitwise = Fp8Linear.from_linear(copy.deepcopy(lin), RECIPE.train_fprop, RECIPE.train_backward, gemm_backend=NAME)
    bitwise.backward_gemm_backend = "auto"
    invariant = Fp8Linear.from_linear(copy.deepcopy(lin), RECIPE.train_fprop, RECIPE.train_backward, gemm_backend=NAME)
    fast = Fp8Linear.from_linear(copy.deepcopy(lin), RECIPE.train_fprop, RECIPE.train_backward, gemm_backend="auto")
    x = outlier_data(512, k, seed=6).to(torch.bfloat16)
    gy = outlier_data(512, n, seed=7).to(torch.bfloat16)
    out = {}
    for name, layer in (("bitwise", bitwise), ("invariant", invariant), ("fast", fast)):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(gy)
        out[name] = (y.detach(), xi.grad, layer.weight.grad)
    assert torch.equal(_bits(out["bitwise"][0]), _bits(out["invariant"][0])), "the forward must stay the invariant kernel's"
    assert torch.equal(_bits(out["bitwise"][1]), _bits(out["fast"][1])), "DGrad must be the auto backend's"
    assert torch.equal(_bits(out["bitwise"][2]), _bits(out["fast"][2])), "WGrad must be the auto backend's"
