"""openrlhf/utils/telemetry.py on a GPU: NVML finds the GPU torch computes on (by UUID) and reads its clock, power and
load while work runs; a process that sees only another GPU (CUDA_VISIBLE_DEVICES) still reads its own."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from openrlhf.utils import telemetry


def test_reads_the_gpu_while_it_works():
    nv = telemetry.nvml()
    assert nv is not None, "neither pynvml nor vLLM's copy imports, or NVML failed to start"
    lib, handle = nv
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = lib.nvmlDeviceGetUUID(handle)
    assert str(props.uuid) in (uuid.decode() if isinstance(uuid, bytes) else uuid)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with telemetry.Telemetry(period_s=0.02) as t:
        for _ in range(600):  # about a second of 8192^3 GEMMs at full load (about 1.6-2 ms each on an H200 or H100)
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    s = t.summary()
    assert s["samples"] >= 10 and s["sm_mhz_mean"] > 500 and s["watts_mean"] > 50 and s["gpu_util_mean"] > 50, s
    m = t.metrics("perf/generate_")
    assert {"perf/generate_sm_mhz", "perf/generate_gpu_watts", "perf/generate_host_cpu_share"} <= set(m)


def test_a_process_given_another_gpu_index_reads_that_gpu():
    """CUDA_VISIBLE_DEVICES=<last GPU>: torch calls it device 0, NVML by UUID must name the same board."""
    n = torch.cuda.device_count()
    code = ("import torch; from openrlhf.utils import telemetry; lib, h = telemetry.nvml(); "
            "u = lib.nvmlDeviceGetUUID(h); u = u.decode() if isinstance(u, bytes) else u; "
            "print(str(torch.cuda.get_device_properties(0).uuid) in u)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(n - 1)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("True"), out.stdout + out.stderr
