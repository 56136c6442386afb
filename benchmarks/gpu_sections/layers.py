"""Section `layers`: Llama-3.1-8B decoder layers at the token counts of a GRPO update's micro-batch, with q/k/v and
gate/up as stacked GEMMs (the default) against each projection on its own GEMM, and BF16.

Per variant and token count: fwd+bwd GPU time of a 4-layer stack (do_bench median), the host time of one layer's
fwd+bwd enqueued behind a sleep kernel (what the host spends when it never waits on the GPU), and the no-grad
forward. The stacked and separate variants hold the same weights: their outputs are compared (SQNR and whether
every bit is equal) and so are their weight gradients.
"""

from __future__ import annotations

import torch

from host_profile import busy_us  # benchmarks/ is on sys.path: gpu_bench.py runs as a script from there
from jetrl_precision import mark_weights_updated
from jetrl_precision.gemm import resolve_backend

from .llama_stack import build_stack
from .timing import bench, data, rec

__all__ = ["section_layers"]


def _sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    noise = (ref - x).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.pow(2).sum() / noise))


def _variants(args) -> list[str]:
    out, seen = ["bf16"], set()
    for b in args.stack_backends.split(","):
        resolved = resolve_backend(b, "cuda")
        if resolved not in seen:
            seen.add(resolved)
            out += [f"jet_fp8/{b}", f"jet_fp8/{b}:separate"]
    return out


def _keep_layers(model, n: int):
    model.layers = model.layers[:n]
    return model


def section_layers(args):
    tokens_list = [int(t) for t in str(args.layer_tokens).split(",")]
    names = _variants(args)
    print(f"\nDecoder layers (Llama-3.1-8B shape), stacked q/k/v + gate/up against separate GEMMs: {', '.join(names)}")
    for tokens in tokens_list:
        res, outs = {}, {}
        for name in names:
            torch.cuda.empty_cache()
            mark_weights_updated()
            model = build_stack(name)  # 4 layers, the same seed: the same weights in every variant
            params = list(model.parameters())
            hidden = model.layers[0].self_attn.o_proj.out_features
            x = data(tokens, hidden, seed=31).view(1, tokens, hidden).requires_grad_(True)

            def step():
                model(x).float().pow(2).mean().backward()

            step()
            ms = bench(step, grad_to_none=params + [x], rep=200)
            with torch.no_grad():
                fwd_ms = bench(lambda: model(x), rep=200)
            one = _keep_layers(build_stack(name), 1)
            one_params = list(one.parameters())

            def one_step():
                for p in one_params:
                    p.grad = None
                one(x).float().pow(2).mean().backward()

            host_us = busy_us(one_step, n=4)
            for p in params:
                p.grad = None
            y = model(x)
            y.float().pow(2).mean().backward()
            outs[name] = (y.detach(), {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None})
            res[name] = (ms, fwd_ms, host_us)
            del model, one, params, one_params, y
        bf = res["bf16"]
        shape = f"4 layers, {tokens} tokens"
        print(f"  {shape}")
        for name, (ms, fwd_ms, host_us) in res.items():
            label = name if name == "bf16" else name.split("/")[1]
            print(f"    {label:20s} fwd+bwd {ms:8.2f} ms ({bf[0] / ms:.3f}x)  fwd {fwd_ms:7.2f} ms ({bf[1] / fwd_ms:.3f}x)  "
                  f"host per layer fwd+bwd {host_us:8.1f} us ({host_us / bf[2]:.2f}x bf16's)")
            rec("layer_stack_fwd_bwd_ms", shape, label, round(ms, 3), "ms", round(bf[0] / ms, 3),
                no_grad_fwd_ms=round(fwd_ms, 3), no_grad_fwd_ratio_vs_bf16=round(bf[1] / fwd_ms, 3),
                host_us_per_layer=round(host_us, 1), host_ratio_vs_bf16=round(host_us / bf[2], 3))
        for name in names:
            if not name.endswith(":separate"):
                continue
            stacked = name.split(":")[0]
            (ys, gs), (yp, gp) = outs[stacked], outs[name]
            grads = {k: round(_sqnr_db(gp[k], gs[k]), 1) for k in gs if k in gp}
            gain = res[name][0] / res[stacked][0]
            print(f"    {stacked.split('/')[1]}: stacked/separate fwd+bwd {gain:.3f}x, no-grad fwd "
                  f"{res[name][1] / res[stacked][1]:.3f}x, host {res[name][2] / res[stacked][2]:.2f}x less; output "
                  f"{'bit-equal' if torch.equal(ys, yp) else f'SQNR {_sqnr_db(yp, ys):.1f} dB'}, weight grads SQNR min "
                  f"{min(grads.values())} dB")
            rec("stacked_projection_gain", shape, stacked.split("/")[1], round(gain, 3), "x", None,
                no_grad_fwd_gain=round(res[name][1] / res[stacked][1], 3),
                host_gain=round(res[name][2] / res[stacked][2], 3), output_bit_equal=bool(torch.equal(ys, yp)),
                output_sqnr_db=round(_sqnr_db(yp, ys), 1), grad_sqnr_db_min=min(grads.values()))
        del outs
