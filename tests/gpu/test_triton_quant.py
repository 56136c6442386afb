"""Every Triton quantizer reproduces the reference quantizer's bytes exactly (data as uint8, scales with torch.equal)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision import ops
from jetrl_precision.quantize import quantize_fp8, requantize_fp8
from jetrl_precision.recipe import get_recipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

if torch.cuda.is_available():
    from jetrl_precision.kernels import cast_transpose, fused, quant, quant_cuda

SHAPES = [(1, 128), (3, 100), (257, 1000), (1000, 4096), (4096, 14336)]
if torch.cuda.is_available():
    OTHER_TILES = [quant.Tile128x1(32, 4, False), quant.Tile128x1(64, 4, True), quant.Tile128x1(128, 8, False),
                   quant.Tile128x1(16, 1, False), quant.Tile128x1(16, 2, True)]


def assert_same(got, ref, what: str) -> None:
    assert got.block == ref.block, what
    assert got.data.shape == ref.data.shape and got.scale.shape == ref.scale.shape, what
    bad = (got.data.view(torch.uint8) != ref.data.view(torch.uint8)).sum().item()
    assert bad == 0, f"{what}: {bad} of {got.data.numel()} fp8 bytes differ from the reference"
    assert torch.equal(got.scale, ref.scale), f"{what}: scales differ"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_1x128_bytes(shape, pow2):
    x = outlier_data(*shape, seed=1)
    got = quant.quantize_1x128(x, pow2)
    assert_same(got, quantize_fp8(x, (1, 128), pow2_scale=pow2), f"1x128 {shape} pow2={pow2}")
    # The layout the GEMMs read: MN-major, no copy needed.
    assert got.scale.stride() == (1, shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_1x128_other_dtypes_and_strides(dtype):
    x = outlier_data(700, 384, dtype=dtype, seed=2)
    assert_same(quant.quantize_1x128(x), quantize_fp8(x, (1, 128)), f"1x128 {dtype}")
    xt = outlier_data(384, 700, dtype=dtype, seed=3).t()  # non-contiguous view
    assert_same(quant.quantize_1x128(xt), quantize_fp8(xt, (1, 128)), f"1x128 {dtype} transposed view")


@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (4096, 4096), (14336, 4096), (1000, 14336)])
@pytest.mark.parametrize("pow2", [False, True])
def test_128x128_and_transpose_bytes(shape, pow2):
    w = outlier_data(*shape, seed=4)
    ref = quantize_fp8(w, (128, 128), pow2_scale=pow2)
    q, qt = quant.quantize_128x128(w, pow2, write=True, write_t=True)
    assert_same(q, ref, f"128x128 {shape}")
    ref_t = ref.t()
    assert_same(qt, ref_t, f"128x128 transpose {shape}")
    # The transposed quantization equals quantizing the transposed weight (blocks transpose exactly).
    assert_same(qt, quantize_fp8(w.t().contiguous(), (128, 128), pow2_scale=pow2), "128x128 of W^T")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_128x1_and_transposed_bytes(shape, pow2):
    x = outlier_data(*shape, seed=5)
    ref = quantize_fp8(x, (128, 1), pow2_scale=pow2)
    assert_same(quant.quantize_128x1(x, pow2), ref, f"128x1 {shape}")
    got_t = quant.quantize_128x1_t(x, pow2)
    assert_same(got_t, ref.t(), f"128x1 transposed {shape}")
    assert got_t.scale.stride() == (1, shape[1])
    for tile in OTHER_TILES:  # tile shape and grid order change the schedule, never the bytes
        assert_same(quant.quantize_128x1_t(x, pow2, tile=tile), ref.t(), f"128x1^T {tile}")
        assert_same(quant.quantize_128x1(x, pow2, tile=tile), ref, f"128x1 {tile}")


@pytest.mark.parametrize("shape", SHAPES + [(8192, 1536)])
def test_dual_layout_bytes(shape):
    """ops.quantize_dual (what the FP8 linear's backward calls): both dY layouts byte-exact, scales MN-major."""
    x = outlier_data(*shape, seed=15)
    bw = get_recipe("jet_fp8").train_backward
    q, qt = ops.quantize_dual(x, bw.dgrad_grad_output, bw.wgrad_grad_output)
    assert_same(q, quantize_fp8(x, (1, 128), pow2_scale=bw.dgrad_grad_output.pow2_scale), f"dual 1x128 {shape}")
    assert_same(qt, quantize_fp8(x, (128, 1), pow2_scale=bw.wgrad_grad_output.pow2_scale).t(), f"dual 128x1^T {shape}")
    assert q.scale.stride() == (1, shape[0]) and qt.scale.stride() == (1, shape[1])  # both MN-major for the GEMMs


@pytest.mark.parametrize("shape", SHAPES + [(8192, 1536), (200, 384)])
@pytest.mark.parametrize("pow2", [False, True])
def test_one_read_dual_quantizer_bytes(shape, pow2, monkeypatch):
    """The one-read dual kernel (JETRL_DUAL_QUANT_FUSED=1) writes both layouts byte-exact, in the two kernels'
    scale layouts, and pads the transposed one along the tokens with zeros."""
    x = outlier_data(*shape, seed=16)
    q, qt = quant.quantize_dual_1x128_128x1_t(x, pow2, pow2)
    assert_same(q, quantize_fp8(x, (1, 128), pow2_scale=pow2), f"one-read dual 1x128 {shape}")
    assert_same(qt, quantize_fp8(x, (128, 1), pow2_scale=pow2).t(), f"one-read dual 128x1^T {shape}")
    assert q.scale.stride() == (1, shape[0]) and qt.scale.stride() == (1, shape[1])
    _, padded = quant.quantize_dual_1x128_128x1_t(x, pow2, pow2, pad_to=128)
    rows_out = -(-shape[0] // 128) * 128
    assert padded.data.shape == (shape[1], rows_out) and torch.equal(padded.scale, qt.scale)
    assert torch.equal(padded.data[:, : shape[0]].view(torch.uint8), qt.data.view(torch.uint8))
    assert not padded.data[:, shape[0]:].view(torch.uint8).any()
    # through ops, as the backward binds it
    monkeypatch.setenv("JETRL_DUAL_QUANT_FUSED", "1")
    bw = get_recipe("jet_fp8").train_backward
    q2, qt2 = ops.dual_quantizer(bw.dgrad_grad_output, bw.wgrad_grad_output, x.device)(x)
    assert_same(q2, quantize_fp8(x, (1, 128), pow2_scale=bw.dgrad_grad_output.pow2_scale), "ops dual, fused")
    assert_same(qt2, quantize_fp8(x, (128, 1), pow2_scale=bw.wgrad_grad_output.pow2_scale).t(), "ops dual^T, fused")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_requantize_bytes(shape, pow2):
    x = outlier_data(*shape, seed=6)
    q1 = quant.quantize_1x128(x)
    ref = requantize_fp8(q1, (128, 1), pow2_scale=pow2)
    assert_same(quant.requantize_1x128_to_128x1(q1, transposed=False, pow2_scale=pow2), ref, f"requant {shape}")
    assert_same(quant.requantize_1x128_to_128x1(q1, transposed=True, pow2_scale=pow2), ref.t(), f"requant^T {shape}")
    got = quant.requantize_1x128_to_128x1(q1, transposed=True, pow2_scale=pow2, kernel="triton")
    assert_same(got, ref.t(), f"requant^T Triton {shape}")
    for tile in OTHER_TILES:  # one input scale per 128 columns, whatever the tile width
        got = quant.requantize_1x128_to_128x1(q1, transposed=True, pow2_scale=pow2, tile=tile)
        assert_same(got, ref.t(), f"requant^T {tile} {shape}")
    # Also from a reference-made (row-major scale) input.
    q1r = quantize_fp8(x, (1, 128))
    ref_r = requantize_fp8(q1r, (128, 1), pow2_scale=pow2)
    assert_same(quant.requantize_1x128_to_128x1(q1r, transposed=True, pow2_scale=pow2), ref_r.t(), f"requant^T ref-in {shape}")


def _bits_equal(got, ref, what: str) -> None:
    """Byte equality of data, and of the scales' bit patterns (a NaN scale equals a NaN scale)."""
    assert got.block == ref.block, what
    assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8)), f"{what}: fp8 bytes differ"
    assert torch.equal(got.scale.contiguous().view(torch.int32), ref.scale.contiguous().view(torch.int32)), f"{what}: scale bits differ"


@pytest.mark.parametrize("pow2", [False, True])
def test_nonfinite_inputs_match_reference_in_every_kernel(pow2):
    """NaN and +-inf inside groups: every kernel (one NaN-propagating max carries amax and the NaN flag) gives
    the reference's bytes and scale bits, with nonfinite='propagate' as ops.quantize calls it."""
    x = outlier_data(1000, 1600, seed=9)
    x[3, 5] = float("nan")
    x[700, 300] = float("inf")
    x[900, 1000] = -float("inf")
    x[130:260, 1500] = float("nan")
    _assert_every_kernel_bitwise(x, pow2)


def _assert_every_kernel_bitwise(x: torch.Tensor, pow2: bool) -> None:
    """Each quantizer kernel on x against the reference (nonfinite='propagate', as ops.quantize calls it)."""
    ref = lambda t, block: quantize_fp8(t, block, pow2_scale=pow2, nonfinite="propagate")  # noqa: E731
    _bits_equal(quant.quantize_1x128(x, pow2), ref(x, (1, 128)), "1x128")
    _bits_equal(quant.quantize_128x1(x, pow2), ref(x, (128, 1)), "128x1")
    _bits_equal(quant.quantize_128x1_t(x, pow2), ref(x, (128, 1)).t(), "128x1^T")
    q, qt = quant.quantize_dual_1x128_128x1_t(x, pow2, pow2)
    _bits_equal(q, ref(x, (1, 128)), "one-read dual 1x128")
    _bits_equal(qt, ref(x, (128, 1)).t(), "one-read dual 128x1^T")
    w, w_t = quant.quantize_128x128(x, pow2, write_t=True)
    _bits_equal(w, ref(x, (128, 128)), "128x128")
    _bits_equal(w_t, ref(x, (128, 128)).t(), "128x128^T")
    q1 = quantize_fp8(x, (1, 128), nonfinite="propagate")  # plain scales in: the requantizer's usual input
    _bits_equal(quant.requantize_1x128_to_128x1(q1, True, pow2), requantize_fp8(q1, (128, 1), pow2_scale=pow2).t(), "requant^T")
    # The CUDA requantizer takes M % 16 == 0: the largest such leading slice (it keeps every planted value).
    q1c = quantize_fp8(x[: x.shape[0] // 16 * 16], (1, 128), nonfinite="propagate")
    ref_c = requantize_fp8(q1c, (128, 1), pow2_scale=pow2).t()
    _bits_equal(cast_transpose.requantize_1x128_to_128x1_t(q1c, pow2), ref_c, "cuda requant^T")
    if x.dtype in (torch.bfloat16, torch.float16):  # the engine's CUDA activation quantizer takes 16-bit inputs
        cq = quant_cuda.quantizer_1x128(x.device, pow2, x.dtype)
        assert cq is not None, quant_cuda.status(x.device, pow2, x.dtype)
        _bits_equal(cq(x), ref(x, (1, 128)), "cuda 1x128")


def _division_edge_data(dtype: torch.dtype, amax: float, pow2: bool, seed: int) -> torch.Tensor:
    """Quotients x / scale next to e4m3 rounding midpoints (+-2 ulps), signed zeros and tiny values, with every
    group of every kernel (1x128, 128x1, 128x128) sharing one amax, so all of them divide by one known scale.

    The kernels compute x / scale from a per-group reciprocal plus two FMA corrections, none under pow2 scales
    (`_common.quantize_values`); these are the quotients where any shortcut short of the IEEE quotient would show as a different byte.
    """
    rows, cols = 512, 640
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.tensor([amax], device="cuda").to(dtype).float()  # amax as the input dtype holds it
    scale = quantize_fp8(torch.cat([a, torch.zeros(127, device="cuda")])[None], (1, 128), pow2_scale=pow2).scale[0, 0]
    e4m3 = torch.arange(0, 127, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn).float()
    mids = (e4m3[1:] + e4m3[:-1]) / 2  # exact in fp32
    # Keep |x| below the group amax (or below the 1e-10 floor, which then sets the scale), so the scale stays put.
    mids = mids[mids * scale < 0.99 * torch.clamp(a, min=1e-10)]
    pick = torch.randint(0, mids.numel(), (rows, cols), generator=g, device="cuda")
    base = (mids[pick] * scale).view(torch.int32)
    x = (base + torch.randint(-2, 3, (rows, cols), generator=g, device="cuda", dtype=torch.int32)).view(torch.float32)
    x = x * (torch.randint(0, 2, (rows, cols), generator=g, device="cuda") * 2 - 1)
    u = torch.rand(rows, cols, generator=g, device="cuda")
    x = torch.where(u < 0.02, torch.where(u < 0.01, -0.0, 0.0) * torch.ones_like(x), x)  # signed zeros
    x = torch.where((u >= 0.02) & (u < 0.03), x * 2.0**-14, x)  # quotients that round to e4m3 subnormals or 0
    r = torch.arange(rows, device="cuda")[:, None] % 128
    c = torch.arange(cols, device="cuda")[None, :] % 128
    x = torch.where(r == c, a * torch.sign(x + 0.5), x)  # one +-amax in every group of every block shape
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amax", [3.7, 1e-12, 3.0e38, 2.5e-30])
@pytest.mark.parametrize("pow2", [False, True])
def test_division_edge_quotients_in_every_kernel(dtype, amax, pow2):
    x = _division_edge_data(dtype, amax, pow2, seed=31)
    assert (x.float().view(torch.int32) == torch.tensor(-0.0).view(torch.int32).item()).any(), "data must hold -0"
    _assert_every_kernel_bitwise(x, pow2)


def test_zero_group_and_nan_propagation():
    x = outlier_data(256, 512, seed=7)
    x[5, 128:256] = 0.0  # an all-zero group: finite tiny scale, zero bytes
    ref = quantize_fp8(x, (1, 128))
    assert_same(quant.quantize_1x128(x), ref, "zero group")
    assert float(ref.scale[5, 1]) == pytest.approx(1e-10 / 448, rel=1e-6)
    y = x.clone()
    y[7, 3] = float("nan")
    got = quant.quantize_1x128(y)
    assert torch.isnan(got.scale[7, 0])
    deq = got.dequantize()
    assert torch.isnan(deq[7, :128]).all() and not torch.isnan(deq[7, 128:]).any()
    keep = torch.ones(256, dtype=torch.bool, device=x.device)
    keep[7] = False
    assert torch.equal(got.data.view(torch.uint8)[keep], ref.data.view(torch.uint8)[keep])


def test_ops_dispatch_uses_triton_and_matches_reference():
    recipe = get_recipe("jet_fp8")
    x = outlier_data(1000, 1024, seed=8)
    assert ops.kernel_name("cuda") == "triton"
    assert_same(ops.quantize(x, recipe.train_fprop.input), quantize_fp8(x, (1, 128)), "ops 1x128")
    assert_same(ops.quantize(x, recipe.train_fprop.weight), quantize_fp8(x, (128, 128)), "ops 128x128")
    spec = recipe.train_backward.wgrad_input
    assert_same(ops.quantize_transposed(x, spec), quantize_fp8(x, (128, 1)).t(), "ops quantize_transposed 128x1")
    q1 = ops.quantize(x, recipe.train_fprop.input)
    assert_same(ops.requantize_transposed(q1, spec), requantize_fp8(q1, (128, 1)).t(), "ops requantize_transposed")
    assert_same(ops.requantize(q1, spec), requantize_fp8(q1, (128, 1)), "ops requantize")


# ---- fused producers ----------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 200), (1000, 1536), (4096, 14336)])
def test_silu_mul_quantize_bytes(shape):
    m, i = shape
    gate_up = outlier_data(m, 2 * i, seed=9)
    gate, up = gate_up[:, :i], gate_up[:, i:]  # chunks of a fused projection: strided views
    qt, h = fused.silu_mul_quantize(gate, up, return_hp=True)
    # Q(h) is byte-exact with the reference quantizer of the kernel's own bf16 h.
    assert_same(qt, quantize_fp8(h, (1, 128)), f"silu_mul q {shape}")
    # And h is what torch computes (same op order, expf, IEEE division, RNE to bf16).
    h_ref = F.silu(gate) * up
    diff = (h.view(torch.int16) != h_ref.view(torch.int16)).sum().item()
    assert diff == 0, f"silu*up differs from torch in {diff} of {h.numel()} bf16 values"
    assert_same(fused.silu_mul_quantize(gate, up), quantize_fp8(h_ref, (1, 128)), f"silu_mul vs torch {shape}")


@pytest.mark.parametrize("shape", [(3, 576), (1000, 4096), (4096, 4096)])
def test_rmsnorm_quantize_bytes(shape):
    x = outlier_data(*shape, seed=10)
    w = (1 + 0.1 * torch.randn(shape[1], device="cuda")).to(torch.bfloat16)
    qt, y = fused.rmsnorm_quantize(x, w, 1e-5, return_hp=True)
    assert_same(qt, quantize_fp8(y, (1, 128)), f"rmsnorm q {shape}")
    assert_same(fused.rmsnorm_quantize(x, w, 1e-5), qt, "rmsnorm without hp output")
    xf = x.float()
    y_ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    ulp = (y.float() - y_ref.float()).abs() / y_ref.float().abs().clamp_min(1e-30)
    assert ulp.max().item() <= 2 ** -6 * 1.01, "RMSNorm output more than two bf16 ulps from the HF formula"
    assert (y != y_ref).float().mean().item() < 0.02


@pytest.mark.parametrize("shape", [(300, 200), (4096, 14336)])
@pytest.mark.parametrize("block", [(128, 128), (1, 128)])
def test_transpose_quantized_bytes(shape, block):
    from jetrl_precision.kernels import transpose_quantized

    x = outlier_data(*shape, seed=12)
    qt = quantize_fp8(x, block)
    got = transpose_quantized(qt)
    assert_same(got, qt.t(), f"transpose {block} {shape}")


def test_sibling_layers_share_one_quantization():
    """q/k/v read the same tensor: one kernel, one saved FP8 copy; any in-place write invalidates it."""
    spec = get_recipe("jet_fp8").train_fprop.input
    x = outlier_data(512, 1024, seed=13)
    a = ops.quantize(x, spec)
    b = ops.quantize(x, spec)
    assert a is b
    assert_same(a, quantize_fp8(x, (1, 128)), "shared")
    x.mul_(2.0)  # in-place: version bump
    c = ops.quantize(x, spec)
    assert c is not a
    assert_same(c, quantize_fp8(x, (1, 128)), "after in-place write")
    y = x.clone()  # equal values, different storage: its own result
    assert ops.quantize(y, spec) is not c
    wspec = get_recipe("jet_fp8").train_backward.wgrad_input
    r1 = ops.requantize_transposed(c, wspec)
    assert ops.requantize_transposed(c, wspec) is r1
    assert_same(r1, requantize_fp8(c, (128, 1)).t(), "shared requant")


def test_mark_weights_updated_releases_the_shared_results():
    """The share caches keep their last result's FP8 bytes alive; the end of an optimizer step frees them."""
    import weakref

    from jetrl_precision import mark_weights_updated

    spec = get_recipe("jet_fp8").train_fprop.input
    x = outlier_data(512, 1024, seed=14)
    a = ops.quantize(x, spec)
    r = ops.requantize_transposed(a, get_recipe("jet_fp8").train_backward.wgrad_input)
    kept = [weakref.ref(a.data), weakref.ref(r.data)]
    assert ops.quantize(x, spec) is a
    del a, r
    assert all(w() is not None for w in kept)  # held by the caches alone
    mark_weights_updated()
    assert all(w() is None for w in kept)
    assert_same(ops.quantize(x, spec), quantize_fp8(x, (1, 128)), "recomputed after the release")
