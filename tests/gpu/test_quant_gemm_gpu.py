"""The one-launch FP8 linear (kernels.quant_gemm) on the GPU: the reference quantizer's bytes fed to the batch-invariant
FP8 GEMM, bit for bit, at decode sizes of the 8B and SmolLM2 projections; rows independent of their batch; close to a
float64 product; and EngineLinear's fused decode path (the eager engine's JETRL_EAGER_FUSED=1) runs it."""

from __future__ import annotations

import pytest
import torch

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision.quantize import quantize_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

if torch.cuda.is_available():
    from jetrl_precision.kernels.invariant_gemm import fp8_gemm_nt_invariant
    from jetrl_precision.kernels.quant_gemm import fp8_linear_invariant

# (N, K): Llama-3.1-8B qkv, o, gate_up, down; SmolLM2-135M qkv and down (K = 576 and 1536, N = 960 not of 128)
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (960, 576), (576, 1536)]
MS = [1, 3, 16, 64, 100, 256]


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _case(m, n, k, dtype, seed):
    x = outlier_data(m, k, dtype=dtype, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    w = quantize_fp8(torch.randn(n, k, device="cuda", generator=g) * 0.02, (128, 128))
    return x, w


def _sm89():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 MMA needs sm89+")


@pytest.mark.parametrize("pow2", [False, True], ids=["rn", "pow2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_equals_reference_quantizer_then_invariant_gemm(dtype, pow2):
    _sm89()
    for i, (n, k) in enumerate(SHAPES):
        for m in MS:
            x, w = _case(m, n, k, dtype, 10 * i + m)
            xq = quantize_fp8(x, (1, 128), pow2_scale=pow2)
            want = fp8_gemm_nt_invariant(xq.data, xq.scale, w.data, w.scale, 128, dtype)
            got = fp8_linear_invariant(x, w.data, w.scale, 128, dtype, pow2)
            bad = int((_bits(got) != _bits(want)).sum())
            assert bad == 0, f"N={n} K={k} M={m}: {bad} of {want.numel()} outputs differ from quantize + invariant GEMM"


def test_rows_do_not_depend_on_the_batch_and_meet_float64():
    _sm89()
    n, k = 6144, 4096
    x, w = _case(256, n, k, torch.bfloat16, 5)
    together = fp8_linear_invariant(x, w.data, w.scale, 128)
    for rows in ([0], [7, 200], list(range(64, 128))):
        assert torch.equal(_bits(fp8_linear_invariant(x[rows], w.data, w.scale, 128)), _bits(together[rows])), rows
    xq = quantize_fp8(x, (1, 128))
    ref = xq.dequantize(torch.float64) @ w.dequantize(torch.float64).t()
    err = float((together.double() - ref).norm() / ref.norm())
    assert err < 4e-3, err  # bf16 output rounding dominates


def test_engine_fused_decode_runs_the_kernel():
    _sm89()
    from jetrl_precision import get_recipe
    from jetrl_precision.integrations.engine_linear import FUSED_DECODE, FUSED_DECODE_MAX_M, EngineLinear

    spec = get_recipe("jet_fp8").rollout.input
    x, w = _case(FUSED_DECODE_MAX_M, 4096, 4096, torch.bfloat16, 9)
    lin = EngineLinear(w.data, w.scale, [(4096, 32, 128)], 128, spec, "torch", FUSED_DECODE, FUSED_DECODE_MAX_M)
    assert lin.decode_gemm == f"{FUSED_DECODE} (M <= {FUSED_DECODE_MAX_M})"
    assert torch.equal(_bits(lin(x)), _bits(fp8_linear_invariant(x, w.data, w.scale, 128, torch.bfloat16, spec.pow2_scale)))
    big, _ = _case(FUSED_DECODE_MAX_M + 8, 4096, 4096, torch.bfloat16, 10)
    plain = EngineLinear(w.data, w.scale, [(4096, 32, 128)], 128, spec, "torch")
    assert torch.equal(_bits(lin(big)), _bits(plain(big)))  # past the decode size: the cuBLASLt path
