"""The native training GEMM (gemm.cublaslt_native): opt-in, says why where it cannot run, and the extension it calls
builds here. Its bits against F.scaled_mm are tests/gpu/test_native_gemm_gpu.py's."""

from __future__ import annotations

import logging

import pytest
import torch

from jetrl_precision.gemm import cublaslt, cublaslt_native


@pytest.fixture
def fresh(monkeypatch):
    for mod in (cublaslt, cublaslt_native):
        monkeypatch.setattr(mod, "_verdicts", {})
        monkeypatch.setattr(mod, "_reasons", {})
    monkeypatch.delenv("JETRL_CUBLASLT_PLAN", raising=False)
    monkeypatch.delenv(cublaslt_native.ENV_SWITCH, raising=False)


def _never(*args):
    raise AssertionError("the fallback of an unused GEMM ran")


def test_opt_in_and_says_why_it_cannot_run(fresh, caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="jetrl_precision.gemm.cublaslt_native"):
        assert cublaslt_native.blockwise_gemm("cpu", "1x128", "128x128", _never) is None
    assert not caplog.records  # not asked for: nothing to warn about
    assert cublaslt.call_status("cpu") == "torch.scaled_mm"
    assert cublaslt_native.unavailable_reason("cpu") == f"not asked for ({cublaslt_native.ENV_SWITCH}=1 turns it on)"
    if torch.cuda.is_available():
        pytest.skip("the no-CUDA branch")
    monkeypatch.setenv(cublaslt_native.ENV_SWITCH, "1")
    with caplog.at_level(logging.WARNING, logger="jetrl_precision.gemm.cublaslt_native"):
        for _ in range(2):
            assert cublaslt_native.blockwise_gemm("cpu", "1x128", "128x128", _never) is None
    assert len(caplog.records) == 1 and "needs a CUDA device" in caplog.records[0].getMessage()
    assert cublaslt.call_status("cpu") == "torch.scaled_mm (needs a CUDA device, got cpu)"


@pytest.mark.slow
def test_the_extension_builds_with_the_training_gemm():
    # The C++ is compiled here as on a GPU machine (libcuda and cuBLASLt are opened at run time, not linked): a
    # source error shows on CPU, not first on the device.
    pytest.importorskip("ninja")
    from jetrl_precision.native_ext import extension

    mod = extension()
    if isinstance(mod, str) and "ninja" in mod.lower():
        pytest.skip(mod)
    assert not isinstance(mod, str), mod
    assert callable(mod.Runtime.gemm) and hasattr(mod.Runtime, "plan_count") and hasattr(mod, "Linear")
    with pytest.raises(RuntimeError, match="libcuda"):  # no driver here: the runtime says which library it lacks
        mod.Runtime("libcublasLt.so.13", 0, 1 << 20)
