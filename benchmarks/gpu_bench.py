"""All GPU benchmarks of the FP8 path in one run; prints one table and writes JSON records.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_bench.py --out $OUT/gpu_bench.json

Sections (each guarded, so one failure does not lose the rest):
  env       GPU, clocks, software versions
  copy      device-to-device copy bandwidth (the memory ceiling)
  quant     every Triton quantizer: bandwidth vs copy, plus plain-torch reference quantizer
  gemm      TFLOP/s per backend at Llama-3.1-8B shapes x M, BF16 F.linear in the same run, correctness
  linear    FP8 linear fwd+bwd vs nn.Linear BF16 at M=8192, kernel breakdown, saved-activation bytes
  stack     4-layer Llama-3.1-8B-shaped decoder: fwd+bwd+AdamW step, tokens/s and peak memory
  decode    the same stack's forward at M=64 and 256 tokens (one position each), eager and CUDA graph
Timing: triton.testing.do_bench medians (L2 flushed before each repeat); ratios are within this run. The GEMM
section times each GEMM at the power cap instead (`bench_sustained`: a CUDA graph of back-to-back calls after a
warm-up, BF16 and FP8 alternating), with the SM clock and power beside each figure and do_bench's kept as
`flush_tflops`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import datetime
import json
import math
import os
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from jetrl_precision import Fp8Linear, convert_to_fp8, get_recipe, mark_weights_updated, ops  # noqa: E402
from jetrl_precision.gemm import available_backends, gemm_nt, resolve_backend  # noqa: E402
from jetrl_precision.gemm.deep_gemm_backend import deep_gemm_wgrad_1d1d  # noqa: E402
from jetrl_precision.kernels import cast_transpose, fused, quant  # noqa: E402
from jetrl_precision.kernels.layout import padding_events  # noqa: E402
from jetrl_precision.quantize import quantize_fp8  # noqa: E402
from jetrl_precision.swiglu import fuse_swiglu  # noqa: E402
from host_profile import loop_us  # noqa: E402  (benchmarks/ is on sys.path: these files run as scripts)

LAYERS = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (64, 256, 4096, 8192, 16384)
DATE = datetime.datetime.now(datetime.timezone.utc).date().isoformat()  # the run's own date (UTC)
BW = get_recipe("jet_fp8").train_backward
RECORDS: list[dict] = []
COMMAND = "PYTHONUNBUFFERED=1 python3 benchmarks/gpu_bench.py --out $OUT/gpu_bench.json"


def rec(name, shape, backend, value, unit, ratio=None, **extra):
    r = {"name": name, "shape": shape, "backend": backend, "value": value, "unit": unit,
         "ratio_vs_bf16": ratio, "command": COMMAND, "date": DATE}
    r.update(extra)
    RECORDS.append(r)
    return r


def bench(fn, rep=60, warmup=15, grad_to_none=None):
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


def _capture(fn, calls=1):
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


def bench_sustained(fn, per=20, warm_s=0.25, run_s=0.4):
    """(ms per call, {sm_mhz, watts}) at the steady state of a training step: `per` back-to-back calls in one
    CUDA graph, replayed for `warm_s` and then timed for `run_s`, while the host samples the SM clock and board
    power. Why not do_bench for the GEMMs: the H200 runs these GEMMs at its 700 W cap, so its clock depends on
    what ran just before. do_bench's gaps let whichever GEMM comes first after a pause run at the boost clock
    (session 8: 1980 MHz for a BF16 GEMM measured after idle vs ~1400 MHz at the cap), which biased the ratio at
    M = 4096 (session 3: 1.47x there, 1.56x geomean)."""
    fn()
    torch.cuda.synchronize()
    graph = _capture(fn, per)
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


# ---------------------------------------------------------------------------------------------
def section_env(args):
    p = torch.cuda.get_device_properties(0)
    info = {"gpu": p.name, "sms": p.multi_processor_count, "mem_gib": round(p.total_memory / 2**30, 1),
            "cc": f"{p.major}.{p.minor}", "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        info["cublaslt"] = torch._C._cuda_getCompiledVersion()
    except Exception:  # noqa: BLE001
        pass
    try:
        q = "name,driver_version,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu"
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = f"unavailable: {e}"
    info["backends"] = available_backends("cuda")
    info["auto"] = resolve_backend("auto", "cuda")
    info["quant_kernel"] = ops.kernel_name("cuda")
    # The torch backend's legacy torch._scaled_mm shortcut: what its probe decided, and why (the probe's own
    # problem replayed). Session 3 saw it on; session 4's machines turned it off.
    from jetrl_precision.gemm import torch_backend as tb

    info["torch_legacy_shortcut"] = dict(tb._legacy_same)
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        xp, wp = torch.randn(64, 256, generator=g).cuda(), torch.randn(256, 256, generator=g).cuda()
        aq, bq = quantize_fp8(xp, (1, 128)), quantize_fp8(wp, (128, 128))
        out = tb.torch_gemm_nt(aq, bq, torch.bfloat16)  # whichever entry point the probe chose
        legacy = torch._scaled_mm(aq.data, bq.data.t(), scale_a=tb.mn_major(aq.scale),
                                  scale_b=tb.row_major_padded_t(bq.scale), out_dtype=torch.bfloat16)
        info["torch_legacy_probe_problem"] = "bitwise equal" if torch.equal(out, legacy) else (
            f"different, rel err {rel_err(legacy, out):.2e}")
    except Exception as e:  # noqa: BLE001
        info["torch_legacy_probe_problem"] = f"legacy call raised {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    print("ENV", json.dumps(info, indent=1))
    return info


def section_copy(args):
    n = 2**29  # 1 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    bw = 2 * src.numel() * 2 / (t * 1e-3) / 1e12
    rec("d2d_copy_bandwidth", "1GiB bf16", "torch", round(bw, 3), "TB/s")
    print(f"copy: {bw:.2f} TB/s")
    del src, dst
    return bw


def section_quant(args, copy_bw):
    rows = []

    def one(name, shape, fn, nbytes, backend="triton"):
        fn()
        t = bench(fn)
        bw = nbytes / (t * 1e-3) / 1e12
        rows.append((name, shape, t * 1e3, bw, bw / copy_bw))
        rec(f"quant_{name}", shape, backend, round(bw, 3), "TB/s", None, time_us=round(t * 1e3, 2),
            frac_of_copy=round(bw / copy_bw, 3))

    for m, k in ((16384, 4096), (16384, 14336), (8192, 4096), (4096, 4096)):
        x = data(m, k, seed=1)
        shp = f"{m}x{k}"
        io = m * k * 2 + m * k + 4 * m * math.ceil(k / 128)
        one("1x128", shp, lambda: quant.quantize_1x128(x), io)
        if (m, k) == (16384, 4096):
            for br in (8, 16, 32, 64):
                one(f"1x128_blockr{br}", shp, lambda br=br: quant.quantize_1x128(x, block_r=br), io)
        one("128x1_transposed", shp, lambda: quant.quantize_128x1_t(x), io)
        # dY's two layouts from one read (what Fp8Linear's backward runs) against the two kernels apart.
        io_dual = m * k * 2 + 2 * m * k + 4 * m * math.ceil(k / 128) + 4 * k * math.ceil(m / 128)
        one("ops_quantize_dual", shp, lambda: ops.quantize_dual(x, BW.dgrad_grad_output, BW.wgrad_grad_output), io_dual)
        one("separate_1x128_then_128x1_T", shp, lambda: (quant.quantize_1x128(x), quant.quantize_128x1_t(x)), io_dual)
        if (m, k) == (16384, 4096):
            # Earlier defaults (session 1: 32 columns x 4 warps; session 4: 16 x 1, column blocks fastest) next to
            # today's; the full tile sweep is benchmarks/quant_sweep.py.
            for t in (quant.Tile128x1(32, 4, False), quant.Tile128x1(16, 1, True), quant.Tile128x1(16, 2, True)):
                one(f"128x1_transposed_blockc{t.block_c}_w{t.num_warps}{'_colfast' if t.col_fastest else ''}", shp,
                    lambda t=t: quant.quantize_128x1_t(x, tile=t), io)
        q1 = quant.quantize_1x128(x)
        io_rq = m * k * 2 + 4 * m * math.ceil(k / 128) + 4 * k * math.ceil(m / 128)
        # The default is the CUDA cast-transpose kernel (session 7); the Triton one stays as the fallback.
        one("requant_1x128_to_128x1_T", shp, lambda: quant.requantize_1x128_to_128x1(q1, True), io_rq,
            backend="cuda" if cast_transpose.usable(x.device) else "triton")
        one("requant_1x128_to_128x1_T_triton", shp, lambda: quant.requantize_1x128_to_128x1(q1, True, kernel="triton"), io_rq)
        if (m, k) == (16384, 4096):
            for t in (quant.Tile128x1(32, 4, False), quant.Tile128x1(16, 2, True), quant.Tile128x1(16, 2, False)):
                one(f"requant_T_blockc{t.block_c}_w{t.num_warps}{'_colfast' if t.col_fastest else ''}", shp,
                    lambda t=t: quant.requantize_1x128_to_128x1(q1, True, tile=t), io_rq)
        if (m, k) == (16384, 14336):
            # pow2 (UE8M0) scales have an exact reciprocal: no FMA corrections in the kernels (session 6).
            one("1x128_pow2", shp, lambda: quant.quantize_1x128(x, pow2_scale=True), io)
            one("128x1_transposed_pow2", shp, lambda: quant.quantize_128x1_t(x, pow2_scale=True), io)
            q1p = quant.quantize_1x128(x, pow2_scale=True)
            one("requant_1x128_to_128x1_T_pow2", shp, lambda: quant.requantize_1x128_to_128x1(q1p, True, pow2_scale=True), io_rq,
                backend="cuda" if cast_transpose.usable(x.device) else "triton")
            one("requant_1x128_to_128x1_T_pow2_triton", shp,
                lambda: quant.requantize_1x128_to_128x1(q1p, True, pow2_scale=True, kernel="triton"), io_rq)
            del q1p
        if (m, k) == (16384, 4096):
            one("torch_reference_1x128", shp, lambda: quantize_fp8(x, (1, 128), nonfinite="propagate"), io, backend="torch-ops")
        del x, q1
    for n, k in ((28672, 4096), (4096, 14336), (6144, 4096)):
        w = data(n, k, seed=2, scale=0.02)
        shp = f"{n}x{k}"
        io = n * k * 2 + n * k
        one("128x128", shp, lambda: quant.quantize_128x128(w), io)
        one("128x128_w8", shp, lambda: quant.quantize_128x128(w, num_warps=8), io)  # the default before session 5
        if (n, k) == (28672, 4096):
            one("128x128_pow2", shp, lambda: quant.quantize_128x128(w, pow2_scale=True), io)
        if (n, k) == (28672, 4096):
            one("128x128_T_only", shp, lambda: quant.quantize_128x128(w, write=False, write_t=True), io)
        one("128x128_plus_T", shp, lambda: quant.quantize_128x128(w, write_t=True), io + n * k)
        wq = quant.quantize_128x128(w)[0]
        one("torch_fp8_transpose_copy", shp, lambda: wq.t(), 2 * n * k, backend="torch-ops")
        one("triton_fp8_transpose", shp, lambda: quant.transpose_quantized(wq), 2 * n * k)
        if (n, k) == (28672, 4096):
            for blk, nw in ((32, 4), (64, 8), (128, 8)):
                one(f"triton_fp8_transpose_b{blk}_w{nw}", shp, lambda blk=blk, nw=nw: quant.transpose_quantized(wq, blk, nw), 2 * n * k)
        del w, wq
    for m, i in ((16384, 14336), (8192, 14336)):
        gu = data(m, 2 * i, seed=3)
        g, u = gu[:, :i], gu[:, i:]
        io = 2 * m * i * 2 + m * i + 4 * m * i // 128
        one("silu_mul_1x128", f"{m}x{i}", lambda: fused.silu_mul_quantize(g, u), io)
        one("torch_silu_mul_then_1x128", f"{m}x{i}", lambda: quant.quantize_1x128(F.silu(g) * u), io, backend="torch+triton")
        del gu, g, u
    for m, h in ((16384, 4096), (8192, 4096)):
        x = data(m, h, seed=4)
        w = torch.ones(h, device="cuda", dtype=torch.bfloat16)
        io = m * h * 2 + m * h + 4 * m * h // 128
        one("rmsnorm_1x128", f"{m}x{h}", lambda: fused.rmsnorm_quantize(x, w), io)
        del x
    print(f"\n{'quantizer':34s} {'shape':>12s} {'us':>8s} {'TB/s':>6s} {'%copy':>6s}")
    for name, shp, us, bw, fr in rows:
        print(f"{name:34s} {shp:>12s} {us:8.1f} {bw:6.2f} {100 * fr:5.0f}%")


def section_gemm(args):
    backends = [b for b in args.gemm_backends.split(",") if available_backends("cuda")[b] is None]
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for lname, (n, k) in LAYERS.items():
        w = data(n, k, seed=5, scale=0.02)
        wq = quant.quantize_128x128(w)[0]
        w_deq = None
        for m in MS:
            x = data(m, k, seed=6)
            xq = quant.quantize_1x128(x)
            flops = 2 * m * n * k
            fns = {"bf16": lambda: F.linear(x, w)}
            for b in backends:
                fns[b] = lambda b=b: gemm_nt(xq, wq, torch.bfloat16, b)
            # Two alternating rounds at the power cap, best of each; do_bench's figure kept beside it.
            best: dict[str, tuple[float, dict]] = {}
            for _ in range(2):
                for b, fn in fns.items():
                    try:
                        t, info = bench_sustained(fn)
                        info["timing"] = "sustained"
                    except Exception as e:  # noqa: BLE001 - a backend that cannot be captured is timed eagerly, and says so
                        print(f"  {b} M={m} {lname}: CUDA graph capture failed ({type(e).__name__}: {e}); do_bench instead")
                        t, info = bench(fn), {"timing": f"do_bench (capture failed: {type(e).__name__})"}
                    if b not in best or t < best[b][0]:
                        best[b] = (t, info)
            t_bf, info_bf = best["bf16"]
            tf_bf = flops / (t_bf * 1e-3) / 1e12
            flush_bf = flops / (bench(fns["bf16"]) * 1e-3) / 1e12
            rec("gemm_tflops", f"M={m} {lname} N={n} K={k}", "bf16", round(tf_bf, 1), "TFLOP/s", 1.0, time_us=round(t_bf * 1e3, 1),
                flush_tflops=round(flush_bf, 1), **info_bf)
            row = {"layer": lname, "M": m, "bf16": tf_bf}
            ref = None
            if m <= 8192:
                if w_deq is None:
                    w_deq = wq.dequantize(torch.float32)
                ref = xq.dequantize(torch.float32) @ w_deq.t()
            for b in backends:
                out = fns[b]()
                err = rel_err(out, ref) if ref is not None else None
                t, info = best[b]
                tf = flops / (t * 1e-3) / 1e12
                flush = flops / (bench(fns[b]) * 1e-3) / 1e12
                row[b] = tf
                row[b + "_err"] = err
                row[b + "_flush"] = flush / flush_bf
                rec("gemm_tflops", f"M={m} {lname} N={n} K={k}", b, round(tf, 1), "TFLOP/s", round(tf / tf_bf, 3),
                    time_us=round(t * 1e3, 1), rel_err_vs_fp32=None if err is None else float(f"{err:.3e}"),
                    flush_tflops=round(flush, 1), flush_ratio=round(flush / flush_bf, 3), **info)
            rows.append(row)
            del x, xq, ref
        del w, wq, w_deq
    torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    print(f"\n{'M':>6s} {'layer':8s} {'bf16':>6s} " + " ".join(f"{b:>16s}" for b in backends) + "   rel.err (fp32 ref)")
    for r in rows:
        cols = " ".join(f"{r[b]:7.0f} ({r[b] / r['bf16']:4.2f}x)" for b in backends)
        errs = " ".join("-" if r[b + "_err"] is None else f"{r[b + '_err']:.2e}" for b in backends)
        print(f"{r['M']:6d} {r['layer']:8s} {r['bf16']:6.0f} {cols}   {errs}")
    for b in backends:
        big = [r[b] / r["bf16"] for r in rows if r["M"] >= 4096]
        small = [r[b] / r["bf16"] for r in rows if r["M"] < 4096]
        gm = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
        big_flush = [r[b + "_flush"] for r in rows if r["M"] >= 4096]
        print(f"geomean {b}: M>=4096 {gm(big):.3f}x (min {min(big):.2f}, max {max(big):.2f}; do_bench's timing "
              f"{gm(big_flush):.3f}x); M<=256 {gm(small):.2f}x")
        rec("gemm_geomean_ratio_M_ge_4096", "12 shapes", b, round(gm(big), 3), "x", round(gm(big), 3),
            min=round(min(big), 3), max=round(max(big), 3), flush_geomean=round(gm(big_flush), 3))
        rec("gemm_geomean_ratio_decode", "M=64,256 (8 shapes)", b, round(gm(small), 3), "x", round(gm(small), 3))

    # Triton decode diagnostic: split-K and tile choice at M=64.
    from jetrl_precision.kernels.gemm import fp8_gemm_nt
    print("\ntriton decode M=64 (us): split_k x tile")
    for lname in ("o_proj", "down") if "triton" in backends else ():
        n, k = LAYERS[lname]
        xq = quant.quantize_1x128(data(64, k, seed=6))
        wq = quant.quantize_128x128(data(n, k, seed=5, scale=0.02))[0]
        line = f"  {lname}:"
        for split in (1, 2, 4, 8):
            for bm, bn, nw, ns in ((64, 64, 4, 4), (64, 128, 4, 4)):
                cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=nw, num_stages=ns)
                t = bench(lambda: fp8_gemm_nt(xq.data, xq.scale, wq.data, wq.scale, 128, torch.bfloat16, split_k=split, config=cfg))
                line += f" s{split}/{bm}x{bn}={t * 1e3:.0f}"
                rec("triton_decode_diag_us", f"M=64 {lname} split={split} tile={bm}x{bn}", "triton", round(t * 1e3, 1), "us")
        t = bench(lambda: fp8_gemm_nt(xq.data, xq.scale, wq.data, wq.scale, 128, torch.bfloat16))
        line += f" | auto={t * 1e3:.0f}"
        print(line)

    # WGrad recipe (1x128 x 1x128, fp32 out) at M = 8192 tokens: out [N, K] contracts over tokens.
    print("\nwgrad GEMM (1x128.1x128 -> fp32 / bf16), tokens=8192")
    for lname, (n, k) in LAYERS.items():
        m = 8192
        dy_t = quant.quantize_128x1_t(data(m, n, seed=7, scale=1e-3))
        x_t = quant.quantize_128x1_t(data(m, k, seed=8))
        flops = 2 * m * n * k
        dyb, xb = data(n, m, seed=9), data(k, m, seed=10)
        t_bf = bench(lambda: dyb @ xb.t())
        line = f"  {lname:8s} bf16 {flops / t_bf / 1e9:6.0f}"
        rec("wgrad_gemm_tflops", f"tokens={m} {lname} N={n} K={k}", "bf16", round(flops / t_bf / 1e9, 1), "TFLOP/s", 1.0)
        for b in backends:
            # fp32 output (a gradient-accumulation buffer) and bf16 (what Fp8Linear asks for: dW in the weight dtype).
            # The deep_gemm backend hands WGrad to cuBLASLt where that works; time its own 1D1D kernel here.
            fn = deep_gemm_wgrad_1d1d if b == "deep_gemm" else (lambda p, q, od, b=b: gemm_nt(p, q, od, b))
            for od in (torch.float32, torch.bfloat16):
                t = bench(lambda fn=fn, od=od: fn(dy_t, x_t, od))
                tf = flops / t / 1e9
                tag = "" if od == torch.float32 else " bf16-out"
                line += f" | {b}{tag} {tf:6.0f} ({tf / (flops / t_bf / 1e9):.2f}x)"
                rec("wgrad_gemm_tflops", f"tokens={m} {lname} N={n} K={k}{tag}", b, round(tf, 1), "TFLOP/s", round(t_bf / t, 3))
        print(line)
        del dy_t, x_t, dyb, xb


def section_host(args):
    """Host (CPU) time per call at decode size, where the GPU work is shorter than the Python around it."""
    from jetrl_precision.gemm import torch_backend as tb
    from jetrl_precision.kernels.layout import mn_major, row_major_padded_t

    def host_us(fn, n=300):
        return loop_us(fn, n, warmup=20)

    x = data(64, 4096, seed=16)
    w = data(4096, 4096, seed=17, scale=0.02)
    xq, wq = quant.quantize_1x128(x), quant.quantize_128x128(w)[0]
    xq_t = quant.quantize_128x1_t(data(4096, 64, seed=15))  # a WGrad-shaped 1x128 operand (64 x 4096)
    one, block = tb.scaling_types()
    sb = wq.scale.t() if wq.scale.is_contiguous() else torch.as_strided(wq.scale, (wq.scale.shape[1], wq.scale.shape[0]), (1, wq.scale.stride(0)))
    lin = nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    r = get_recipe("jet_fp8")
    f8 = Fp8Linear.from_linear(lin, r.train_fprop, r.train_backward)
    xs = [data(64, 4096, seed=18 + i) for i in range(2)]
    cyc = itertools.cycle(range(2))
    items = {
        "F.linear bf16": lambda: F.linear(x, w),
        "quantize_1x128 launch": lambda: quant.quantize_1x128(x),
        "F.scaled_mm direct": lambda: F.scaled_mm(xq.data, wq.data.t(), xq.scale, one, sb, block, output_dtype=torch.bfloat16),
        "torch._scaled_mm direct": lambda: torch._scaled_mm(xq.data, wq.data.t(), scale_a=xq.scale, scale_b=sb, out_dtype=torch.bfloat16),
        "gemm_nt torch": lambda: gemm_nt(xq, wq, torch.bfloat16, "torch"),
        "gemm_nt triton": lambda: gemm_nt(xq, wq, torch.bfloat16, "triton"),
        # The backward's launches, one by one (the fwd+bwd host time below is their sum plus autograd).
        "quantize_128x1_t launch": lambda: quant.quantize_128x1_t(x),
        "requantize_1x128_to_128x1 launch": lambda: quant.requantize_1x128_to_128x1(xq, True),
        "requantize_1x128_to_128x1 launch (triton)": lambda: quant.requantize_1x128_to_128x1(xq, True, kernel="triton"),
        "gemm_nt torch wgrad": lambda: gemm_nt(xq_t, xq_t, torch.bfloat16, "torch"),
    }
    if available_backends("cuda")["deep_gemm"] is None:
        items["gemm_nt deep_gemm"] = lambda: gemm_nt(xq, wq, torch.bfloat16, "deep_gemm")
    # Is the legacy torch._scaled_mm (7 us cheaper per call) the same computation for block scales?
    # Both recipes, at a decode and a training shape; bitwise equality or it is not a drop-in.
    for mm in (64, 4096):
        xa = data(mm, 4096, seed=19)
        xaq = quant.quantize_1x128(xa)
        for recipe_b, bq in (("128x128", wq), ("1x128", quant.quantize_1x128(w))):
            sa = mn_major(xaq.scale)
            sbb = row_major_padded_t(bq.scale) if recipe_b == "128x128" else mn_major(bq.scale)
            try:
                ref = F.scaled_mm(xaq.data, bq.data.t(), sa, one, sbb, block if recipe_b == "128x128" else one,
                                  output_dtype=torch.bfloat16)
                leg = torch._scaled_mm(xaq.data, bq.data.t(), scale_a=sa, scale_b=sbb, out_dtype=torch.bfloat16)
                same = bool(torch.equal(ref, leg))
                msg = "bitwise equal" if same else f"DIFFERENT (rel err {rel_err(leg, ref):.2e})"
            except Exception as e:  # noqa: BLE001
                same, msg = False, f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            print(f"  legacy torch._scaled_mm vs F.scaled_mm, M={mm} B {recipe_b}: {msg}")
            rec("legacy_scaled_mm_matches_scaled_mm", f"M={mm} K=N=4096 B {recipe_b}", "torch", int(same), "bool", note=msg)
    with torch.no_grad():
        items["nn.Linear fwd (no_grad)"] = lambda: lin(x)
        items["Fp8Linear fwd (no_grad)"] = lambda: f8(xs[next(cyc)])
        print("\nhost time per call (us), M=64 K=N=4096")
        for name, fn in items.items():
            try:
                us = host_us(fn)
            except Exception as e:  # noqa: BLE001
                print(f"  {name:28s} failed: {type(e).__name__}: {e}")
                continue
            print(f"  {name:28s} {us:7.1f}")
            rec("host_us_per_call", f"M=64 K=N=4096 {name}", "host", round(us, 1), "us")
    # A training step's host cost: fwd+bwd of one layer at decode size, where the GPU work is tiny. This is
    # the Python + launch time an eager o_proj step at M=8192 (~1 ms of GPU work) cannot hide.
    xg = [data(64, 4096, seed=20 + i).requires_grad_(True) for i in range(2)]
    dyg = data(64, 4096, seed=22)
    for name, fn in {"nn.Linear fwd+bwd": lambda: lin(xg[next(cyc)]).backward(dyg),
                     "Fp8Linear fwd+bwd": lambda: f8(xg[next(cyc)]).backward(dyg)}.items():
        us = host_us(fn, n=200)
        print(f"  {name:28s} {us:7.1f}")
        rec("host_us_per_call", f"M=64 K=N=4096 {name}", "host", round(us, 1), "us")
    with torch.no_grad():
        # Where the Fp8Linear host time goes (cProfile inflates the totals; the ranking is what matters).
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            f8(xs[next(cyc)])
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
        print(buf.getvalue())
    # The same for a training step (fwd+bwd): what an eager o_proj step at M=8192 has to hide.
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        f8(xg[next(cyc)]).backward(dyg)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(26)
    print("cProfile, 200 Fp8Linear fwd+bwd steps:\n" + buf.getvalue())


def _saved_bytes(fn, params=()):
    """Bytes autograd saves for backward, not counting parameters (F.linear saves an alias of W, not W)."""
    total = [0]
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        if not isinstance(t, nn.Parameter) and t.untyped_storage().data_ptr() not in param_ptrs:
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def section_linear(args):
    recipe = get_recipe("jet_fp8")
    fp, bw = recipe.train_fprop, recipe.train_backward
    m = 8192
    rows = []
    for lname, (n, k) in LAYERS.items():
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(data(n, k, seed=11, scale=0.02))
        # Two alternating input/grad pairs: a step never sees the tensors of the step before, as in
        # training, so the quantizers' sibling-sharing cache cannot skip work across iterations.
        xs = [data(m, k, seed=12 + i).requires_grad_(True) for i in range(2)]
        dys = [data(m, n, seed=13 + i, scale=1e-3) for i in range(2)]
        x, dy = xs[0], dys[0]
        cyc = itertools.cycle(range(2))

        def step_bf16():
            i = next(cyc)
            lin(xs[i]).backward(dys[i])

        t_bf = bench(step_bf16, grad_to_none=xs + [lin.weight], rep=150)
        _, saved_bf = _saved_bytes(lambda: lin(x), [lin.weight])
        h_bf = _host_ms(lambda: lin(xs[0]).backward(dys[0]), xs + [lin.weight])
        rec("linear_fwd_bwd_host_ms", f"M={m} {lname}", "bf16", round(h_bf, 4), "ms")
        res = {"layer": lname, "bf16_ms": t_bf, "bf16_graph": _graphed_step_ms(_linear_over, lin.weight, xs, dys)}
        rec("linear_fwd_bwd_ms", f"M={m} {lname}", "bf16", round(t_bf, 4), "ms", 1.0, saved_activation_bytes=saved_bf)
        rec("linear_fwd_bwd_ms", f"M={m} {lname} cuda-graph", "bf16", round(res["bf16_graph"], 4), "ms", 1.0)
        auto_name = resolve_backend("auto", "cuda")
        # auto first, then the other hardware backends present (torch stays in the table when auto is deep_gemm).
        backends = ["auto"] + [b for b in ("torch", "triton") if b != auto_name and available_backends("cuda")[b] is None]
        for backend in backends:
            layer = Fp8Linear.from_linear(lin, fp, bw, gemm_backend=backend)
            name = resolve_backend(backend, "cuda")
            layer(x).backward(dy)  # warm-up (autotune, weight cache)

            def step_cached():
                i = next(cyc)
                layer(xs[i]).backward(dys[i])

            def step_requant():
                mark_weights_updated()  # as after an optimizer step: W is re-quantized (and transposed)
                i = next(cyc)
                layer(xs[i]).backward(dys[i])

            t_c = bench(step_cached, grad_to_none=xs + [lin.weight], rep=150)
            t_r = bench(step_requant, grad_to_none=xs + [lin.weight], rep=150)
            if backend == "auto":
                # The same eager steps with the autograd engine on the calling thread (docs/performance.md, step
                # 6: a process-wide knob for host-bound runs), BF16 and FP8 alike.
                with torch.autograd.set_multithreading_enabled(False):
                    t_bf1 = bench(step_bf16, grad_to_none=xs + [lin.weight], rep=150)
                    t_c1 = bench(step_cached, grad_to_none=xs + [lin.weight], rep=150)
                res["bf16_1thread"], res["1thread"] = t_bf1, t_c1
                rec("linear_fwd_bwd_ms", f"M={m} {lname} engine-on-calling-thread", "bf16", round(t_bf1, 4), "ms", 1.0)
                rec("linear_fwd_bwd_ms", f"M={m} {lname} weight-cached engine-on-calling-thread", name, round(t_c1, 4), "ms",
                    round(t_bf1 / t_c1, 3))
            _, saved = _saved_bytes(lambda: layer(x), [lin.weight])
            h_c = _host_ms(step_cached, xs + [lin.weight])
            rec("linear_fwd_bwd_host_ms", f"M={m} {lname} weight-cached", name, round(h_c, 4), "ms")
            print(f"  {lname} {name}: host time per step {h_c:.3f} ms (bf16 {h_bf:.3f}), GPU step {t_c:.3f} ms")
            res[f"{name}_cached"] = t_c
            res[f"{name}_requant"] = t_r
            if backend == "auto":
                # Host time out of the picture: the same step captured once and replayed as a CUDA graph.
                t_g = _graphed_step_ms(lambda w: Fp8Linear.from_linear(_linear_over(w), fp, bw, gemm_backend=backend), lin.weight, xs, dys)
                res["graph"] = t_g
                rec("linear_fwd_bwd_ms", f"M={m} {lname} weight-cached cuda-graph", name, round(t_g, 4), "ms",
                    round(res["bf16_graph"] / t_g, 3))
            res[f"{name}_saved"] = saved
            rec("linear_fwd_bwd_ms", f"M={m} {lname} weight-cached", name, round(t_c, 4), "ms", round(t_bf / t_c, 3),
                saved_activation_bytes=saved, saved_vs_bf16=round(saved / saved_bf, 4))
            rec("linear_fwd_bwd_ms", f"M={m} {lname} weight-requantized", name, round(t_r, 4), "ms", round(t_bf / t_r, 3))
        # Kernel breakdown on the auto backend.
        name = resolve_backend("auto", "cuda")
        xd = x.detach()
        xq = ops.quantize(xd, fp.input)
        wq = ops.quantize(lin.weight.detach(), fp.weight)
        wqt = wq.t()
        dyq = ops.quantize(dy, bw.dgrad_grad_output)
        dyt = ops.quantize_transposed(dy, bw.wgrad_grad_output)
        xt = ops.requantize_transposed(xq, bw.wgrad_input)
        # The kernels one Fp8Linear fwd+bwd runs (weights cached): qx, fprop, qdy, dgrad, rqxT, wgrad.
        parts = {
            "qx": lambda: quant.quantize_1x128(xd),
            "qw": lambda: ops.quantize(lin.weight.detach(), fp.weight),
            "wT": lambda: quant.transpose_quantized(wq),
            "fprop": lambda: gemm_nt(xq, wq, torch.bfloat16, name),
            "qdy": lambda: ops.quantize_dual(dy, bw.dgrad_grad_output, bw.wgrad_grad_output),  # as the backward runs it
            "dgrad": lambda: gemm_nt(dyq, wqt, torch.bfloat16, name),
            "rqxT": lambda: quant.requantize_1x128_to_128x1(xq, True),
            "wgrad": lambda: gemm_nt(dyt, xt, torch.bfloat16, name),
            "wgrad_fp32_out": lambda: gemm_nt(dyt, xt, torch.float32, name),
        }
        br = {kname: bench(fn) for kname, fn in parts.items()}
        res["parts"] = br
        # What the GPU runs in one real step (kernel names and times), to account for the gap between
        # the step and the sum of its parts.
        # Alternating inputs, as in the timed steps: one reused input would hit the quantizers' share cache.
        auto_layer = Fp8Linear.from_linear(lin, fp, bw, gemm_backend="auto")
        prof_rows = _profile_kernels(lambda: (lambda i: auto_layer(xs[i]).backward(dys[i]))(next(cyc)), xs + [lin.weight])
        rec("linear_step_kernels_us", f"M={m} {lname} weight-cached", name, round(sum(us for _, us, _ in prof_rows), 1), "us",
            kernels=[{"name": kn[:90], "us_per_step": round(us, 1), "calls_per_step": c} for kn, us, c in prof_rows])
        print(f"  {lname}: GPU kernels of one step (us): " + "; ".join(f"{kn[:48]} x{c} {us:.0f}" for kn, us, c in prof_rows[:12]))
        gem = br["fprop"] + br["dgrad"] + br["wgrad"]
        res["kernels_sum"] = gem + br["qx"] + br["qdy"] + br["rqxT"]
        rec("linear_fp8_kernels_sum_ms", f"M={m} {lname} weight-cached", name, round(res["kernels_sum"], 4), "ms",
            round(t_bf / res["kernels_sum"], 3))
        res["gemm_only_ratio"] = t_bf / gem
        rec("linear_fp8_gemms_only_ms", f"M={m} {lname}", name, round(gem, 4), "ms", round(t_bf / gem, 3),
            breakdown_ms={kk: round(v, 4) for kk, v in br.items()})
        rows.append(res)
        del lin, x, dy, xs, dys, xq, wq, wqt, dyq, dyt, xt
    name = resolve_backend("auto", "cuda")
    others = [b for b in ("torch", "triton") if b != name and f"{b}_cached" in rows[0]]
    print(f"\nFP8 linear fwd+bwd, M={m} (ms; ratio = bf16/fp8; auto = {name})")
    print(f"{'layer':8s} {'bf16':>7s} {name + ' cached':>16s} {name + ' requant':>17s}"
          + "".join(f" {b + ' cached':>16s}" for b in others)
          + f" {'graph bf16':>10s} {'graph fp8':>16s} {'GEMMs only':>11s} {'saved B':>9s}")
    for r in rows:
        print(f"{r['layer']:8s} {r['bf16_ms']:7.3f} {r[name + '_cached']:8.3f} ({r['bf16_ms'] / r[name + '_cached']:4.2f}x)"
              f" {r[name + '_requant']:8.3f} ({r['bf16_ms'] / r[name + '_requant']:4.2f}x)"
              + "".join(f" {r[b + '_cached']:8.3f} ({r['bf16_ms'] / r[b + '_cached']:4.2f}x)" for b in others)
              + f" {r['bf16_graph']:10.3f} {r['graph']:8.3f} ({r['bf16_graph'] / r['graph']:4.2f}x) {r['gemm_only_ratio']:10.2f}x"
              f" {r[name + '_saved'] / 2**20:7.1f}MiB")
        print("          parts(us): " + " ".join(f"{kk}={v * 1e3:.0f}" for kk, v in r["parts"].items())
              + f"  sum={r['kernels_sum'] * 1e3:.0f} ({r['bf16_ms'] / r['kernels_sum']:.2f}x)")
    gm = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
    ratios = {key: [r["bf16_ms"] / r[key] for r in rows] for key in [name + "_cached", name + "_requant"] + [f"{b}_cached" for b in others]}
    ratios["graph"] = [r["bf16_graph"] / r["graph"] for r in rows]
    ratios["engine_on_calling_thread"] = [r["bf16_1thread"] / r["1thread"] for r in rows]
    ratios["kernels_sum"] = [r["bf16_ms"] / r["kernels_sum"] for r in rows]
    for key, v in ratios.items():
        v = [r for r in v if math.isfinite(r)]
        if not v:
            continue
        g = gm(v)
        print(f"geomean bf16/fp8 ({key}): {g:.3f}x")
        rec("linear_fwd_bwd_geomean_ratio", f"M={m} 4 layers {key}",
            name if key in ("graph", "kernels_sum", "engine_on_calling_thread") else key.rsplit("_", 1)[0],
            round(g, 3), "x", round(g, 3))


def _host_ms(step, params, n=20):
    """Warm host time per step in ms (see host_profile.loop_us). A single step timed after a sync and a sleep
    kernel, as session 4 first did, read 0.5-1 ms too high even for nn.Linear: a cold start, not launch cost."""
    for p in params:
        p.grad = None
    return loop_us(step, n, warmup=1) / 1e3


def _profile_kernels(step, params, steps=5):
    """[(kernel name, us per step, calls per step)] of `step`, from torch.profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            for p in params:
                p.grad = None
            step()
        torch.cuda.synchronize()
    out = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and ev.count:
            out.append((ev.key, t / steps, ev.count // steps))
    return sorted(out, key=lambda r: -r[1])


def _graphed_step_ms(build, weight, xs, dys):
    """fwd+bwd through `torch.cuda.make_graphed_callables` (one graph each way), in ms; NaN if capture fails.

    `build(w)` makes the module over a weight Parameter. The weight and input are fresh copies: leaves
    that went through eager backward passes keep an AccumulateGrad node bound to the default stream,
    and capture refuses to depend on that stream (cudaErrorStreamCaptureImplicit, seen on torch 2.11).
    The quantizers' share cache is off while capturing: the capture reuses the warm-up's input, and a
    cache hit would leave the x quantization out of the graph.
    """
    w = nn.Parameter(weight.detach().clone())
    x = xs[0].detach().clone().requires_grad_(True)
    dy = dys[0].clone()
    impl = ops._impl_for(torch.device("cuda"))
    share = getattr(impl, "share_results", None)
    if share is not None:
        impl.share_results = False
    try:
        graphed = torch.cuda.make_graphed_callables(build(w), (x,), num_warmup_iters=3)
        return bench(lambda: graphed(x).backward(dy), grad_to_none=[x, w], rep=150)
    except Exception as e:  # noqa: BLE001 - a failed capture must not lose the eager figures
        print(f"  CUDA-graph capture failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
        return float("nan")
    finally:
        if share is not None:
            impl.share_results = share


def _linear_over(w: nn.Parameter) -> nn.Linear:
    """An nn.Linear whose weight is `w` (no copy)."""
    with torch.device("meta"):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = w
    return lin


# ---------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, h, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rot(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attn(nn.Module):
    def __init__(self, h, nh, nkv):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, h // nh
        self.q_proj = nn.Linear(h, nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(nh * self.hd, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.nkv, self.hd).transpose(1, 2)
        q, k = q * cos + _rot(q) * sin, k * cos + _rot(k) * sin
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, h=4096, i=14336, nh=32, nkv=8):
        super().__init__()
        self.input_layernorm = RMSNorm(h)
        self.self_attn = Attn(h, nh, nkv)
        self.post_attention_layernorm = RMSNorm(h)
        self.mlp = MLP(h, i)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Stack(nn.Module):
    """4 Llama-3.1-8B decoder layers (hidden 4096, MLP 14336, 32 heads, 8 KV heads), random weights."""

    def __init__(self, n_layers=4):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self._rope = {}

    def rope(self, s, device, dtype, start=0):
        key = (s, start, dtype)
        if key not in self._rope:
            inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=device).float() / 128))
            pos = torch.arange(start, start + s, device=device).float()
            f = torch.outer(pos, inv)
            emb = torch.cat((f, f), dim=-1)
            self._rope[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._rope[key]

    def forward(self, x, start=0):
        cos, sin = self.rope(x.shape[1], x.device, x.dtype, start)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


def _build_stack(variant, seed=0):
    """variant: "bf16" or "jet_fp8/<gemm backend>", with ":unfused" to keep the plain MLP (no fused SwiGLU)."""
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Stack().to(torch.bfloat16)
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    if variant != "bf16":
        recipe_name, backend = variant.split("/")
        backend, _, mode = backend.partition(":")
        convert_to_fp8(model, dataclasses.replace(get_recipe(recipe_name), gemm_backend=backend), fuse_swiglu=False)
        if mode != "unfused":
            fuse_swiglu(model, classes=[MLP])  # what convert_to_fp8 does for HF Llama/Qwen MLPs
    return model


def _variant_label(variant):
    if variant == "bf16":
        return variant
    backend, _, mode = variant.split("/")[1].partition(":")
    return f"jet_fp8 {resolve_backend(backend, 'cuda')}" + (f" {mode}" if mode else "")


def _stack_variants(args, unfused=False):
    """bf16 plus one jet_fp8 variant per distinct resolved backend (auto,torch is one variant without DeepGEMM);
    with `unfused`, the first backend once more without the fused SwiGLU MLP (its A/B)."""
    out, seen = ["bf16"], set()
    for b in args.stack_backends.split(","):
        resolved = resolve_backend(b, "cuda")
        if resolved not in seen:
            seen.add(resolved)
            out.append(f"jet_fp8/{b}")
    if unfused and len(out) > 1:
        out.insert(2, out[1] + ":unfused")
    return out


def section_stack(args):
    seq = 4096
    results = {}
    for batch in (args.stack_batch, args.stack_batch // 2, args.stack_batch // 4):
        try:
            for name in _stack_variants(args, unfused=True):
                torch.cuda.empty_cache()
                model = _build_stack(name)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
                x = data(batch * seq, 4096, seed=14).view(batch, seq, 4096)

                def step():
                    out = model(x)
                    loss = out.float().pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    mark_weights_updated()
                    return loss

                for _ in range(2):
                    step()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                n_steps = args.stack_steps
                t0 = torch.cuda.Event(enable_timing=True)
                t1 = torch.cuda.Event(enable_timing=True)
                t0.record()
                for _ in range(n_steps):
                    loss = step()
                t1.record()
                torch.cuda.synchronize()
                ms = t0.elapsed_time(t1) / n_steps
                peak = torch.cuda.max_memory_allocated() / 2**30
                tok_s = batch * seq / (ms * 1e-3)
                results[name] = (ms, tok_s, peak, float(loss))
                del model, opt, x
                torch.cuda.empty_cache()
            break
        except torch.cuda.OutOfMemoryError:
            print(f"stack: batch {batch} ran out of memory; halving")
            results = {}
            torch.cuda.empty_cache()
    bf = results["bf16"]
    shape = f"4 layers, batch {batch} x seq {seq}"
    print(f"\n4-layer Llama-3.1-8B stack fwd+bwd+AdamW, {shape}")
    for name, (ms, tok, peak, loss) in results.items():
        label = _variant_label(name)
        gb = "cublas-bf16" if name == "bf16" else label.split()[1]
        print(f"  {name:22s} {ms:8.1f} ms/step {tok:9.0f} tok/s ({tok / bf[1]:.3f}x)  peak {peak:6.1f} GiB"
              f" ({peak / bf[2]:.3f} of bf16)  loss {loss:.4g}  [{gb}]")
        rec("stack_train_tokens_per_s", shape, label, round(tok, 0), "tokens/s", round(tok / bf[1], 3),
            ms_per_step=round(ms, 2), peak_mem_gib=round(peak, 2), gemm_backend=gb,
            fused_swiglu=name != "bf16" and not name.endswith(":unfused"))


def section_decode(args):
    print("\nDecode-shaped forward (M sequences x 1 position, no KV cache), 4 layers")
    models = {name: _build_stack(name).eval() for name in _stack_variants(args)}
    for m in (64, 256):
        res = {}
        for name, model in models.items():
            x = data(m, 4096, seed=15).view(m, 1, 4096)
            with torch.no_grad():
                model(x)
                t_eager = bench(lambda: model(x), rep=100)
                g = _capture(lambda: model(x))
                t_graph = bench(lambda: g.replay(), rep=100)
            res[name] = (t_eager, t_graph)
            del g
        for name, (te, tg) in res.items():
            rb = res["bf16"]
            label = _variant_label(name)
            print(f"  M={m:4d} {label:18s} eager {te * 1e3:8.1f} us ({rb[0] / te:4.2f}x)  graph {tg * 1e3:8.1f} us ({rb[1] / tg:4.2f}x)")
            rec("decode_forward_us", f"M={m} 4 layers eager", label, round(te * 1e3, 1), "us", round(rb[0] / te, 3))
            rec("decode_forward_us", f"M={m} 4 layers cuda-graph", label, round(tg * 1e3, 1), "us", round(rb[1] / tg, 3))
    del models


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_bench.json"))
    ap.add_argument("--sections", default="env,copy,quant,host,gemm,linear,stack,decode")
    ap.add_argument("--stack-batch", type=int, default=16)
    ap.add_argument("--stack-steps", type=int, default=4)
    ap.add_argument("--stack-backends", default="auto", help="GEMM backends of the jet_fp8 stack/decode variants, e.g. auto,torch")
    ap.add_argument("--gemm-backends", default="torch,triton,deep_gemm", help="backends timed in the gemm section (if available)")
    args = ap.parse_args()
    global COMMAND
    COMMAND = "PYTHONUNBUFFERED=1 python3 benchmarks/gpu_bench.py " + " ".join(sys.argv[1:]).replace(os.environ.get("OUT", "\0"), "$OUT")
    t_start = time.time()
    copy_bw = 4.25
    env = {}
    errors = {}
    for sec in args.sections.split(","):
        t0 = time.time()
        try:
            if sec == "env":
                env = section_env(args)
            elif sec == "copy":
                copy_bw = section_copy(args)
            elif sec == "quant":
                section_quant(args, copy_bw)
            elif sec == "gemm":
                section_gemm(args)
            elif sec == "host":
                section_host(args)
            elif sec == "linear":
                section_linear(args)
            elif sec == "stack":
                section_stack(args)
            elif sec == "decode":
                section_decode(args)
        except Exception as e:  # noqa: BLE001 - keep going, record the failure
            errors[sec] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        torch.cuda.empty_cache()
        print(f"[section {sec}: {time.time() - t0:.1f} s]", flush=True)
        with open(args.out, "w") as f:
            json.dump({"env": env, "errors": errors, "padding_events": padding_events, "records": RECORDS,
                       "elapsed_s": time.time() - t_start}, f, indent=1, default=str)
    from gpu_report import targets_table  # benchmarks/ is on sys.path: this file runs as a script from there

    print("\nThe issue's targets, from this run:\n" + targets_table(RECORDS))
    print(f"done in {time.time() - t_start:.0f} s; errors: {errors or 'none'}; wrote {args.out}")


if __name__ == "__main__":
    main()
