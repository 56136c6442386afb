"""The timing harness every GPU benchmark section shares: records, do_bench medians, timing at the power cap
(a CUDA graph of back-to-back calls), and the benchmark's test data.

`RECORDS` collects what the sections measure (`rec`); `gpu_bench.py` writes them out. Triton is imported
where it is used, so this module (and the sections' CPU parts) import without it.
"""

from __future__ import annotations

import datetime
import functools
import time

import torch

__all__ = ["LAYERS", "MS", "DATE", "RECORDS", "COMMAND", "rec", "bench", "capture", "recover_from_failed_capture", "bench_sustained",
           "data", "rel_err", "set_command"]

LAYERS = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (64, 256, 4096, 8192, 16384)
DATE = datetime.datetime.now(datetime.timezone.utc).date().isoformat()  # the run's own date (UTC)
RECORDS: list[dict] = []
COMMAND = "PYTHONUNBUFFERED=1 python3 benchmarks/gpu_bench.py --out $OUT/gpu_bench.json"


def set_command(command: str) -> None:
    """The command line every later record carries."""
    global COMMAND
    COMMAND = command


def rec(name, shape, backend, value, unit, ratio=None, **extra):
    r = {"name": name, "shape": shape, "backend": backend, "value": value, "unit": unit,
         "ratio_vs_bf16": ratio, "command": COMMAND, "date": DATE}
    r.update(extra)
    RECORDS.append(r)
    return r


def bench(fn, rep=60, warmup=15, grad_to_none=None):
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")  # ms


@functools.cache
def _nvml():
    """(pynvml, a handle for the current GPU), or None (pynvml not installed)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - clocks are context for the figure, not the figure
        return None


def capture(fn, calls=1):
    """A CUDA graph of `calls` back-to-back calls of `fn`, warmed on a side stream first (as torch's docs do)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def recover_from_failed_capture(stream: torch.cuda.Stream) -> None:
    """Leave a failed CUDA-graph capture behind: `stream` current again and the CUDA generators out of capture mode.

    torch clears a capture's RNG bookkeeping only when the capture ends cleanly. After one that an illegal call
    invalidated, the default generators stay flagged as capturing, and every later CUDA random op in the process
    raises "Offset increment outside graph capture encountered unexpectedly" (a failed capture in the linear section
    once took the stack, reference, host and decode sections down with it), and the capture's side stream stays
    current. A small clean capture runs the generators' prologue and epilogue again, which clears the flag."""
    torch.cuda.set_stream(stream)
    torch.cuda.synchronize()
    scratch = torch.empty(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scratch.add_(1)
    del graph
    torch.randn(1, device="cuda")  # raises here, with the cause above, if the generators are still flagged


def bench_sustained(fn, per=20, warm_s=0.25, run_s=0.4):
    """(ms per call, {sm_mhz, watts}) at the steady state of a training step: `per` back-to-back calls in one
    CUDA graph, replayed for `warm_s` and then timed for `run_s`, while the host samples the SM clock and board
    power. Why not do_bench for the GEMMs: the H200 runs these GEMMs at its 700 W cap, so its clock depends on
    what ran just before. do_bench's gaps let whichever GEMM comes first after a pause run at the boost clock,
    well above the clock at the cap, which biases the ratio of the shape timed first."""
    fn()
    torch.cuda.synchronize()
    graph = capture(fn, per)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    one_s = max(start.elapsed_time(end) * 1e-3, 1e-6)
    for _ in range(max(1, int(warm_s / one_s))):
        graph.replay()
    n = max(3, int(run_s / one_s))
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    clocks, watts, nv = [], [], _nvml()
    while nv is not None and not end.query():  # the host is idle while the GPU works through the replays
        clocks.append(nv[0].nvmlDeviceGetClockInfo(nv[1], nv[0].NVML_CLOCK_SM))
        watts.append(nv[0].nvmlDeviceGetPowerUsage(nv[1]) / 1000)
        time.sleep(0.02)
    end.synchronize()
    del graph
    info = {"sm_mhz": round(sum(clocks) / len(clocks)) if clocks else None,
            "watts": round(sum(watts) / len(watts)) if watts else None}
    return start.elapsed_time(end) / (n * per), info


def data(m, k, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda") * torch.exp(0.5 * torch.randn(m, 1, generator=g, device="cuda"))
    x = torch.where(x == 0, torch.full_like(x, 1e-3), x)
    x = torch.where(torch.rand(m, k, generator=g, device="cuda") < 1e-4, x * 50, x)
    return (x * scale).to(dtype)


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())
