"""`--profile.step` on a GPU: kernel times read from the profiler's raw events equal torch's own tables."""

from __future__ import annotations

import pytest
import torch

from gpu_testutil import requires_cuda_reason

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)


def test_raw_kernel_times_equal_key_averages():
    from torch.profiler import ProfilerActivity, profile

    from openrlhf.utils.profiling import _device_times_raw, profiler_activities

    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    with profile(activities=profiler_activities(cuda=True, trace=False)) as prof:
        for _ in range(20):
            a = torch.tanh(a @ a.T / 1024)
        b = a.clone()
        b.zero_()
        torch.cuda.synchronize()
    raw = _device_times_raw(prof)
    assert raw is not None and profiler_activities(cuda=True, trace=False) == [ProfilerActivity.CUDA]
    ref: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0.0)
        if us and "CUDA" in str(ev.device_type):
            ref[ev.key] = ref.get(ev.key, 0.0) + us
    assert set(raw) == set(ref), (sorted(raw), sorted(ref))
    for k in ref:
        assert raw[k] == pytest.approx(ref[k], rel=1e-3, abs=1.0), k
    assert any("gemm" in k.lower() or "nvjet" in k or "cutlass" in k for k in raw)
