"""The quantizer contract, byte for byte, against an independent numpy + ml_dtypes implementation.

The reference below shares no code with jetrl_precision: fp32 math in numpy, amax floored
at 1e-10, scale = amax / 448 (a float32 division), q = x / scale (a float32 division),
clip to +-448, then ml_dtypes' float8_e4m3fn cast (round to nearest, ties to even).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from precision_testutil import outlier_data
from jetrl_precision import (
    Granularity,
    NonFiniteInputError,
    QuantizedTensor,
    dequantize_fp8,
    quantize_fp8,
    requantize_fp8,
)

E4M3 = ml_dtypes.float8_e4m3fn
F32 = np.float32


# ---- the independent reference ------------------------------------------------------------
def np_block(block, shape):
    if block == "row":
        return 1, shape[1]
    if block == "tensor":
        return shape[0], shape[1]
    return block


def np_quantize(x: np.ndarray, block, pow2: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Returns (e4m3 bytes as uint8 [M, K], fp32 scales [ceil(M/b0), ceil(K/b1)])."""
    assert x.dtype == F32 and x.ndim == 2
    m, k = x.shape
    b0, b1 = np_block(block, x.shape)
    gm, gk = -(-m // b0), -(-k // b1)
    padded = np.zeros((gm * b0, gk * b1), dtype=F32)
    padded[:m, :k] = x
    groups = padded.reshape(gm, b0, gk, b1)
    amax = np.maximum(np.abs(groups).max(axis=(1, 3)), F32(1e-10)).astype(F32)
    scale = (amax / F32(448.0)).astype(F32)
    assert scale.dtype == F32
    if pow2:
        # Smallest power of two >= scale. log2 of a float32 value in float64 is exact enough
        # that ceil() never lands on the wrong integer.
        scale = np.exp2(np.ceil(np.log2(scale.astype(np.float64)))).astype(F32)
    q = groups / scale[:, None, :, None]
    assert q.dtype == F32
    q = np.clip(q, F32(-448.0), F32(448.0))
    q8 = q.astype(E4M3).reshape(gm * b0, gk * b1)[:m, :k]
    return np.ascontiguousarray(q8).view(np.uint8), scale


def assert_bytes_match(x: torch.Tensor, block, pow2: bool = False) -> QuantizedTensor:
    qt = quantize_fp8(x, block, pow2_scale=pow2)
    ref_bytes, ref_scale = np_quantize(x.float().numpy(), block, pow2)
    got_bytes = qt.data.view(torch.uint8).numpy()
    got_scale = qt.scale.numpy()
    assert qt.data.dtype == torch.float8_e4m3fn and qt.scale.dtype == torch.float32
    assert got_scale.shape == ref_scale.shape, (got_scale.shape, ref_scale.shape)
    np.testing.assert_array_equal(got_scale.view(np.uint32), ref_scale.view(np.uint32))
    mismatch = got_bytes != ref_bytes
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} byte(s) differ for block {block}; first at {np.argwhere(mismatch)[0].tolist()}"
    )
    return qt


def e4m3_positive_values() -> np.ndarray:
    codes = np.arange(256, dtype=np.uint8).view(E4M3).astype(F32)
    return np.unique(codes[np.isfinite(codes) & (codes >= 0)])


BLOCKS = [(1, 128), (128, 128), (128, 1), "row", "tensor"]
SHAPES = [(256, 384), (300, 576), (1, 5), (129, 257)]


# ---- byte-exactness on hard data ------------------------------------------------------------
@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("pow2", [False, True], ids=["plain", "pow2"])
def test_bytes_match_reference_on_outliers(block, shape, pow2):
    x = outlier_data(shape, spikes=max(1, shape[0] * shape[1] // 20000))
    assert_bytes_match(x, block, pow2)


@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("pow2", [False, True], ids=["plain", "pow2"])
def test_bytes_match_on_subnormals_zeros_and_tiny_groups(block, pow2):
    m, k = 256, 384
    x = outlier_data((m, k))
    # Rows 0..7: each 128-group has one value at 1 (sets the scale) and the rest spread
    # from 1e-7 to 1e-1 of it: after division most land in e4m3's subnormal range or flush to 0.
    span = torch.logspace(-7, -1, 127)
    for r in range(8):
        for g0 in range(0, k, 128):
            sign = torch.where(torch.rand(127) < 0.5, -1.0, 1.0)
            x[r, g0] = 3.0 ** (r - 4)
            x[r, g0 + 1 : g0 + 128] = sign * span * 3.0 ** (r - 4) * (1 + torch.rand(127))
    # Values around 1e-6 * scale (flush to zero or the smallest subnormal).
    x[8:12] = x[8:12].sign() * 1e-6 * (1 + torch.rand(4, k))
    x[8:12, ::128] = 448.0
    # All-zero groups: a whole 1x128 run, a whole 128x128 tile, a whole column.
    x[20, 128:256] = 0.0
    x[128:256, 256:384] = 0.0
    x[:, 5] = 0.0
    # Groups whose amax is below the 1e-10 floor (the floor, not the data, sets the scale).
    x[30, 0:128] = 1e-12 * torch.randn(128)
    x[31, 0:128] = 3e-11
    qt = assert_bytes_match(x, block, pow2)
    assert torch.isfinite(qt.scale).all() and (qt.scale > 0).all()
    # Zero groups quantize to zero bytes (0x00, never -0 = 0x80).
    if block == (1, 128):
        assert (qt.data[20, 128:256].view(torch.uint8) == 0).all()
        floor_scale = np.float32(np.float32(1e-10) / np.float32(448.0))
        assert qt.scale[20, 1].item() == (2.0**-42 if pow2 else floor_scale)
    # The data really exercises subnormals: e4m3 codes with a zero exponent field, nonzero mantissa.
    codes = qt.data.view(torch.uint8) & 0x7F
    assert ((codes > 0) & (codes < 8)).any()


@pytest.mark.parametrize("scale_exp", [-9, -3, 0, 5])
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (128, 1)], ids=str)
def test_exact_ties_round_to_even(scale_exp, block):
    """Values that land exactly halfway between two e4m3 codes after division round to the even code."""
    s = 2.0**scale_exp  # a power of two: amax = 448 * s gives scale = s exactly, so x / s is exact
    pos = e4m3_positive_values()
    mids = ((pos[:-1] + pos[1:]) / 2).astype(F32)  # exact in fp32
    m, k = 256, 256
    rng = np.random.default_rng(1)
    vals = rng.choice(mids, size=(m, k)) * rng.choice([-1.0, 1.0], size=(m, k))
    x = (vals * s).astype(F32)
    # Put 448 * s in every group of every granularity so each scale is exactly s.
    x[::1, ::128] = 448.0 * s
    x[::128, :] = 448.0 * s
    xt = torch.from_numpy(x.copy())
    qt = assert_bytes_match(xt, block)
    assert (qt.scale == s).all()
    # Every non-anchor value was a tie: its code must be the even neighbour (mantissa lsb 0).
    anchor = np.zeros((m, k), dtype=bool)
    anchor[:, ::128] = True
    anchor[::128, :] = True
    codes = qt.data.view(torch.uint8).numpy()[~anchor]
    assert (codes & 1 == 0).all(), "a tie rounded away from the even code"
    # Spot-check the rule on known values: 1.0625 -> 1.0, 1.1875 -> 1.25, 3*2^-10 -> 2^-8 (subnormal).
    spot = torch.tensor([[448.0, 1.0625, 1.1875, 3 * 2.0**-10, -1.0625]]) * s
    q = quantize_fp8(spot, (1, 128)).dequantize().numpy()[0] / s
    np.testing.assert_array_equal(q[1:], np.array([1.0, 1.25, 2.0**-8, -1.0], dtype=F32))


def test_clamp_at_448_and_exact_amax():
    x = outlier_data((4, 256))
    qt = assert_bytes_match(x, (1, 128))
    # The element holding each group's amax maps to +-448 exactly (code 0x7E / 0xFE).
    deq = qt.data.float()
    groups = deq.reshape(4, 2, 128).abs().amax(dim=-1)
    assert (groups == 448.0).all()


# ---- pow2 scales --------------------------------------------------------------------------------
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_pow2_scales_bound_the_plain_scale(block):
    x = outlier_data((300, 576))
    plain = quantize_fp8(x, block).scale
    p2 = quantize_fp8(x, block, pow2_scale=True).scale
    mant, _ = torch.frexp(p2)
    assert (mant == 0.5).all(), "pow2 scales must be exact powers of two"
    assert (p2 >= plain).all() and (p2 < 2 * plain).all()
    # A scale that is already a power of two is kept, not doubled.
    y = torch.zeros(1, 128)
    y[0, 0] = 448.0 * 2.0**-4
    assert quantize_fp8(y, (1, 128), pow2_scale=True).scale.item() == 2.0**-4


# ---- layout, padding, dtypes -----------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_scale_layout_and_padding_flag(shape):
    x = outlier_data(shape)
    for block, expect in [((1, 128), (shape[0], -(-shape[1] // 128))), ((128, 128), (-(-shape[0] // 128), -(-shape[1] // 128))), ((128, 1), (-(-shape[0] // 128), shape[1]))]:
        qt = quantize_fp8(x, block)
        assert tuple(qt.scale.shape) == expect and tuple(qt.data.shape) == shape
        assert qt.padded == (shape[0] % block[0] != 0 or shape[1] % block[1] != 0)
    assert tuple(quantize_fp8(x, "row").scale.shape) == (shape[0], 1)
    assert tuple(quantize_fp8(x, Granularity.TENSOR).scale.shape) == (1, 1)


def test_partial_blocks_equal_zero_padding():
    """Edge blocks behave exactly as if the tensor were zero-padded to full blocks."""
    x = outlier_data((129, 257))
    padded = torch.zeros(256, 384)
    padded[:129, :257] = x
    for block in [(1, 128), (128, 128), (128, 1)]:
        a, b = quantize_fp8(x, block), quantize_fp8(padded, block)
        assert torch.equal(a.data.view(torch.uint8), b.data[:129, :257].view(torch.uint8))
        assert torch.equal(a.scale, b.scale[: a.scale.shape[0], : a.scale.shape[1]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input_is_upcast_exactly(dtype):
    x = outlier_data((128, 256), dtype=dtype)
    qt = quantize_fp8(x, (1, 128))
    ref_bytes, ref_scale = np_quantize(x.float().numpy(), (1, 128))
    assert np.array_equal(qt.data.view(torch.uint8).numpy(), ref_bytes)
    assert np.array_equal(qt.scale.numpy(), ref_scale)


def test_dequantize_error_is_bounded():
    x = outlier_data((256, 512))
    for block in [(1, 128), (128, 128), (128, 1)]:
        qt = quantize_fp8(x, block)
        err = (qt.dequantize() - x).abs()
        # Relative to its group scale, e4m3 rounding error is at most half an ulp: <= 16 (ulp 32 at [256, 448]).
        assert (err <= 16.0 * qt.expanded_scale() + 1e-30).all()
        assert torch.equal(dequantize_fp8(qt, torch.bfloat16), qt.dequantize().to(torch.bfloat16))


def test_input_validation():
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.randn(2, 3, 128))
    with pytest.raises(TypeError, match="floating-point"):
        quantize_fp8(torch.ones(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="empty"):
        quantize_fp8(torch.randn(0, 128))
    with pytest.raises(ValueError, match="positive"):
        quantize_fp8(torch.randn(4, 128), (0, 128))
    with pytest.raises(ValueError, match="nonfinite"):
        quantize_fp8(torch.randn(4, 128), nonfinite="ignore")


# ---- NaN / inf policy -----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_raises_by_default(bad):
    x = outlier_data((64, 256))
    x[3, 200] = bad
    x[40, 7] = bad
    with pytest.raises(NonFiniteInputError) as info:
        quantize_fp8(x, (1, 128))
    msg = str(info.value)
    assert "2 non-finite" in msg and "(3, 200)" in msg
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (128, 1)], ids=str)
def test_nonfinite_propagate_poisons_only_its_group(bad, block):
    x = outlier_data((256, 384))
    x[130, 200] = bad
    qt = quantize_fp8(x, block, nonfinite="propagate")
    deq = qt.dequantize()
    gr, gc = 130 // block[0], 200 // block[1]
    in_group = torch.zeros_like(x, dtype=torch.bool)
    in_group[gr * block[0] : (gr + 1) * block[0], gc * block[1] : (gc + 1) * block[1]] = True
    assert torch.isnan(deq[in_group]).all(), "the poisoned group must dequantize to NaN"
    assert not torch.isfinite(qt.scale[gr, gc]), "the poisoned group's scale must be non-finite"
    # Every other group is exactly what it would be without the bad value (same group scales, same bytes).
    clean = x.clone()
    clean[in_group] = 0.0
    ref = quantize_fp8(clean, block)
    other = ~in_group
    assert torch.equal(qt.data.view(torch.uint8)[other], ref.data.view(torch.uint8)[other])
    mask = torch.ones_like(ref.scale, dtype=torch.bool)
    mask[gr, gc] = False
    assert torch.equal(qt.scale[mask], ref.scale[mask])


# ---- exact transposition and re-quantization -------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES + [(128, 128), (512, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("pow2", [False, True], ids=["plain", "pow2"])
def test_128x128_transposes_exactly(shape, pow2):
    w = outlier_data(shape)
    a = quantize_fp8(w, (128, 128), pow2_scale=pow2).t()
    b = quantize_fp8(w.t().contiguous(), (128, 128), pow2_scale=pow2)
    assert a.block == b.block == (128, 128)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale, b.scale)
    assert torch.equal(a.dequantize(), b.dequantize())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_1x128_transpose_is_128x1_of_transpose(shape):
    x = outlier_data(shape)
    a = quantize_fp8(x, (1, 128)).t()
    b = quantize_fp8(x.t().contiguous(), (128, 1))
    assert a.block == b.block == (128, 1)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_requantize_1x128_to_128x1(shape):
    x = outlier_data(shape)
    q1 = quantize_fp8(x, (1, 128))
    r = requantize_fp8(q1, (128, 1))
    ref = quantize_fp8(q1.dequantize(torch.float32), (128, 1))
    assert r.block == (128, 1)
    assert torch.equal(r.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(r.scale, ref.scale)
    # And against the independent reference applied to the dequantized fp32 values.
    ref_bytes, ref_scale = np_quantize(q1.dequantize().numpy(), (128, 1))
    assert np.array_equal(r.data.view(torch.uint8).numpy(), ref_bytes)
    assert np.array_equal(r.scale.numpy(), ref_scale)
    # Dequantization is one correctly rounded fp32 multiply: q (4 significant bits) times the
    # fp32 scale (24) is exact in float64, so rounding that to fp32 must give the same values.
    exact = q1.data.double() * q1.expanded_scale().double()
    assert torch.equal(q1.dequantize(), exact.float())


def test_quantized_tensor_rejects_bad_scale_shape():
    x = outlier_data((4, 256))
    qt = quantize_fp8(x)
    with pytest.raises(ValueError, match="scale shape"):
        QuantizedTensor(qt.data, qt.scale[:, :1], (1, 128))
    assert qt.nbytes() == 4 * 256 + 4 * 2 * 4
    assert math.isclose(qt.nbytes() / (x.numel() * 2), (1 + 4 / 128) / 2)


def test_ops_quantize_dual_is_both_layouts_of_one_tensor():
    """The backward's dY entry point: (Q(x, 1x128), Q(x, 128x1)^T), checked against the numpy reference."""
    from jetrl_precision import get_recipe, ops

    bw = get_recipe("jet_fp8").train_backward
    x = outlier_data((300, 200)).to(torch.bfloat16)
    q, qt = ops.quantize_dual(x, bw.dgrad_grad_output, bw.wgrad_grad_output)
    assert q.block == (1, 128) and qt.block == (1, 128) and tuple(qt.shape) == (200, 300)
    ref_bytes, ref_scale = np_quantize(x.float().numpy(), (1, 128), bw.dgrad_grad_output.pow2_scale)
    assert np.array_equal(q.data.view(torch.uint8).numpy(), ref_bytes) and np.array_equal(q.scale.numpy(), ref_scale)
    ref_bytes_t, ref_scale_t = np_quantize(x.float().numpy(), (128, 1), bw.wgrad_grad_output.pow2_scale)
    assert np.array_equal(qt.data.view(torch.uint8).numpy(), ref_bytes_t.T)
    assert np.array_equal(qt.scale.numpy(), ref_scale_t.T)
