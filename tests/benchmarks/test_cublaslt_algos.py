"""cublaslt_algos_gpu.py on cuBLASLt's API emulated over CPU memory: every offered algorithm is timed and checked, the
plan is left on the heuristic's first, and the results become run records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_the_training_gemms_of_a_projection_have_the_shapes_of_its_three_products():
    import cublaslt_algos_gpu as ca

    shapes = {(name, kind): dims for name, kind, *dims in ca.gemm_shapes(8192)}
    # qkv: x [8192, 4096], W [6144, 4096]
    assert shapes[("qkv", "fprop")] == [8192, 6144, 4096, "128x128"]
    assert shapes[("qkv", "dgrad")] == [8192, 4096, 6144, "128x128"]
    assert shapes[("qkv", "wgrad")] == [6144, 4096, 8192, "1x128"]
    assert len(shapes) == 12


def test_sweep_times_every_offered_algorithm_and_leaves_the_first_in_place(tmp_path):
    import cublaslt_algos_gpu as ca

    from jetrl_precision.gemm.cublaslt import LtBlockwiseGemm
    from jetrl_precision.gemm.cublaslt_cpu import EmulatedLt

    lib = EmulatedLt(algorithms=3)
    gemm = LtBlockwiseGemm(torch.device("cpu"), "1x128", "1x128", lib=lib, stream=lambda: 0)
    args = ca.operands(64, 256, 384, "1x128", "cpu")
    rows = ca.sweep(gemm, args, torch.bfloat16, count=8, rounds=2, iters=1, timer=ca.host_timer)
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert all(r["bits_equal_first"] and len(r["ms_each"]) == 2 and r["ms"] > 0 for r in rows)
    lib.algos_run.clear()
    gemm(*args, torch.bfloat16)
    assert lib.algos_run == [0]  # the plan runs the heuristic's first again
    s = ca.summary("qkv", "wgrad", 64, 256, 384, rows)
    assert s["offered"] == 3 and s["best_index"] in (0, 1, 2) and s["speedup"] >= 1.0 and s["best_bits_equal_first"]

    out = tmp_path / "algos.json"
    out.write_text(json.dumps({"date": "2026-12-06", "device": "x86-64 CPU", "tokens": 64, "results": [s]}))
    assert ca.main(["--from", str(out), "--record", "--command", "test", "--runs-dir", str(tmp_path / "runs")]) == 0
    (rec,) = json.loads(next((tmp_path / "runs").glob("2026-12-06_01_cublaslt-algos.json")).read_text())
    assert rec["name"] == "cublaslt_fastest_offered_algo_speedup" and rec["value"] == s["speedup"] and rec["device"] == "x86-64 CPU"


def test_an_algorithm_the_library_refuses_is_noted_not_timed():
    import cublaslt_algos_gpu as ca

    from jetrl_precision.gemm.cublaslt import LtBlockwiseGemm
    from jetrl_precision.gemm.cublaslt_cpu import EmulatedLt

    class RefusesTheSecond(EmulatedLt):
        def cublasLtMatmul(self, handle, desc, alpha, a, la, b, lb, beta, c, lc, d, ld, algo, *rest):
            import ctypes

            if ctypes.c_uint8.from_address(algo).value == 1:
                return 15  # CUBLAS_STATUS_NOT_SUPPORTED
            return super().cublasLtMatmul(handle, desc, alpha, a, la, b, lb, beta, c, lc, d, ld, algo, *rest)

    gemm = LtBlockwiseGemm(torch.device("cpu"), "1x128", "128x128", lib=RefusesTheSecond(algorithms=3), stream=lambda: 0)
    rows = ca.sweep(gemm, ca.operands(64, 256, 256, "128x128", "cpu"), torch.bfloat16, count=4, rounds=1, iters=1,
                    timer=ca.host_timer)
    assert "cublasLtMatmul failed" in rows[1]["error"] and "ms" not in rows[1]
    assert "ms" in rows[0] and "ms" in rows[2]


def test_record_needs_a_finished_run():
    import cublaslt_algos_gpu as ca

    with pytest.raises(SystemExit):
        ca.main(["--record"])
