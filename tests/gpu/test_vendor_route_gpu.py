"""The triton_invariant backend's route to cuBLASLt (`JETRL_INVARIANT_VENDOR_GEMM=probe`) on a GPU.

For the Llama-3.1-8B and SmolLM2-135M projections (FP8, against cuBLASLt) and lm_heads (BF16, against F.linear):
the probe's verdict per shape (which shapes pass is the
library's behaviour, recorded, not asserted), and, for every shape that passed, the routed backend's output has the
invariant kernel's bits at M the probe never ran (odd batch sizes, a prefill-sized and a training-sized M). JETRL_RESULTS_DIR, if set, receives the verdicts as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision import quantize_fp8
from jetrl_precision.gemm import available_backends, vendor_route
from jetrl_precision.gemm.triton_invariant_backend import invariant_kernel_gemm_nt, triton_invariant_gemm_nt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

SHAPES = {"8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336),
          "smol_qkv": (960, 576), "smol_o": (576, 576), "smol_gate_up": (3072, 576), "smol_down": (576, 1536)}
LM_HEADS = {"8b_lm_head": (128256, 4096), "smol_lm_head": (49152, 576)}
UNPROBED_M = (130, 300, 777, 2500, 6007)  # at or above ROUTE_MIN_M (smaller batches are never routed)


@pytest.fixture(scope="module")
def verdicts(monkeypatch_module):
    avail = available_backends("cuda")
    for need in ("triton_invariant", "torch"):
        if avail[need] is not None:
            pytest.skip(f"{need}: {avail[need]}")
    monkeypatch_module.setenv(vendor_route.VENDOR_ROUTE_ENV, "probe")
    vendor_route.reset()
    # the M the route itself probes (an 8B lm_head stops at 4096 rows: 1 GiB of output)
    out = {name: vendor_route.probe_shape(n, k, device="cuda", ms=vendor_route._ms_for(n)) for name, (n, k) in SHAPES.items()}
    out |= {name: vendor_route.probe_linear_shape(n, k, device="cuda", ms=vendor_route._ms_for(n))
            for name, (n, k) in LM_HEADS.items()}
    if os.environ.get("JETRL_RESULTS_DIR"):
        path = Path(os.environ["JETRL_RESULTS_DIR"]) / "vendor_route.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "cuda": torch.version.cuda, "probe_ms": list(vendor_route.PROBE_MS),
                                    "shapes": {k: {"n": v.n, "k": v.k, "passed": v.passed, "first_difference":
                                                   v.first_difference, "seconds": v.seconds} for k, v in out.items()}},
                                   indent=1))
    for name, v in out.items():
        print(f"{name} [{v.n} x {v.k}]: {'cuBLASLt = invariant bits at every probed M' if v.passed else f'differs {v.first_difference}'}"
              f" ({v.seconds} s)")
    yield out
    vendor_route.reset()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_routed_shape_keeps_the_invariant_bits_at_unprobed_m(verdicts, name):
    n, k = SHAPES[name]
    if not verdicts[name].passed:
        pytest.skip(f"the probe kept {name} on the invariant kernel: {verdicts[name].first_difference}")
    w = quantize_fp8(outlier_data(n, k, seed=1) * 0.02, (128, 128))
    x = outlier_data(max(UNPROBED_M), k, seed=2)
    for m in UNPROBED_M:
        a = quantize_fp8(x[:m].contiguous(), (1, 128))
        routed = triton_invariant_gemm_nt(a, w, torch.bfloat16)
        kernel = invariant_kernel_gemm_nt(a, w, torch.bfloat16)
        assert vendor_route.routed(a, w, torch.bfloat16)
        diff = int((routed.view(torch.int16) != kernel.view(torch.int16)).sum())
        assert diff == 0, f"{name} M={m}: cuBLASLt differs from the invariant kernel in {diff} elements off the probed M"


@pytest.mark.parametrize("name", sorted(LM_HEADS))
def test_a_routed_lm_head_keeps_the_invariant_bits_at_unprobed_m(verdicts, name):
    n, k = LM_HEADS[name]
    if not verdicts[name].passed:
        pytest.skip(f"the probe kept {name} on the invariant kernel: {verdicts[name].first_difference}")
    from jetrl_precision.kernels.invariant_gemm import bf16_gemm_nt_invariant, linear_invariant

    w = outlier_data(n, k, seed=3) * 0.02
    x = outlier_data(2500, k, seed=4)
    for m in (130, 300, 777, 2500):
        assert vendor_route.routed_linear(w, torch.bfloat16, m)
        routed, kernel = linear_invariant(x[:m], w), bf16_gemm_nt_invariant(x[:m], w, torch.bfloat16)
        diff = int((routed.view(torch.int16) != kernel.view(torch.int16)).sum())
        assert diff == 0, f"{name} M={m}: F.linear differs from the invariant kernel in {diff} elements off the probed M"
