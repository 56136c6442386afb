"""Section `linear`: the FP8 linear layer's fwd+bwd against `nn.Linear` BF16 at M = 8192 for each Llama-3.1-8B
projection: eager (weights cached and re-quantized), with the autograd engine on the calling thread, under a
CUDA graph; host time per step, saved-activation bytes, and the step's kernels one by one."""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from jetrl_precision import Fp8Linear, get_recipe, mark_weights_updated, ops
from jetrl_precision.gemm import available_backends, gemm_nt, resolve_backend
from jetrl_precision.kernels import quant
from host_profile import busy_us, loop_us  # benchmarks/ is on sys.path: gpu_bench.py runs as a script from there

from .timing import LAYERS, bench, data, rec, recover_from_failed_capture

__all__ = ["section_linear"]


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
        hb_bf = _busy_host_us(step_bf16, xs + [lin.weight])
        rec("linear_fwd_bwd_host_us", f"M={m} {lname}", "bf16", round(hb_bf, 1), "us", host_ratio_vs_bf16=1.0)
        res = {"layer": lname, "bf16_ms": t_bf, "bf16_graph": _graphed_step_ms(_linear_over, lin.weight, xs, dys)}
        rec("linear_fwd_bwd_ms", f"M={m} {lname}", "bf16", round(t_bf, 4), "ms", 1.0, saved_activation_bytes=saved_bf)
        if math.isfinite(res["bf16_graph"]):
            rec("linear_fwd_bwd_ms", f"M={m} {lname} cuda-graph", "bf16", round(res["bf16_graph"], 4), "ms", 1.0)
        auto_name = resolve_backend("auto", "cuda")
        # auto first, then the other backends asked for that are present (torch stays in the table when auto is
        # deep_gemm).
        asked = [b for b in args.linear_backends.split(",") if b and b != "auto"]
        backends = ["auto"] + [b for b in asked if b != auto_name and available_backends("cuda").get(b, "unknown") is None]
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
            hb = _busy_host_us(step_cached, xs + [lin.weight])
            res[f"{name}_host_ratio"] = hb / hb_bf
            rec("linear_fwd_bwd_host_us", f"M={m} {lname} weight-cached", name, round(hb, 1), "us",
                host_ratio_vs_bf16=round(hb / hb_bf, 3))
            print(f"  {lname} {name}: host time per step {h_c:.3f} ms (bf16 {h_bf:.3f}); behind a sleep kernel "
                  f"{hb:.0f} us (bf16 {hb_bf:.0f} us, {hb / hb_bf:.2f}x); GPU step {t_c:.3f} ms")
            res[f"{name}_cached"] = t_c
            res[f"{name}_requant"] = t_r
            if backend == "auto":
                # Host time out of the picture: the same step captured once and replayed as a CUDA graph.
                t_g = _graphed_step_ms(lambda w: Fp8Linear.from_linear(_linear_over(w), fp, bw, gemm_backend=backend), lin.weight, xs, dys)
                res["graph"] = t_g
                if math.isfinite(t_g):  # a failed capture is printed, not recorded
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
    others = [b for b in ("deep_gemm", "torch", "triton") if b != name and f"{b}_cached" in rows[0]]
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
        if not all(map(math.isfinite, v)):  # a geomean of fewer layers would pass for the 4 layers' figure
            failed = [r["layer"] for r, x in zip(rows, v) if not math.isfinite(x)]
            print(f"geomean bf16/fp8 ({key}): not recorded, no figure for {', '.join(failed)}")
            continue
        g = gm(v)
        print(f"geomean bf16/fp8 ({key}): {g:.3f}x")
        rec("linear_fwd_bwd_geomean_ratio", f"M={m} 4 layers {key}",
            name if key in ("graph", "kernels_sum", "engine_on_calling_thread") else key.rsplit("_", 1)[0],
            round(g, 3), "x", round(g, 3))
    # One record per backend with the acceptance figures: the eager geomean, the slowest projection, and
    # host time per step against BF16's (behind a sleep kernel, so the host never waits on the GPU).
    for b in [name] + others:
        per = {r["layer"]: r["bf16_ms"] / r[f"{b}_cached"] for r in rows}
        host = {r["layer"]: r[f"{b}_host_ratio"] for r in rows}
        g = gm(list(per.values()))
        worst = min(per, key=per.get)
        print(f"{b}: eager geomean {g:.3f}x, slowest {worst} {per[worst]:.3f}x, host per step {gm(list(host.values())):.2f}x bf16's"
              f" (max {max(host.values()):.2f}x)")
        rec("linear_fwd_bwd_eager_ratio", f"M={m} 4 Llama-3.1-8B projections, weights cached", b, round(g, 3), "x",
            round(g, 3), min_layer=worst, min_layer_ratio=round(per[worst], 3),
            per_layer={k: round(v, 3) for k, v in per.items()},
            host_ratio_vs_bf16=round(gm(list(host.values())), 3), host_ratio_max=round(max(host.values()), 3),
            host_per_layer={k: round(v, 3) for k, v in host.items()})


def _host_ms(step, params, n=20):
    """Warm host time per step in ms (see host_profile.loop_us). A single step timed after a sync and a sleep
    kernel reads too high even for nn.Linear: a cold start, not launch cost."""
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


def _busy_host_us(step, params, n=20):
    """Host time per step in us with the GPU busy on a sleep kernel ahead of the steps: pure enqueue cost, whatever
    the GPU time of a step (host_profile.busy_us)."""
    for p in params:
        p.grad = None
    return busy_us(step, n)


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
    stream = torch.cuda.current_stream()
    try:
        graphed = torch.cuda.make_graphed_callables(build(w), (x,), num_warmup_iters=3)
        return bench(lambda: graphed(x).backward(dy), grad_to_none=[x, w], rep=150)
    except Exception as e:  # noqa: BLE001 - a failed capture must not lose the eager figures
        free, total = torch.cuda.mem_get_info()
        print(f"  CUDA-graph capture failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]} "
              f"(device memory free {free / 2**30:.1f} of {total / 2**30:.1f} GiB)")
        recover_from_failed_capture(stream)
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
