"""The CUDA 1x128 activation quantizer (kernels.quant_cuda) writes the reference quantizer's bytes and scale bits,
passes its own first-use check on this GPU, and is what the engine's prepared cuBLASLt path quantizes with."""

from __future__ import annotations

import pytest
import torch

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision.quantize import quantize_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

if torch.cuda.is_available():
    from jetrl_precision.kernels import quant, quant_cuda

DTYPES = [torch.bfloat16, torch.float16]


def _bits_equal(got, ref, what: str) -> None:
    rows = ref.data.shape[0]
    data, scale = got.data[:rows], got.scale[:rows]
    bad = int((data.view(torch.uint8) != ref.data.view(torch.uint8)).sum())
    assert bad == 0, f"{what}: {bad} of {ref.data.numel()} fp8 bytes differ from the reference"
    assert torch.equal(scale.contiguous().view(torch.int32), ref.scale.contiguous().view(torch.int32)), f"{what}: scale bits differ"


def _quantizer(dtype, pow2):
    ok, why = quant_cuda.status(torch.device("cuda"), pow2, dtype)
    assert ok, f"the CUDA quantizer must build and pass its check on an sm89+ GPU with NVRTC: {why}"
    return quant_cuda.quantizer_1x128("cuda", pow2, dtype)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_builds_and_passes_its_first_use_check(dtype, pow2):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs sm89+")
    q = _quantizer(dtype, pow2)
    assert quant_cuda.first_mismatch(q, torch.device("cuda")) == ""


@pytest.mark.parametrize("shape", [(1, 128), (3, 100), (64, 4096), (257, 1000), (1000, 4096), (4096, 14336)])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_bytes_equal_the_reference(shape, dtype, pow2):
    q = _quantizer(dtype, pow2)
    x = outlier_data(*shape, dtype=dtype, seed=shape[0])
    ref = quantize_fp8(x, (1, 128), pow2_scale=pow2, nonfinite="propagate")
    _bits_equal(q(x), ref, f"{shape}")
    pad = -(-shape[0] // 4) * 4 + 4
    got = q(x, pad)  # the M-padded buffer cuBLASLt reads: rows past M left unset, scales strided by the padding
    assert got.data.shape == (pad, shape[1]) and got.scale.stride() == (1, pad)
    _bits_equal(got, ref, f"{shape} rows_alloc={pad}")
    triton = quant.quantize_1x128(x, pow2, rows_alloc=pad)
    assert got.scale.stride() == triton.scale.stride() and got.data.stride() == triton.data.stride()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_nonfinite_zero_groups_and_signed_zeros(dtype):
    q = _quantizer(dtype, False)
    x = outlier_data(300, 1024, dtype=torch.float32, seed=3)
    x[3, 5] = float("nan")
    x[100, 300] = float("inf")
    x[200, 1000] = -float("inf")
    x[7, 128:256] = 0.0
    x[8, 0:64] = -0.0
    x[130:260, 700] = float("nan")
    x = x.to(dtype)
    _bits_equal(q(x), quantize_fp8(x, (1, 128), nonfinite="propagate"), "non-finite")


def test_inputs_it_cannot_take_go_to_triton_with_the_same_bytes():
    q = _quantizer(torch.bfloat16, False)
    base = outlier_data(64, 1024, seed=5)
    strided = outlier_data(1024, 64, seed=6).t()  # columns not contiguous
    odd = outlier_data(64, 1026, seed=7)[:, 1:1025]  # rows 2-byte aligned only
    for x in (base.float(), strided, odd):
        _bits_equal(q(x), quantize_fp8(x, (1, 128), nonfinite="propagate"), f"{x.dtype} {x.stride()}")


def test_engine_linear_quantizes_with_it():
    from jetrl_precision import get_recipe
    from jetrl_precision.gemm import gemm_nt
    from jetrl_precision.integrations.engine_linear import EngineLinear

    _quantizer(torch.bfloat16, False)
    w = quantize_fp8(outlier_data(512, 1024, seed=8) * 0.02, (128, 128))
    eng = EngineLinear(w.data, w.scale, [(512, 4, 128)], 128, get_recipe("jet_fp8").rollout.input, "torch")
    assert eng.input_kernel(torch.bfloat16) == quant_cuda.GRAPH_KERNEL
    for m in (1, 3, 64, 130):
        x = outlier_data(m, 1024, seed=m)
        want = gemm_nt(quantize_fp8(x, (1, 128)), w, torch.bfloat16, "torch")
        assert torch.equal(eng(x), want), f"M={m}"
