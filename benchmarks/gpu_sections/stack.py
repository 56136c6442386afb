"""Sections `stack` (the 4-layer Llama-3.1-8B stack's fwd+bwd+AdamW step: tokens/s and peak memory, BF16 against
jet_fp8 per GEMM backend, fused and unfused SwiGLU) and `decode` (its forward at M = 64 and 256 tokens, one
position each, eager and under a CUDA graph)."""

from __future__ import annotations

import gc

import torch

from jetrl_precision import mark_weights_updated
from jetrl_precision.gemm import resolve_backend

from .kernel_split import ceiling, ceiling_line, kernel_split
from .llama_stack import build_stack
from .timing import bench, capture, data, rec

__all__ = ["section_stack", "section_decode", "section_reference"]


def _variant_label(variant):
    if variant == "bf16":
        return variant
    backend, _, mode = variant.split("/")[1].partition(":")
    return f"jet_fp8 {resolve_backend(backend, 'cuda')}" + (f" {mode}" if mode else "")


def _free_previous() -> None:
    """Release the previous variant's model before the next is built and measured, so no tensor of it counts in a
    later variant's peak memory. `del` frees a converted model at once (no reference cycle); the collection covers
    anything cyclic a variant's step leaves behind, which would otherwise wait for Python's collector."""
    gc.collect()
    torch.cuda.empty_cache()


def _stack_variants(args, unfused=False, separate=False, plainnorm=False, plaindy=False):
    """bf16 plus one jet_fp8 variant per distinct resolved backend (auto,torch is one variant without DeepGEMM);
    with `unfused`, the first backend once more without the fused SwiGLU MLP, with `separate` once more with
    q/k/v and gate/up as their own GEMMs, with `plainnorm` once more with the plain RMSNorms, and with `plaindy`
    once more with gate/up's dY quantized by its own kernel, not the SwiGLU backward (the A/Bs of those fusions)."""
    out, seen = ["bf16"], set()
    for b in args.stack_backends.split(","):
        resolved = resolve_backend(b, "cuda")
        if resolved not in seen:
            seen.add(resolved)
            out.append(f"jet_fp8/{b}")
    if len(out) > 1:
        extra = [out[1] + ":" + mode for mode, on in (("unfused", unfused), ("separate", separate), ("plainnorm", plainnorm),
                                                      ("plaindy", plaindy)) if on]
        out[2:2] = extra
    return out


def _is_ab(name: str) -> bool:
    """A variant that leaves a default fusion out (an A/B row, not a headline figure)."""
    return ":" in name


def _report_split(splits, shape, goal, what):
    """Print and record the kernel splits (`--kernel-split`) of one section's variants, and each FP8 variant's
    ceiling against BF16 (kernel_split.ceiling)."""
    if "bf16" not in splits:
        return
    tops = {name: top for name, (_, top) in splits.items()}
    splits = {name: split for name, (split, _) in splits.items()}
    bf = splits["bf16"]
    groups = sorted({g for s in splits.values() for g in s}, key=lambda g: -max(s.get(g, 0.0) for s in splits.values()))
    print(f"\n{what}, GPU kernel time by group (ms per call), {shape}")
    print("  " + " " * 22 + "".join(f"{g[:11]:>12s}" for g in groups))
    for name, split in splits.items():
        print(f"  {_variant_label(name):22s}" + "".join(f"{split.get(g, 0.0):12.2f}" for g in groups))
        for g, ms in split.items():
            rec("kernel_group_ms", f"{shape}, {what}, {g}", _variant_label(name), round(ms, 3), "ms",
                round(bf[g] / ms, 3) if bf.get(g) and ms else None)
    for name, split in splits.items():
        if name == "bf16":
            continue
        c = ceiling(bf, split, goal)
        print(ceiling_line(_variant_label(name), c))
        rec("fp8_ceiling", f"{shape}, {what}", _variant_label(name), round(c["ceiling"], 3), "x", None,
            **{k: round(v, 3) for k, v in c.items() if k != "ceiling"},
            top_rest_kernels=[[k[:120], round(ms, 3), g] for k, ms, g in tops[name]])
    for name in ("bf16", next((n for n in splits if n != "bf16" and not _is_ab(n)), None)):
        if name:
            print(f"  {_variant_label(name)}: the largest kernels outside the GEMMs (ms per call)")
            print("\n".join(f"    {ms:8.2f}  {g:12s} {k[:110]}" for k, ms, g in tops[name][:8]))


def section_stack(args):
    seq = 4096
    results = {}
    splits = {}
    for batch in (args.stack_batch, args.stack_batch // 2, args.stack_batch // 4):
        try:
            for name in _stack_variants(args, unfused=True, separate=True, plainnorm=True, plaindy=True):
                _free_previous()
                model = build_stack(name)
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
                if getattr(args, "kernel_split", False):
                    splits[name] = kernel_split(step)
                del model, opt, x
                _free_previous()
            break
        except torch.cuda.OutOfMemoryError:
            print(f"stack: batch {batch} ran out of memory; halving")
            results, splits = {}, {}
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
            fused_swiglu=name != "bf16" and "unfused" not in name, stacked_projections=name != "bf16" and "separate" not in name,
            fused_norms=name != "bf16" and "plainnorm" not in name,
            fused_dy_quant=name != "bf16" and not any(m in name for m in ("plaindy", "unfused", "separate")))
        if name != "bf16" and not _is_ab(name):
            # The acceptance figures per GEMM backend: tokens/s over BF16's, and peak memory over BF16's.
            rec("stack_train_step_ratio", shape, gb, round(tok / bf[1], 3), "x", round(tok / bf[1], 3),
                peak_ratio_vs_bf16=round(peak / bf[2], 3), ms_per_step=round(ms, 2), bf16_ms_per_step=round(bf[0], 2))
    _report_split(splits, shape, 1.5, "fwd+bwd+AdamW step")


def section_decode(args):
    print("\nDecode-shaped forward (M sequences x 1 position, no KV cache), 4 layers")
    models = {name: build_stack(name).eval() for name in _stack_variants(args, separate=True)}
    for m in (64, 256):
        res = {}
        for name, model in models.items():
            x = data(m, 4096, seed=15).view(m, 1, 4096)
            with torch.no_grad():
                model(x)
                t_eager = bench(lambda: model(x), rep=100)
                g = capture(lambda: model(x))
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


def section_reference(args):
    """The reference / old-logprob forward: the stack's forward under no_grad at >= 16K tokens per call, BF16
    against jet_fp8 per backend. Weights quantized once (a reference model's never change); the `requant` row
    re-quantizes them before every forward, as the actor's old-logprob pass does once per optimizer step."""
    seq = 4096
    for batch in args.reference_batches:
        tokens = batch * seq
        shape = f"4 layers, batch {batch} x seq {seq}, no grad"
        res, splits = {}, {}
        for name in _stack_variants(args, separate=True, plainnorm=True):
            _free_previous()
            model = build_stack(name).eval()
            x = data(tokens, 4096, seed=21).view(batch, seq, 4096)
            with torch.no_grad():
                model(x)
                t = bench(lambda: model(x), rep=500)
                t_rq = None
                if name != "bf16":
                    def fwd_requant():
                        mark_weights_updated()
                        return model(x)

                    t_rq = bench(fwd_requant, rep=500)
                if getattr(args, "kernel_split", False):
                    splits[name] = kernel_split(lambda: model(x))
            res[name] = (t, t_rq)
            del model, x
        bf = res["bf16"][0]
        print(f"\nReference forward (no grad), {shape}")
        for name, (t, t_rq) in res.items():
            label = _variant_label(name)
            extra = "" if t_rq is None else f"; weights re-quantized {t_rq:.2f} ms ({bf / t_rq:.3f}x)"
            print(f"  {label:22s} {t:8.2f} ms ({bf / t:.3f}x){extra}")
            rec("reference_forward_ms", shape, label, round(t, 3), "ms", round(bf / t, 3), tokens=tokens)
            if t_rq is not None and not _is_ab(name):
                gb = label.split()[1]
                rec("reference_forward_ms", shape + ", weights re-quantized", label, round(t_rq, 3), "ms", round(bf / t_rq, 3),
                    tokens=tokens)
                rec("reference_forward_ratio", shape, gb, round(bf / t, 3), "x", round(bf / t, 3), tokens=tokens,
                    requant_ratio_vs_bf16=round(bf / t_rq, 3), bf16_ms=round(bf, 3), fp8_ms=round(t, 3))
        _report_split(splits, shape, 1.8, "no-grad forward")
