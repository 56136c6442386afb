"""The `triton_invariant` GEMM backend where it cannot run: a CPU, or a CUDA machine without Triton.

It is chosen by name only (never by `auto`), so asking for it where it cannot run must stop with one line that
says why, on the training side (Fp8Linear) and the rollout side (`resolve_backend(..., role="rollout")`, what
the vLLM method calls) alike; no silent fallback to another GEMM.
"""

from __future__ import annotations

import sys

import pytest
import torch

from precision_testutil import outlier_data
from jetrl_precision import convert_to_fp8, get_recipe
from jetrl_precision.gemm import BackendUnavailable, available_backends, resolve_backend
from jetrl_precision.gemm import _triton_common, dispatch
from jetrl_precision.gemm import triton_invariant_backend as tib

NAME = "triton_invariant"


@pytest.mark.parametrize("role", ["train", "rollout"])
def test_refused_on_cpu_with_the_reason(role):
    assert available_backends("cpu")[NAME] == "needs a CUDA device, got cpu"
    with pytest.raises(BackendUnavailable, match=rf"'{NAME}' cannot run on cpu: needs a CUDA device, got cpu\. Use"):
        resolve_backend(NAME, "cpu", role=role)


def test_auto_never_picks_it():
    assert NAME not in dispatch.AUTO_ORDER_CUDA and NAME not in dispatch.AUTO_ORDER_CUDA_ROLLOUT
    assert resolve_backend("auto", "cpu", role="rollout") == "emulated"


def test_cuda_without_triton_names_triton_and_warns_once(monkeypatch, caplog):
    """On a CUDA machine whose Python has no (working) Triton the reason names it, not a later ImportError, and
    the log says so once however often the backend is asked about."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setattr(_triton_common, "_warned", set())
    with caplog.at_level("WARNING", logger=_triton_common.__name__):
        reasons = {tib.unavailable_reason(torch.device("cuda")) for _ in range(3)}
    (reason,) = reasons
    assert reason.startswith("triton is not importable") and "pip install triton" in reason
    assert [r.getMessage() for r in caplog.records] == [f"jetrl_precision GEMM: {NAME} cannot run: {reason}"]


def test_a_recipe_asking_for_it_stops_the_forward_in_one_line():
    recipe = get_recipe("jet_fp8").replace(gemm_backend=NAME)
    model = convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False)), recipe)
    with pytest.raises(BackendUnavailable, match=rf"GEMM backend '{NAME}' cannot run on cpu"):
        model(outlier_data((4, 256)))


def test_it_refuses_other_block_shapes_before_launching():
    from jetrl_precision import quantize_fp8

    a = quantize_fp8(outlier_data((4, 256)), (1, 256))
    b = quantize_fp8(outlier_data((128, 256)), (128, 128))
    with pytest.raises(ValueError, match="supports A 1x128 x B 128x128 or 1x128 along K; got A \\(1, 256\\)"):
        tib.triton_invariant_gemm_nt(a, b, torch.bfloat16)
