"""Section `host`: host (CPU) time per call at decode size, where the GPU work is shorter than the Python around
it: every launch of an Fp8Linear step one by one, the legacy `torch._scaled_mm` shortcut's bitwise check, and
cProfile rankings of the forward and the fwd+bwd step (also written to gpu_bench_host_profile.txt beside the JSON)."""

from __future__ import annotations

import cProfile
import io
import itertools
import pstats
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from jetrl_precision import Fp8Linear, get_recipe
from jetrl_precision.gemm import available_backends, gemm_nt
from jetrl_precision.kernels import quant
from host_profile import busy_us, loop_us  # benchmarks/ is on sys.path: gpu_bench.py runs as a script from there

from .timing import data, rec, rel_err

__all__ = ["section_host"]


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
    from jetrl_precision.kernels import launch

    kq = quant._quant_1x128_kernel
    qbuf, sbuf = torch.empty_like(x, dtype=torch.float8_e4m3fn), torch.empty_strided((64, 32), (1, 64), device="cuda")
    jit_args = (x, qbuf, sbuf, 64, 4096, 4096, 1, 4096, 1, 1, 64)
    items = {
        "F.linear bf16": lambda: F.linear(x, w),
        "quantize_1x128 launch": lambda: quant.quantize_1x128(x),
        # The same kernel launch, preallocated outputs: through Triton's kernel[grid] and through the launcher
        # (direct after the first call: launch.direct_launch_status()).
        "1x128 kernel[grid] only": lambda: kq[(4, 32)](*jit_args, BLOCK_R=16, POW2=False, num_warps=4),
        "1x128 TritonLauncher only": lambda: quant._kern_1x128((4, 32), *jit_args, BLOCK_R=16, POW2=False, num_warps=4),
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
    # Is the legacy torch._scaled_mm (cheaper per call) the same computation for block scales?
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
    print(f"  direct Triton launches: {launch.direct_launch_status()}")
    rec("triton_direct_launch", "process", "host", int(launch.direct_launch_status()[0]), "bool",
        note=launch.direct_launch_status()[1])
    pure = {}
    for name, fn in {"nn.Linear fwd+bwd": lambda: lin(xg[next(cyc)]).backward(dyg),
                     "Fp8Linear fwd+bwd": lambda: f8(xg[next(cyc)]).backward(dyg)}.items():
        us = host_us(fn, n=200)
        pure[name] = busy_us(fn, n=40)  # enqueued behind a sleep kernel: host work only
        print(f"  {name:28s} {us:7.1f}   behind a sleep kernel {pure[name]:7.1f}")
        rec("host_us_per_call", f"M=64 K=N=4096 {name}", "host", round(us, 1), "us")
        rec("host_us_per_call", f"M=64 K=N=4096 {name} behind a sleep kernel", "host", round(pure[name], 1), "us",
            host_ratio_vs_bf16=round(pure[name] / pure["nn.Linear fwd+bwd"], 3))
    # Where the Fp8Linear host time goes (cProfile inflates the totals; the ranking is what matters). cProfile sees
    # only the calling thread, and on CUDA the autograd engine runs the backward on a device thread of its own: the
    # fwd+bwd ranking runs it on the calling thread, so the backward's Python is in it. The rankings also go to
    # gpu_bench_host_profile.txt beside the JSON (a device call's output tail cuts them).
    def ranking(title, step, n, rows):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            step()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
        return f"cProfile, {title}:\n{buf.getvalue()}"

    with torch.no_grad():
        fwd = ranking("300 Fp8Linear forwards (no grad)", lambda: f8(xs[next(cyc)]), 300, 22)
    with torch.autograd.set_multithreading_enabled(False):
        step = ranking("200 Fp8Linear fwd+bwd steps, autograd on the calling thread",
                       lambda: f8(xg[next(cyc)]).backward(dyg), 200, 30)
    print(fwd + "\n" + step)
    Path(args.out).with_name("gpu_bench_host_profile.txt").write_text(fwd + "\n" + step)
