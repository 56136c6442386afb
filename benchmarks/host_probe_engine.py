"""Host cost of the pieces of one eager FP8 engine linear call (`EngineLinear`), against F.linear.

    python benchmarks/host_probe_engine.py
    PROBE_QUICK=1 python benchmarks/host_probe_engine.py   # F.linear against the eager engine's call, Python and native

The GPU is held busy by a spin kernel while the calls are enqueued, so each figure is the Python +
launch time alone (what an eager decode step pays per layer), whatever the call's GPU time.

Where vLLM is importable it also probes vLLM's C++ per-token-group quantizer as a candidate for the eager
engine's activation quantizer: whether its bytes and scales equal the reference quantizer's (random rows with
outliers, M not a multiple of 4 included, written into the MN-major M-padded layout cuBLASLt reads), and its
host time called through the op directly and through vLLM's Python wrapper.

The engine's activation quantizer is the CUDA kernel of `kernels.quant_cuda` where it passes its first-use check;
the probe times it beside the Triton kernel (host time, and GPU time per call at decode and prefill sizes), the
GEMM as `torch._scaled_mm`, as a cuBLASLt plan (`gemm.cublaslt`) and as `cublasLtMatmul` alone (everything made once,
output preallocated), the whole EngineLinear call with either quantizer, either GEMM, with and without its activation
workspace (JETRL_ENGINE_WORKSPACE), and the one-launch FP8 linear (`kernels.quant_gemm`; host and GPU time, the
four 8B projections), and ends with a torch.profiler table of EngineLinear calls by self CPU time. The pieces take
turns sample by sample (`paired_us`; PROBE_SAMPLES, default 25): each gets its minimum and median over the samples,
so a drifting host weighs on all alike.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jetrl_precision import quantize_fp8  # noqa: E402
from jetrl_precision.gemm import cublaslt, resolve_backend, torch_backend  # noqa: E402
from jetrl_precision.kernels import quant  # noqa: E402
from jetrl_precision.kernels.layout import row_major_padded_t  # noqa: E402


def host_us(fn, reps: int = 100) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU spin: the calls below only queue behind it
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(times), 1)


def paired_us(pieces: dict, samples: int = 25, reps: int = 50) -> dict[str, tuple[float, float]]:
    """{name: (min, median)} host us per call, the pieces taking turns sample by sample (each sample `reps` calls
    queued behind a spin kernel), so a drifting or noisy host weighs on every piece alike; the minimum is the
    least-disturbed figure, the median the typical one."""
    for fn in pieces.values():
        for _ in range(10):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in pieces}
    names = list(pieces)
    for i in range(samples):
        for name in names[i % len(names):] + names[: i % len(names)]:  # rotate the order: no piece always follows another
            fn = pieces[name]
            torch.cuda._sleep(40_000_000)
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append((time.perf_counter() - t0) / reps * 1e6)
            torch.cuda.synchronize()
    return {n: (round(min(v), 1), round(statistics.median(v), 1)) for n, v in times.items()}


def _vllm_quantizer_probe(k: int) -> None:
    try:
        import vllm._custom_ops  # noqa: F401 - registers torch.ops._C
        op = torch.ops._C.per_token_group_fp8_quant
    except Exception as e:  # noqa: BLE001 - optional
        print("vllm quantizer: unavailable:", type(e).__name__, str(e)[:160])
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 3, 64, 200, 256, 2048):
        mp = -(-m // 4) * 4
        x = torch.randn(m, k, device="cuda", generator=gen) * torch.exp(2 * torch.randn(m, 1, device="cuda", generator=gen))
        x[torch.rand(m, k, device="cuda", generator=gen) < 1e-3] *= 300.0  # outliers inside groups
        x = x.to(torch.bfloat16)
        ref = quantize_fp8(x, (1, 128))
        q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty_strided((m, k // 128), (1, mp), dtype=torch.float32, device="cuda")
        op(x, q, s, 128, 1e-10, -448.0, 448.0, False, True, True)
        same_q = torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8))
        same_s = torch.equal(s, ref.scale)
        diff = int((q.view(torch.uint8) != ref.data.view(torch.uint8)).sum())
        print(f"vllm quantizer M={m}: bytes equal {same_q} ({diff} differ), scales equal {same_s}")
    m, mp = 64, 64
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty_strided((m, k // 128), (1, mp), dtype=torch.float32, device="cuda")
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    pieces = {
        "vllm op, outputs preallocated": lambda: op(x, q, s, 128, 1e-10, -448.0, 448.0, False, True, True),
        "vllm op with its two allocations": lambda: op(
            x, torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda"),
            torch.empty_strided((m, k // 128), (1, mp), dtype=torch.float32, device="cuda"),
            128, 1e-10, -448.0, 448.0, False, True, True),
        "vllm per_token_group_quant_fp8 (Python wrapper)": lambda: per_token_group_quant_fp8(
            x, 128, column_major_scales=True, tma_aligned_scales=True, use_ue8m0=False),
    }
    for name, fn in pieces.items():
        print(name, host_us(fn))


def gpu_us(fn, reps: int = 200) -> float:
    """GPU time per call: CUDA events around `reps` calls queued behind a spin kernel, so the GPU runs them back to
    back and the host's launch time does not show."""
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1e3 / reps, 2)


def _quantizer_gpu_times(k: int) -> None:
    from jetrl_precision.kernels import quant_cuda

    cq = quant_cuda.quantizer_1x128("cuda", False, torch.bfloat16)
    if cq is None:
        print("cuda quantizer: unavailable:", quant_cuda.status("cuda"))
        return
    for m in (1, 64, 256, 2048, 8192):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        print(f"GPU us per 1x128 quantize M={m} K={k}: triton {gpu_us(lambda: quant.quantize_1x128(x, False))}, "
              f"cuda {gpu_us(lambda: cq(x))}")


def _fused_gpu_times() -> None:
    """GPU time per call of the one-launch FP8 linear against the engine's two-launch call and F.linear, for the four
    Llama-3.1-8B projections at decode sizes (the fused kernel's price for its host saving)."""
    from jetrl_precision import get_recipe
    from jetrl_precision.integrations.engine_linear import EngineLinear
    from jetrl_precision.kernels.quant_gemm import fp8_linear_invariant

    spec = get_recipe("jet_fp8").rollout.input
    for name, (n, k) in {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq = quantize_fp8(w, (128, 128))
        lin = EngineLinear(wq.data, wq.scale, [(n, n // 128, 128)], 128, spec, "torch")
        for m in (1, 16, 64, 128, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            print(f"GPU us {name} M={m}: F.linear {gpu_us(lambda: F.linear(x, w))}, engine 2-launch {gpu_us(lambda: lin(x))}, "
                  f"fused 1-launch {gpu_us(lambda: fp8_linear_invariant(x, wq.data, wq.scale, 128))}")


def main() -> None:
    import triton

    from jetrl_precision import get_recipe
    from jetrl_precision.integrations.engine_linear import EngineLinear, activation_quantizer
    from jetrl_precision.kernels import quant_cuda

    resolve_backend("torch", "cuda")
    mm = torch_backend.prepared_scaled_mm("cuda")
    k, n, m = 4096, 4096, 64
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    wq = quantize_fp8(w, (128, 128))
    wt, sb = wq.data.t(), row_major_padded_t(wq.scale)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq = quant.quantize_1x128(x, False)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(k // 128, m, device="cuda")
    kern = quant._quant_1x128_kernel
    spec = get_recipe("jet_fp8").train_fprop.input
    lin = EngineLinear(wq.data, wq.scale, [(n, n // 128, 128)], 128, spec, "torch")
    lin_t = EngineLinear(wq.data, wq.scale, [(n, n // 128, 128)], 128, spec, "torch")
    triton_fn = lambda t, rows_alloc=None: quant.quantize_1x128(t, False, rows_alloc=rows_alloc)  # noqa: E731
    cq = quant_cuda.quantizer_1x128("cuda", False, torch.bfloat16)
    print("engine activation quantizer:", activation_quantizer(x.device, False, torch.bfloat16)[1], "| quant_cuda status:",
          quant_cuda.status("cuda"), "| plan:", type(lin._fast).__name__, "| prepared GEMM:", type(mm).__name__,
          "| cuBLASLt plans:", cublaslt.unavailable_reason("cuda") or cublaslt._reasons.get(("cuda:0", "1x128", "128x128"), "usable"))
    if lin_t._fast:
        lin_t._fast._quantizers[torch.bfloat16] = triton_fn
    legacy_mm = lambda a, b_t, sa, sb_, od: torch._scaled_mm(a, b_t, scale_a=sa, scale_b=sb_, out_dtype=od)  # noqa: E731
    lin_s = EngineLinear(wq.data, wq.scale, [(n, n // 128, 128)], 128, spec, "torch")
    if lin_s._fast:
        lin_s._fast.mm = legacy_mm  # the engine call as it was before the cuBLASLt plans
    plan = lin._fast
    pieces = {
        "F.linear": lambda: F.linear(x, w),
        "torch.empty x2": lambda: (torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(k // 128, m, device="cuda")),
        "x.clone (1 launch)": lambda: x.clone(),
        "triton launch only": lambda: kern[(4, 32)](x, q, s, m, k, x.stride(0), x.stride(1), q.stride(0), q.stride(1),
                                                     s.stride(0), s.stride(1), BLOCK_R=16, POW2=False, num_warps=4),
        "quantize_1x128 (triton)": lambda: quant.quantize_1x128(x, False),
        "quantize_1x128 (triton) rows_alloc=64": lambda: quant.quantize_1x128(x, False, rows_alloc=m),
        "scaled_mm (prepared)": lambda: mm(xq.data, wt, xq.scale, sb, torch.bfloat16),
        "torch._scaled_mm direct": lambda: torch._scaled_mm(xq.data, wt, scale_a=xq.scale, scale_b=sb, out_dtype=torch.bfloat16),
        "triton quantize + scaled_mm, inline": lambda: (lambda t: mm(t.data, wt, t.scale, sb, torch.bfloat16))(quant.quantize_1x128(x, False, rows_alloc=m)),
        "EngineLinear, triton quantizer": lambda: lin_t(x),
        "EngineLinear, torch._scaled_mm GEMM": lambda: lin_s(x),
        "EngineLinear (the eager engine's call)": lambda: lin(x),
    }
    if plan:
        pieces["EngineLinear plan call"] = lambda: plan(x)
    lt = cublaslt.blockwise_gemm("cuda", "1x128", "128x128") or cublaslt.LtBlockwiseGemm(torch.device("cuda"), "1x128", "128x128")
    if lt is not None:
        pieces["cuBLASLt plan call (gemm.cublaslt)"] = lambda: lt(xq.data, wt, xq.scale, sb, torch.bfloat16)
        lt(xq.data, wt, xq.scale, sb, torch.bfloat16)
        plan_ = lt._plans[(m, n, k, torch.bfloat16)]
        y_pre = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        ptrs = (wt.data_ptr(), xq.data.data_ptr(), y_pre.data_ptr())
        stream_ = torch.cuda.current_stream().cuda_stream
        ws_ = lt._ws_ptrs.get(stream_) or lt._workspace(stream_)
        la, lb, lc, ld = plan_.layouts
        raw = lt.lib.cublasLtMatmul
        # The library call alone: descriptors made, scale pointers set once, output preallocated, no torch in between.
        pieces["cublasLtMatmul alone (ctypes)"] = lambda: raw(lt.handle, plan_.desc, lt._alpha_addr, ptrs[0], la, ptrs[1], lb,
                                                              lt._beta_addr, ptrs[2], lc, ptrs[2], ld, plan_.algo, ws_, lt.ws_bytes, stream_)
    from jetrl_precision.integrations import engine_linear

    def no_workspace():
        engine_linear._USE_WS = False
        try:
            return lin(x)
        finally:
            engine_linear._USE_WS = True

    pieces["EngineLinear, no activation workspace"] = no_workspace
    if lt is not None:
        lin_lt = EngineLinear(wq.data, wq.scale, [(n, n // 128, 128)], 128, spec, "torch")
        if lin_lt._fast:
            lin_lt._fast.mm = lt
            pieces["EngineLinear, cuBLASLt plan GEMM"] = lambda: lin_lt(x)
    from jetrl_precision.kernels.quant_gemm import fp8_linear_invariant

    pieces["fp8_linear_invariant (one launch)"] = lambda: fp8_linear_invariant(x, wq.data, wq.scale, 128)
    from jetrl_precision.integrations import vllm_cutlass

    cut_why = vllm_cutlass.unusable_reason("cuda")
    print("vllm cutlass decode GEMM:", cut_why or "usable")
    if not cut_why:
        cut = vllm_cutlass.decode_gemm("cuda")
        wst = wq.scale.t()
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        lin_c = EngineLinear(wq.data, wq.scale, [(n, n // 128, 128)], 128, spec, "torch", "vllm_cutlass", 512)
        pieces["vllm cutlass_scaled_mm op, output preallocated"] = lambda: cut(out, xq.data, xq.scale, wt, wst)
        pieces["EngineLinear, cuda quantizer + cutlass decode"] = lambda: lin_c(x)
    if cq is not None:
        pieces["cuda quantizer (quant_cuda)"] = lambda: cq(x, m)
        pieces["cuda quantize + scaled_mm, inline"] = lambda: (lambda t: mm(t.data, wt, t.scale, sb, torch.bfloat16))(cq(x, m))
    from jetrl_precision.integrations import engine_native

    lin_n = EngineLinear(wq.data, wq.scale, [(n, n // 128, 128)], 128, spec, "torch", native=True)
    print("native engine linear:", engine_native.status("cuda"))
    if lin_n.host_call == "native":
        native_fn, stream_n = lin_n._native, torch.cuda.current_stream().cuda_stream
        pieces["EngineLinear, native (what an eager engine calls)"] = lambda: lin_n(x)
        pieces["native call alone (csrc/engine_linear.cpp)"] = lambda: native_fn(x, stream_n)
    import os

    quick = os.environ.get("PROBE_QUICK") == "1"  # the eager engine's call against F.linear only, no GPU-time tables
    if quick:
        keep = ("F.linear", "torch._scaled_mm direct", "EngineLinear (the eager engine's call)",
                "EngineLinear, native (what an eager engine calls)", "native call alone (csrc/engine_linear.cpp)")
        pieces = {k_: v for k_, v in pieces.items() if k_ in keep}
    for name, (lo, med) in paired_us(pieces, samples=int(os.environ.get("PROBE_SAMPLES", "25"))).items():
        print(f"[host us min/median] {name} {lo} / {med}")
    if quick:
        return
    print("triton", triton.__version__)
    _quantizer_gpu_times(k)
    _fused_gpu_times()
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            lin(x)
    torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    _vllm_quantizer_probe(k)


if __name__ == "__main__":
    main()
