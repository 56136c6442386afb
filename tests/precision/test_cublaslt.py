"""cuBLASLt GEMM plans (gemm.cublaslt) on CPU: the plan's calls against the library's semantics (gemm.cublaslt_cpu).

The GPU side (bits equal to F.scaled_mm over decode and prefill shapes, under a CUDA graph, on a side stream and a
worker thread) is tests/gpu/test_cublaslt_gpu.py.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import pytest
import torch

from jetrl_precision.gemm import cublaslt, gemm_nt
from jetrl_precision.gemm.cublaslt import LtBlockwiseGemm, blockwise_gemm, lt_workspace_bytes
from jetrl_precision.gemm.cublaslt_cpu import EmulatedLt
from jetrl_precision.kernels.layout import mn_major, row_major_padded_t
from jetrl_precision.quantize import quantize_fp8

CPU = torch.device("cpu")


def _operands(m, n, k, block_b, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, 1, generator=g))
    x[:, ::97] *= 300.0  # outlier columns
    w = torch.randn(n, k, generator=g) * 0.05
    w[::31] *= 40.0  # outlier rows
    aq = quantize_fp8(x, (1, 128))
    wq = quantize_fp8(w, (128, 128) if block_b == "128x128" else (1, 128))
    sb = row_major_padded_t(wq.scale) if block_b == "128x128" else mn_major(wq.scale)
    return aq, wq, (aq.data, wq.data.t(), mn_major(aq.scale), sb)


def _gemm(block_b="128x128", lib=None):
    return LtBlockwiseGemm(CPU, "1x128", block_b, lib=lib or EmulatedLt(), stream=lambda: 0)


@pytest.mark.parametrize("block_b", ["128x128", "1x128"])
@pytest.mark.parametrize("m,n,k", [(4, 256, 256), (64, 384, 640), (200, 256, 1152), (8, 1280, 128)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_plan_computes_the_blockwise_product(block_b, m, n, k, out_dtype):
    aq, wq, args = _operands(m, n, k, block_b, seed=m + n + k)
    got = _gemm(block_b)(*args, out_dtype)
    want = gemm_nt(aq, wq, out_dtype, "emulated")
    assert got.shape == (m, n) and got.dtype == out_dtype and got.is_contiguous()
    assert torch.equal(got, want)


def test_emulation_tells_swapped_scales_apart():
    # The check has teeth: the same bytes read with the recipes swapped (as a plan that swapped the scale modes
    # or pointers would pass them) give another product.
    aq, wq, args = _operands(64, 256, 512, "128x128")
    right = _gemm("128x128")(*args, torch.float32)
    wrong = LtBlockwiseGemm(CPU, "1x128", "1x128", lib=EmulatedLt(), stream=lambda: 0)
    a, b_t, sa, _ = args
    swapped = wrong(a, b_t, sa, mn_major(torch.ones(256, 4)), torch.float32)
    assert not torch.equal(right, swapped)


def test_plans_are_made_once_per_shape_and_bounded(monkeypatch):
    lib = EmulatedLt()
    gemm = _gemm(lib=lib)
    _, _, args = _operands(64, 256, 256, "128x128")
    gemm(*args, torch.bfloat16)
    made = lib.live_objects
    assert made == 5  # one descriptor, four layouts; the preference is destroyed after the heuristic
    for _ in range(3):
        gemm(*args, torch.bfloat16)
    assert lib.live_objects == made and gemm.plan_count == 1 and lib.matmuls == 4
    gemm(*args, torch.float32)  # another output dtype is another plan (C/D layouts typed as D)
    assert gemm.plan_count == 2
    monkeypatch.setattr(cublaslt, "_MAX_PLANS", 3)
    for m in (8, 12, 16, 20, 24):
        _, _, margs = _operands(m, 256, 256, "128x128")
        gemm(*margs, torch.bfloat16)
    assert gemm.plan_count == 3 and lib.live_objects == 3 * 5  # evicted plans free their descriptors


def test_offered_algorithms_are_kept_with_the_plan_and_one_is_chosen():
    lib = EmulatedLt(algorithms=3)
    gemm = _gemm("1x128", lib=lib)
    aq, wq, args = _operands(64, 256, 512, "1x128")
    want = gemm_nt(aq, wq, torch.bfloat16, "emulated")
    gemm(*args, torch.bfloat16)
    made = lib.live_objects
    offered = gemm.offer_algorithms(*args, torch.bfloat16, count=8)
    # the heuristic's results as it filled them; the re-plan replaced the shape's plan and freed the old one's objects
    assert [o["index"] for o in offered] == [0, 1, 2] and [o["waves"] for o in offered] == [1.0, 2.0, 3.0]
    assert gemm.plan_count == 1 and lib.live_objects == made
    assert torch.equal(gemm(*args, torch.bfloat16), want) and lib.algos_run[-1] == 0  # still the heuristic's first
    gemm.use_algorithm(64, 256, 512, torch.bfloat16, 2)
    assert torch.equal(gemm(*args, torch.bfloat16), want) and lib.algos_run[-1] == 2
    with pytest.raises(ValueError, match=r"has 3 offered algorithms, no index 3; call offer_algorithms"):
        gemm.use_algorithm(64, 256, 512, torch.bfloat16, 3)
    with pytest.raises(ValueError, match=r"M=8 N=256 K=512 torch.bfloat16 has 0 offered algorithms"):
        gemm.use_algorithm(8, 256, 512, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="count must be >= 1"):
        gemm.offer_algorithms(*args, torch.bfloat16, count=0)


def test_concurrent_calls_on_one_plan_keep_their_own_scales():
    # The descriptor carries each call's scale pointers until its matmul: two threads on one shape must not mix them.
    gemm = _gemm()
    cases = [_operands(64, 256, 512, "128x128", seed=s) for s in (1, 2)]
    wants = [gemm_nt(aq, wq, torch.float32, "emulated") for aq, wq, _ in cases]
    bad = []

    def work(i):
        for _ in range(15):
            if not torch.equal(gemm(*cases[i][2], torch.float32), wants[i]):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and gemm.plan_count == 1


def test_bad_operands_get_one_clear_line():
    gemm = _gemm()
    a, b_t, sa, sb = _operands(64, 256, 256, "128x128")[2]
    with pytest.raises(ValueError, match="a must be contiguous"):
        gemm(a.t().contiguous().t(), b_t, sa, sb, torch.bfloat16)
    with pytest.raises(ValueError, match="b_t the transpose of a contiguous"):
        gemm(a, b_t.contiguous(), sa, sb, torch.bfloat16)
    with pytest.raises(ValueError, match="output dtype torch.float64 is not supported"):
        gemm(a, b_t, sa, sb, torch.float64)


class _NoAlgorithm(EmulatedLt):
    def cublasLtMatmulAlgoGetHeuristic(self, *args):
        ctypes.c_int.from_address(args[-1]).value = 0  # the heuristic found nothing
        return 0


def test_a_shape_without_an_algorithm_raises_and_frees_its_descriptors():
    lib = _NoAlgorithm()
    gemm = _gemm(lib=lib)
    with pytest.raises(RuntimeError, match="cuBLASLt has no algorithm for M=64 N=256 K=256"):
        gemm(*_operands(64, 256, 256, "128x128")[2], torch.bfloat16)
    assert lib.live_objects == 0 and gemm.plan_count == 0


def test_library_errors_name_the_call():
    class Refuses(EmulatedLt):
        def cublasLtMatmul(self, *args):
            return 13  # CUBLAS_STATUS_EXECUTION_FAILED

    gemm = _gemm(lib=Refuses())
    with pytest.raises(RuntimeError, match=r"cublasLtMatmul failed \(cublasStatus_t 13\) for M=64 N=256 K=256"):
        gemm(*_operands(64, 256, 256, "128x128")[2], torch.bfloat16)


def test_workspace_cap_follows_torch(monkeypatch):
    for var in ("CUBLASLT_WORKSPACE_SIZE", "CUBLAS_WORKSPACE_CONFIG", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(var, raising=False)
    assert lt_workspace_bytes(CPU) == 1024 * 1024  # torch's default: 1 MiB
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "4096")
    assert lt_workspace_bytes(CPU) == 4 * 1024 * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":1024:2")  # 2 MiB of cuBLAS workspace caps the unified Lt one
    assert lt_workspace_bytes(CPU) == 2 * 1024 * 1024
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")
    assert lt_workspace_bytes(CPU) == 4 * 1024 * 1024
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "lots")
    assert lt_workspace_bytes(CPU) == 1024 * 1024


def test_plan_asks_the_heuristic_with_torchs_cap(monkeypatch):
    seen = []

    class Records(EmulatedLt):
        def cublasLtMatmulPreferenceSetAttribute(self, pref, attr, addr, size):
            seen.append(int.from_bytes(ctypes.string_at(addr, size), "little"))
            return super().cublasLtMatmulPreferenceSetAttribute(pref, attr, addr, size)

    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "2048")
    gemm = _gemm(lib=Records())
    gemm(*_operands(64, 256, 256, "128x128")[2], torch.bfloat16)
    assert seen == [2 * 1024 * 1024] and gemm._workspaces[0].numel() == 2 * 1024 * 1024


def test_plans_are_opt_in_and_say_why_they_cannot_run(caplog, monkeypatch):
    monkeypatch.setattr(cublaslt, "_verdicts", {})
    monkeypatch.setattr(cublaslt, "_reasons", {})
    monkeypatch.delenv("JETRL_CUBLASLT_PLAN", raising=False)
    with caplog.at_level(logging.WARNING, logger="jetrl_precision.gemm.cublaslt"):
        assert blockwise_gemm("cpu", "1x128", "128x128") is None
    assert not caplog.records  # not asked for: nothing to warn about
    assert cublaslt.call_status("cpu") == "torch.scaled_mm"
    if torch.cuda.is_available():
        pytest.skip("the no-CUDA branch")
    monkeypatch.setenv("JETRL_CUBLASLT_PLAN", "1")
    with caplog.at_level(logging.WARNING, logger="jetrl_precision.gemm.cublaslt"):
        assert blockwise_gemm("cpu", "1x128", "128x128") is None
        assert blockwise_gemm("cpu", "1x128", "128x128") is None
    assert len(caplog.records) == 1 and "needs a CUDA device" in caplog.records[0].getMessage()
    assert cublaslt.call_status("cpu").startswith("torch.scaled_mm (needs a CUDA device")
