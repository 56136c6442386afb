"""Each hardware GEMM backend against the fp32 product of the dequantized operands, and against each other."""

from __future__ import annotations

import pytest
import torch

from gpu_testutil import outlier_data, rel_err, requires_cuda_reason
from jetrl_precision.gemm import BackendUnavailable, available_backends, gemm_nt, resolve_backend
from jetrl_precision.gemm.dispatch import _REGISTRY, AUTO_ORDER_CUDA, GemmBackend, register_backend
from jetrl_precision.quantize import quantize_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

HW = ("torch", "triton", "deep_gemm")
# bf16 output: the error floor is the bf16 rounding of the exact result (~1.7e-3 relative).
TOL_BF16 = 2e-3
# fp32 output: Hopper's FP8 MMA keeps fewer bits than fp32 inside a 128-wide K group. Measured on the
# H200: 2.0-3.3e-4 for cuBLASLt and Triton alike (identical values), far below a wrong-scale error (~1e-1).
TOL_FP32 = 5e-4
# Two hardware backends on the same operands: both use the same MMA, so they agree much more closely.
TOL_AGREE = 2e-5

# (M, N, K): Llama-3.1-8B-like shapes, decode M, and edges (M < 128, N and K not multiples of 128).
SHAPES = [
    (4096, 6144, 4096),
    (256, 4096, 14336),
    (64, 28672, 4096),
    (1, 256, 512),
    (100, 384, 640),  # K/128 = 5: scale_b needs padding to a multiple of 4 for cuBLASLt
    (130, 200, 300),  # N and K not multiples of 128
    (1000, 1000, 1000),
]


def _backend_or_skip(name: str) -> str:
    reason = available_backends("cuda")[name]
    if reason is not None:
        pytest.skip(f"{name} unavailable: {reason}")
    return name


def _operands(m, n, k, b_block, seed, maker="triton"):
    from jetrl_precision.kernels import quant

    x = outlier_data(m, k, seed=seed)
    w = outlier_data(n, k, seed=seed + 1) * 0.02
    if maker == "triton":
        a = quant.quantize_1x128(x)
        b = quant.quantize_128x128(w)[0] if b_block == (128, 128) else quant.quantize_1x128(w)
    else:  # reference-made operands: contiguous scales, the backends must re-layout them
        a = quantize_fp8(x, (1, 128))
        b = quantize_fp8(w, b_block)
    return a, b


def _reference(a, b) -> torch.Tensor:
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a.dequantize(torch.float64) @ b.dequantize(torch.float64).t() if a.shape[0] * b.shape[0] <= 4096 * 6144 else (
            a.dequantize(torch.float32) @ b.dequantize(torch.float32).t()
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@pytest.mark.parametrize("backend", HW)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["fprop", "wgrad"])
def test_backend_vs_fp32_reference(backend, shape, b_block):
    name = _backend_or_skip(backend)
    m, n, k = shape
    a, b = _operands(m, n, k, b_block, seed=sum(shape))
    ref = _reference(a, b)
    out = gemm_nt(a, b, torch.bfloat16, name)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL_BF16, f"{name} {shape} {b_block}: bf16 out rel err {rel_err(out, ref):.3e}"
    out32 = gemm_nt(a, b, torch.float32, name)
    assert rel_err(out32, ref) <= TOL_FP32, f"{name} {shape} {b_block}: fp32 out rel err {rel_err(out32, ref):.3e}"


@pytest.mark.parametrize("backend", HW)
def test_backend_accepts_reference_layouts(backend):
    name = _backend_or_skip(backend)
    for b_block in ((128, 128), (1, 128)):
        a, b = _operands(300, 640, 640, b_block, seed=11, maker="reference")
        ref = _reference(a, b)
        assert rel_err(gemm_nt(a, b, torch.float32, name), ref) <= TOL_FP32


@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (64, 4096, 14336), (130, 200, 300)], ids=str)
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["fprop", "wgrad"])
def test_backends_agree(shape, b_block):
    names = [n for n in HW if available_backends("cuda")[n] is None]
    if len(names) < 2:
        pytest.skip(f"fewer than two hardware backends here: {available_backends('cuda')}")
    a, b = _operands(*shape, b_block, seed=21)
    outs = {n: gemm_nt(a, b, torch.float32, n) for n in names}
    base = outs[names[0]]
    for n in names[1:]:
        assert rel_err(outs[n], base) <= TOL_AGREE, f"{n} vs {names[0]}: {rel_err(outs[n], base):.3e}"
        same = (outs[n] == base).float().mean().item()
        print(f"{n} vs {names[0]} {shape} {b_block}: rel diff {rel_err(outs[n], base):.2e}, bitwise-equal fraction {same:.4f}")
    emu = gemm_nt(a, b, torch.float32, "emulated")
    assert rel_err(base, emu) <= TOL_FP32


def test_deep_gemm_raw_api_contract():
    """The DeepGEMM calls the backend makes (2.6.1, sm90), made directly: the 1D2D form with TMA-aligned
    MN-major A scales for an M that is not a multiple of 4, and the 1D1D wgrad form, whose fp32 D is
    added to (C == D), so two calls give twice the product."""
    _backend_or_skip("deep_gemm")
    from jetrl_precision.gemm.deep_gemm_backend import _sm90_sfb, _tma_mn_major, import_deep_gemm

    dg = import_deep_gemm()
    m, n, k = 130, 256, 384
    a, b = _operands(m, n, k, (128, 128), seed=51)
    sa = _tma_mn_major(a.scale)
    assert sa.stride() == (1, 132)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    dg.fp8_gemm_nt((a.data, sa), (b.data, _sm90_sfb(b.scale)), d, recipe=(1, 128, 128), disable_ue8m0_cast=True)
    assert rel_err(d, _reference(a, b)) <= TOL_BF16
    a, b = _operands(m, n, k, (1, 128), seed=52)
    d32 = torch.zeros((m, n), dtype=torch.float32, device="cuda")
    for _ in range(2):
        dg.fp8_gemm_nt((a.data, _tma_mn_major(a.scale)), (b.data, _tma_mn_major(b.scale)), d32, c=d32,
                       recipe=(1, 1, 128), disable_ue8m0_cast=True)
    assert rel_err(d32, 2 * _reference(a, b)) <= TOL_FP32


@pytest.mark.parametrize("m,n,k", [(4096, 6144, 4096), (64, 4096, 14336), (130, 200, 300)])
def test_deep_gemm_wgrad_routing_and_1d1d(m, n, k):
    """The backend's WGrad goes to cuBLASLt where that works (same bits as the torch backend); DeepGEMM's
    own 1D1D kernel, kept for GPUs without it, matches the fp32 reference in fp32 and in bf16."""
    _backend_or_skip("deep_gemm")
    from jetrl_precision.gemm.deep_gemm_backend import deep_gemm_gemm_nt, deep_gemm_wgrad_1d1d

    a, b = _operands(m, n, k, (1, 128), seed=61)
    ref = _reference(a, b)
    if available_backends("cuda")["torch"] is None:
        assert torch.equal(deep_gemm_gemm_nt(a, b, torch.bfloat16), gemm_nt(a, b, torch.bfloat16, "torch"))
    assert rel_err(deep_gemm_wgrad_1d1d(a, b, torch.float32), ref) <= TOL_FP32
    assert rel_err(deep_gemm_wgrad_1d1d(a, b, torch.bfloat16), ref) <= TOL_BF16


def test_deep_gemm_1d1d_refuses_small_m():
    _backend_or_skip("deep_gemm")
    from jetrl_precision.gemm.deep_gemm_backend import deep_gemm_wgrad_1d1d

    a, b = _operands(1, 256, 512, (1, 128), seed=62)
    with pytest.raises(ValueError, match="M >= 64"):
        deep_gemm_wgrad_1d1d(a, b, torch.float32)


def test_triton_split_k_deterministic():
    from jetrl_precision.kernels.gemm import fp8_gemm_nt

    a, b = _operands(64, 4096, 14336, (128, 128), seed=31)
    outs = [fp8_gemm_nt(a.data, a.scale, b.data, b.scale, 128, torch.float32, split_k=4) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "split-K must be bitwise reproducible"
    ref = _reference(a, b)
    assert rel_err(outs[0], ref) <= TOL_FP32
    one = fp8_gemm_nt(a.data, a.scale, b.data, b.scale, 128, torch.float32, split_k=1)
    assert rel_err(one, ref) <= TOL_FP32


# ---- dispatch -----------------------------------------------------------------------------
def test_auto_order_on_sm90():
    avail = available_backends("cuda")
    expected = next((n for n in ("deep_gemm", "torch", "triton") if avail[n] is None), "emulated")
    assert resolve_backend("auto", "cuda") == expected
    if torch.cuda.get_device_capability() == (9, 0):
        assert avail["torch"] is None, f"torch blockwise scaled_mm should run on sm90: {avail['torch']}"
        assert avail["triton"] is None


def test_missing_deep_gemm_falls_back_with_reason():
    reason = available_backends("cuda")["deep_gemm"]
    if reason is None:
        pytest.skip("deep_gemm is installed here")
    assert "DeepGEMM" in reason or "deep_gemm" in reason
    with pytest.raises(BackendUnavailable, match="deep_gemm"):
        resolve_backend("deep_gemm", "cuda")
    assert resolve_backend("auto", "cuda") in ("torch", "triton")


def test_auto_falls_back_when_backends_are_missing():
    saved = {n: _REGISTRY[n] for n in HW}
    try:
        # Take the real backends out one by one, the way a missing library or an old cuBLASLt would.
        for gone in HW:
            b = saved[gone]
            register_backend(GemmBackend(gone, b.gemm_nt, lambda d, g=gone: f"{g} removed for this test"))
            chosen = resolve_backend("auto", "cuda")
            # auto takes the first that runs in its own order (DeepGEMM first), not in HW's
            remaining = [n for n in AUTO_ORDER_CUDA if available_backends("cuda")[n] is None]
            assert chosen == (remaining[0] if remaining else "emulated")
        assert resolve_backend("auto", "cuda") == "emulated"
        with pytest.raises(BackendUnavailable, match="removed for this test"):
            resolve_backend("torch", "cuda")
    finally:
        for n, b in saved.items():
            register_backend(b)
    # The emulated fallback still computes the right thing on the GPU.
    a, b = _operands(200, 256, 384, (128, 128), seed=41)
    assert rel_err(gemm_nt(a, b, torch.float32, "emulated"), _reference(a, b)) <= TOL_FP32
