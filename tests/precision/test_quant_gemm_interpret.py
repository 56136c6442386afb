"""The one-launch FP8 linear (kernels/quant_gemm.py) runs for real on CPU in Triton's interpreter.

Needs triton (the `make test-triton` target puts it on PYTHONPATH; the main venv has none, so these skip there):

    PYTHONPATH=$PWD/.liger-site python -m pytest -q tests/precision/test_quant_gemm_interpret.py

What they prove on CPU: the fused kernel's output equals, bit for bit, the 1x128 quantize kernel's bytes fed to the
batch-invariant FP8 GEMM under the same configuration (K not a multiple of 128, split-K, pow2 scales, bf16 and fp16
activations, outliers), that a row's bits do not depend on the batch around it, and that EngineLinear's fused
decode path is this kernel. The interpreter's MMA is emulated in float64 in both kernels (invariant_gemm
._interpreted); the hardware MMA's side is tests/gpu/test_quant_gemm_gpu.py.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from precision_testutil import outlier_data
from jetrl_precision import quantize_fp8

# _common holds the @triton.jit helpers the kernels call: a copy imported without the interpreter (by an earlier test
# in this process) cannot be called from an interpreted kernel, so it is imported afresh too.
_MODS = ("jetrl_precision.kernels._common", "jetrl_precision.kernels.invariant_gemm", "jetrl_precision.kernels.quant_gemm",
         "jetrl_precision.kernels.quant")


@pytest.fixture(scope="module")
def kern():
    """The kernel modules imported under TRITON_INTERPRET=1, dropped afterwards (later imports get compiled kernels)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the compiled kernels in tests/gpu/test_quant_gemm_gpu.py")
    for name in _MODS:
        sys.modules.pop(name, None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        pytest.importorskip("triton", reason="triton is not installed (the CI venv): the interpreter tests need it")
        importlib.import_module(_MODS[0])
        ig = importlib.import_module(_MODS[1])
        qg = importlib.import_module(_MODS[2])
        q = importlib.import_module(_MODS[3])
        yield ig, qg, q
    for name in _MODS:
        sys.modules.pop(name, None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _weight(n: int, k: int, seed: int, block=(128, 128)):
    return quantize_fp8(outlier_data((n, k), generator=torch.Generator().manual_seed(seed)) * 0.02, block)


def _two_launches(kern, x, w, pow2, out_dtype, config=None):
    """The 1x128 quantize kernel, then the invariant GEMM. The interpreter's fp32 -> e4m3 conversion is not the GPU's
    (ties and some values round elsewhere), so the comparison is with the interpreted quantize kernel, whose
    conversion is the same instruction; its bytes against the reference are the GPU tests' job."""
    ig, _, q = kern
    xq = q.quantize_1x128(x, pow2)
    return ig.fp8_gemm_nt_invariant(xq.data, xq.scale, w.data, w.scale, w.block[0], out_dtype, config)


# (M, N, K, activation dtype, pow2): SmolLM2's hidden 576 (a partial last K group), a 192-row k/v part, a long K
CASES = [(5, 576, 576, torch.bfloat16, False), (37, 192, 576, torch.float16, True), (64, 256, 1536, torch.bfloat16, True),
         (1, 200, 1456, torch.float16, False)]


@pytest.mark.parametrize("m,n,k,dtype,pow2", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_fused_equals_quantize_then_invariant_gemm(kern, m, n, k, dtype, pow2):
    qg = kern[1]
    x = outlier_data((m, k), generator=torch.Generator().manual_seed(m + k), dtype=dtype)
    w = _weight(n, k, seed=n)
    got = qg.fp8_linear_invariant(x, w.data, w.scale, 128, None, pow2)
    want = _two_launches(kern, x, w, pow2, dtype)
    assert got.dtype == dtype and got.shape == (m, n)
    assert torch.equal(_bits(got), _bits(want)), f"{int((_bits(got) != _bits(want)).sum())} of {want.numel()} outputs differ"


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_and_1x128_weights(kern, split_k):
    ig, qg, _ = kern
    x = outlier_data((20, 1536), generator=torch.Generator().manual_seed(5), dtype=torch.bfloat16)
    w = _weight(192, 1536, seed=6, block=(1, 128))
    cfg = ig.InvariantConfig(block_n=64, block_m=16, split_k=split_k)
    got = qg.fp8_linear_invariant(x, w.data, w.scale, 1, torch.float32, False, cfg)
    want = _two_launches(kern, x, w, False, torch.float32, cfg)
    assert torch.equal(_bits(got), _bits(want))


def test_a_row_does_not_depend_on_its_batch(kern):
    qg = kern[1]
    w = _weight(192, 576, seed=9)
    g = torch.Generator().manual_seed(10)
    batch = outlier_data((40, 576), generator=g, dtype=torch.bfloat16)
    together = qg.fp8_linear_invariant(batch, w.data, w.scale, 128)
    for rows in ((0,), (3, 17), tuple(range(10, 40))):
        alone = qg.fp8_linear_invariant(batch[list(rows)], w.data, w.scale, 128)
        assert torch.equal(_bits(alone), _bits(together[list(rows)])), rows


def test_another_scale_rule_changes_the_bits(kern):
    # The comparisons have teeth: pow2 against round-to-nearest scales gives other outputs.
    qg = kern[1]
    x = outlier_data((8, 576), generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    w = _weight(192, 576, seed=2)
    assert not torch.equal(qg.fp8_linear_invariant(x, w.data, w.scale, 128, None, True),
                           qg.fp8_linear_invariant(x, w.data, w.scale, 128, None, False))


def test_bad_input_gets_one_clear_line(kern):
    qg = kern[1]
    w = _weight(128, 256, seed=3)
    with pytest.raises(ValueError, match="x must be bf16/fp16"):
        qg.fp8_linear_invariant(torch.randn(4, 256), w.data, w.scale, 128)
    with pytest.raises(ValueError, match="same K"):
        qg.fp8_linear_invariant(torch.randn(4, 128, dtype=torch.bfloat16), w.data, w.scale, 128)


def test_engine_fused_decode_path_runs_the_kernel(kern, monkeypatch):
    """EngineLinear with the fused decode backend: decode-sized batches go through the kernel (bits equal to the
    two-launch path), larger ones through the prepared cuBLASLt path (simulated here by the host-cost proxy's stubs)."""
    qg = kern[1]
    from jetrl_precision import get_recipe
    from jetrl_precision.integrations import engine_linear

    spec = get_recipe("jet_fp8").rollout.input
    w = _weight(256, 512, seed=4)
    calls = []
    real = qg.fp8_linear_invariant
    monkeypatch.setattr(qg, "fp8_linear_invariant", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    decode = engine_linear._fused_decode(w.data, w.scale, spec.pow2_scale)
    x = outlier_data((7, 512), generator=torch.Generator().manual_seed(8), dtype=torch.bfloat16)
    got = decode(x)
    assert calls == [7]
    assert torch.equal(_bits(got), _bits(_two_launches(kern, x, w, spec.pow2_scale, torch.bfloat16)))
