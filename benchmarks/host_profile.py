"""Where an eager Fp8Linear training step spends host (CPU) time, on a GPU.

An o_proj-sized step at M=8192 does less GPU work than its eager host time (docs/benchmarks.md), and a fwd+bwd at
M=64 costs several times nn.Linear's host time, more than the sum of its launches.
This script separates the candidates:
- warm host time per step (steps back to back, timed before the closing sync, so the wall time is enqueue
  cost while the launch queue has room) for nn.Linear and Fp8Linear, at M=64 and M=8192, with the autograd
  engine's device threads on and off; and a cold single step (after a sync and a sleep kernel);
- fwd alone (graph built), and backward through torch.autograd.grad (no AccumulateGrad);
- a torch.profiler CPU table of a few steps: which ops, CUDA runtime calls (cudaMalloc, synchronizations)
  and Python functions take the time.

- `--probe`: which kind of work in a Python backward gets slower on the autograd engine's device thread (pure
  Python, aten calls, a Triton launch, a cuBLASLt scaled_mm), each timed with the engine threads on and off.

  python3 benchmarks/host_profile.py [--backend auto] [--m 64,8192] [--probe]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jetrl_precision import Fp8Linear, get_recipe  # noqa: E402


def host_ms(step, n=9):
    """One step timed after a sync and a long sleep kernel: a *cold* host, well above the warm figure even for
    nn.Linear. Kept to show that penalty; `loop_us` is the steady-state cost."""
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time: the host never waits on the GPU below
        t0 = time.perf_counter()
        step()
        ts.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return sorted(ts)[n // 2]


def _timed_calls_us(step, n):
    """Host time per call in us of n calls back to back, timed before the closing sync."""
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def loop_us(step, n=100, warmup=5):
    """Warm host (enqueue) time per call in us: n calls back to back, timed before the closing sync.

    The host never waits on the GPU while it is the faster of the two and n calls' launches fit in the launch
    queue (~1024 entries; an Fp8Linear fwd+bwd launches about 12 kernels).
    """
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    return _timed_calls_us(step, n)


def busy_us(step, n=20):
    """Pure host time per call in us: n calls enqueued behind a long sleep kernel, so the host never waits on
    the GPU (n x launches per call stays far below the launch queue's ~1024 entries)."""
    step()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~200 ms of GPU time
    return _timed_calls_us(step, n)


def engine_thread_probe() -> None:
    """Backward bodies of one kind of work each, timed with the autograd engine's device threads on and off.

    An Fp8Linear fwd+bwd can be cheaper with the threads off on some hosts (much more so than nn.Linear);
    the row whose work slows down on the device thread names the cause.
    """
    from jetrl_precision.gemm import gemm_nt
    from jetrl_precision.kernels import quant

    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    wq = quant.quantize_128x128(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16))[0]

    def py_work(t):
        acc = 0
        for i in range(2000):
            acc += i * i
        return t

    def aten_views(t):
        for _ in range(20):
            t = t.view(-1).view(64, 4096)
        return t

    def one_launch(t):
        return t * 2

    def triton_launch(t):
        quant.quantize_1x128(t)
        return t

    def scaled_mm(t):
        gemm_nt(quant.quantize_1x128(t), wq, torch.bfloat16, "torch")
        return t

    bodies = {"identity": lambda t: t, "pure Python (2000-step loop)": py_work, "20 aten view pairs": aten_views,
              "1 aten kernel (t * 2)": one_launch, "1 Triton launch (quantize_1x128)": triton_launch,
              "Triton + torch scaled_mm": scaled_mm}
    print("\n--- engine-thread probe: host us per fwd+bwd of an autograd.Function, M=64 ---")
    print(f"{'backward body':36s} {'threads on':>10s} {'off':>8s} {'on - off':>9s}")
    for name, body in bodies.items():

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.view_as(t)

            @staticmethod
            def backward(ctx, gy):
                return body(gy)

        step = lambda: Fn.apply(x).backward(g)  # noqa: E731
        on = busy_us(step)
        torch.autograd.set_multithreading_enabled(False)
        try:
            off = busy_us(step)
        finally:
            torch.autograd.set_multithreading_enabled(True)
        print(f"{name:36s} {on:10.1f} {off:8.1f} {on - off:9.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe", action="store_true", help="run only the engine-thread probe")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--m", default="64,8192")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    args = ap.parse_args()
    if args.probe:
        engine_thread_probe()
        return
    r = get_recipe("jet_fp8")
    lin = nn.Linear(args.k, args.n, bias=False, device="cuda", dtype=torch.bfloat16)
    f8 = Fp8Linear.from_linear(lin, r.train_fprop, r.train_backward, gemm_backend=args.backend)
    print(f"backend {f8.resolved_backend}, N={args.n} K={args.k}")
    for m in map(int, args.m.split(",")):
        xs = [torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(2)]
        dy = torch.randn(m, args.n, device="cuda", dtype=torch.bfloat16) * 1e-3
        for mod_name, mod in (("nn.Linear", lin), ("Fp8Linear", f8)):
            i = [0]

            def nxt():
                i[0] ^= 1
                return xs[i[0]]

            steps = {
                "fwd+bwd": lambda: mod(nxt()).backward(dy),
                "fwd (graph built)": lambda: mod(nxt()),
                "fwd+autograd.grad": lambda: torch.autograd.grad(mod(nxt()), [xs[i[0]], lin.weight], dy),
            }
            for name, step in steps.items():
                step()
                h = host_ms(step)
                lu = loop_us(step, n=20)
                print(f"M={m:5d} {mod_name:10s} {name:20s} cold step {h * 1e3:8.1f} us   warm loop {lu:8.1f} us/step")
            # Pure host time per step (enqueued behind a sleep kernel) with the autograd engine's device threads
            # on and off (off: the backward runs on this thread).
            step = steps["fwd+bwd"]
            on = busy_us(step)
            torch.autograd.set_multithreading_enabled(False)
            try:
                step()
                off = busy_us(step)
                print(f"M={m:5d} {mod_name:10s} {'fwd+bwd, no engine threads':20s} cold step {host_ms(step) * 1e3:8.1f} us")
            finally:
                torch.autograd.set_multithreading_enabled(True)
            print(f"M={m:5d} {mod_name:10s} host per fwd+bwd behind a sleep kernel: engine threads on {on:8.1f} us, off {off:8.1f} us")
        # cProfile of 100 Fp8Linear steps with the backward on this thread (cProfile sees one thread only).
        import cProfile
        import io
        import pstats

        step = lambda: f8(xs[0]).backward(dy)  # noqa: E731
        torch.autograd.set_multithreading_enabled(False)
        try:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(100):
                step()
            prof.disable()
            torch.cuda.synchronize()
        finally:
            torch.autograd.set_multithreading_enabled(True)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
        print(f"\n--- cProfile, 100 Fp8Linear fwd+bwd steps at M={m}, backward on the calling thread ---\n{buf.getvalue()}")
        # torch.profiler: CPU-side table of 5 Fp8Linear steps.
        from torch.profiler import ProfilerActivity, profile

        step = lambda: f8(xs[0]).backward(dy)  # noqa: E731
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(f"\n--- torch.profiler, 5 Fp8Linear fwd+bwd steps at M={m}, by self CPU time ---")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=32, max_name_column_width=60))
        del xs, dy


if __name__ == "__main__":
    main()
