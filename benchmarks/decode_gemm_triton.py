"""Decode-sized GEMMs under CUDA graphs: the batch-invariant Triton kernel (`triton_invariant`) against BF16 and cuBLASLt.

    python benchmarks/decode_gemm_triton.py --out $OUT/decode_gemm_invariant.json [--m 1 16 64 128 256]
        [--models 8b smollm2] [--budget 420] [--no-tune]

For each projection of Llama-3.1-8B (qkv, o, gate_up, down) and SmolLM2-135M (qkv, o, gate_up, down) and each M,
it times one GEMM, each under a CUDA graph (no host cost): BF16 `F.linear`; cuBLASLt blockwise (the torch backend's
prepared `scaled_mm`, what the jetrl_fp8 engine runs by default); and `fp8_gemm_nt_invariant` with its default
configuration (`invariant_config`, what the backend runs) and with the tuned one. The quantizer's launch, which
both FP8 paths add per call, is timed on its own. The lm_heads run BF16 `F.linear` against `bf16_gemm_nt_invariant`.

The tuning is M-independent by construction: a shape's candidates (`candidate_configs(N, K, dtype)`) are each
timed at every M and the one with the least total time over the Ms wins, so one configuration serves every batch
size, as batch invariance requires. The best configuration per M is recorded too, to show what that costs.
Whether candidates that share a split-K (so one order of K ranges) but differ in tiling give identical bits is
recorded per shape (`decode_gemm_tilings_same_bits`): where they do, the tiling could follow M after all, and the
per-M best would be reachable without giving up invariance.
Before timing, each candidate is checked: its rows for the smallest M equal the same rows of the largest M bit
for bit, and its error against an fp32 product is below 5e-3 relative; a candidate failing either is recorded,
not timed. Tuning stops at --budget seconds (what is left runs the defaults only) and says so.

Records follow benchmarks/headline.py (name, shape, backend, value, unit, ratio_vs_bf16, command, date, device);
`python benchmarks/decode_gemm_triton.py --record FILE` files a measured FILE under benchmarks/results/runs/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["graph_us", "main"]

MODELS = {
    "8b": ("Llama-3.1-8B", {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
           (128256, 4096)),
    "smollm2": ("SmolLM2-135M", {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
                (49152, 576)),
}


def graph_us(fn, reps: int = 50) -> float:
    """Median µs per call of `fn` over 5 replays of a CUDA graph holding `reps` calls."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000 / reps)
    return sorted(ts)[2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _check(run, ms: list[int], ref: torch.Tensor) -> str | None:
    """None if `run` (M -> output; the inputs of smaller M are the first rows of larger ones) is right and
    batch-invariant, else why not."""
    m_lo, m_hi = min(ms), max(ms)
    big, small = run(m_hi), run(m_lo)
    if not torch.equal(_bits(small), _bits(big[:m_lo])):
        return f"rows of M={m_lo} differ from the same rows at M={m_hi}"
    err = float((big.float() - ref).norm() / ref.norm())
    return None if err < 5e-3 else f"relative error {err:.2e} against the fp32 product"


def _cfg_dict(cfg) -> dict:
    return {k: getattr(cfg, k) for k in ("block_n", "block_m", "split_k", "num_warps", "num_stages", "block_k")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON file for the records")
    ap.add_argument("--record", metavar="FILE", help="instead of measuring: file FILE's records (from --out) as a run "
                    "under benchmarks/results/runs/")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--budget", type=float, default=420.0, help="seconds of tuning before the rest runs defaults only")
    ap.add_argument("--no-tune", dest="tune", action="store_false")
    a = ap.parse_args()
    if a.record:
        from headline import write_run

        records = json.loads(Path(a.record).read_text())
        print(write_run(records, "decode-gemm-invariant", records[0]["date"]))
        return
    if not a.out:
        ap.error("--out FILE is needed to measure")
    import torch.nn.functional as F

    from jetrl_precision import quantize_fp8
    from jetrl_precision.gemm import resolve_backend, torch_backend
    from jetrl_precision.kernels import invariant_gemm as ig  # needs triton: imported after --help
    from jetrl_precision.kernels import quant
    from jetrl_precision.kernels.layout import row_major_padded_t

    resolve_backend("torch", "cuda")  # fails with one line where cuBLASLt blockwise cannot run
    resolve_backend("triton_invariant", "cuda")
    mm = torch_backend.prepared_scaled_mm("cuda")
    ms = sorted(set(a.m))
    t_start = time.time()
    device = torch.cuda.get_device_name()
    base = {"command": "python " + " ".join(["benchmarks/decode_gemm_triton.py", *sys.argv[1:]]),
            "date": datetime.date.today().isoformat(), "device": device, "unit": "us", "name": "decode_gemm_us"}
    records: list[dict] = []
    g = torch.Generator(device="cuda").manual_seed(0)

    def rec(shape: str, backend: str, us: float, bf16_us: float, **extra) -> None:
        records.append(dict(base, shape=shape, backend=backend, value=round(us, 3),
                            ratio_vs_bf16=round(bf16_us / us, 4) if backend != "bf16" else None, **extra))

    def tune(label: str, n: int, k: int, dtype, make_run, ref, bf16_us) -> None:
        """Time the default configuration and (budget allowing) every candidate at every M; record them."""
        default = ig.invariant_config(n, k, dtype)
        cands = ig.candidate_configs(n, k, dtype) if a.tune and time.time() - t_start < a.budget else [default]
        if a.tune and len(cands) == 1:
            print(f"  {label}: tuning budget spent; default configuration only", flush=True)
        times, rejected = {}, []
        # Whether tilings that share a split-K give the same bits (per split: its first output and the configurations
        # that differ from it). If they do, a tiling could follow M without breaking batch invariance.
        first_out, differ = {}, {}
        for cfg in cands:
            run = make_run(cfg)
            try:
                why = _check(run, ms, ref)
                if why is None:
                    times[cfg] = {m: graph_us(lambda run=run, m=m: run(m)) for m in ms}
                    out = _bits(run(max(ms)))
                    split = ig._splits(-(-k // cfg.block_k), cfg.split_k)  # (K steps per split, splits)
                    if split not in first_out:
                        first_out[split], differ[split] = out, []
                    elif not torch.equal(out, first_out[split]):
                        differ[split].append(_cfg_dict(cfg))
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile is recorded, not fatal
                why = f"{type(e).__name__}: {str(e)[:120]}"
            if why is not None:
                rejected.append([_cfg_dict(cfg), why])
        del first_out
        if len(times) > 1:
            same = all(not d for d in differ.values())
            records.append(dict(base, name="decode_gemm_tilings_same_bits", shape=label, backend="triton_invariant",
                                value=int(same), unit="bool", ratio_vs_bf16=None, configs=len(times),
                                differing_by_split={str(s): d for s, d in differ.items()}))
            print(f"  {label}: tilings with one split-K give {'the same' if same else 'DIFFERENT'} bits "
                  f"({len(times)} configs, {sum(map(len, differ.values()))} differ)", flush=True)
        if default not in times:
            raise SystemExit(f"{label}: the default configuration failed: {rejected}")
        best = min(times, key=lambda c: sum(times[c].values()))
        for m in ms:
            shape = f"{label} M={m} cuda-graph"
            rec(shape, "triton_invariant/default", times[default][m], bf16_us[m], config=_cfg_dict(default))
            per_m = min(times, key=lambda c: times[c][m])
            rec(shape, "triton_invariant/tuned", times[best][m], bf16_us[m], config=_cfg_dict(best),
                candidates=len(times), best_for_this_m_us=round(times[per_m][m], 3), best_for_this_m=_cfg_dict(per_m))
        if rejected:
            records.append(dict(base, name="decode_gemm_rejected_configs", shape=label, backend="triton_invariant",
                                value=len(rejected), unit="configs", ratio_vs_bf16=None, rejected=rejected))
        tot = {key: sum(v for v in d.values()) for key, d in (("default", times[default]), ("tuned", times[best]))}
        print(f"  {label}: default {tot['default']:.1f} us, tuned {tot['tuned']:.1f} us summed over M "
              f"({len(times)} configs timed, {len(rejected)} rejected) best {_cfg_dict(best)}", flush=True)
        if best != default:
            print(f"    TUNED[({n}, {k}, {str(dtype).removeprefix('torch.')!r})] = {best!r}", flush=True)

    for model in a.models:
        name, projs, (vocab, hidden) = MODELS[model]
        for proj, (n, k) in projs.items():
            label = f"{proj} {name}"
            w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
            wq = quantize_fp8(w, (128, 128))
            wt, sbp = wq.data.t(), row_major_padded_t(wq.scale)
            # Each M's rows are the first rows of the largest M's, so a configuration's invariance can be checked.
            x_all = (torch.randn(max(ms), k, device="cuda", generator=g)
                     * torch.exp(torch.randn(max(ms), 1, device="cuda", generator=g))).bfloat16()
            xs = {m: x_all[:m] for m in ms}
            xqs = {m: quant.quantize_1x128(xs[m], False) for m in ms}
            bf16_us = {}
            for m in ms:
                x = xs[m]
                shape = f"{label} M={m} cuda-graph"
                bf16_us[m] = graph_us(lambda: F.linear(x, w))
                rec(shape, "bf16", bf16_us[m], bf16_us[m])
                mp = -(-m // 4) * 4  # cuBLASLt needs M % 4 == 0 for these scales: the engine pads likewise
                xqp = quant.quantize_1x128(x, False, rows_alloc=mp)
                rec(shape, "scaled_mm/cublaslt", graph_us(lambda: mm(xqp.data, wt, xqp.scale, sbp, torch.bfloat16)), bf16_us[m])
                records.append(dict(base, name="quantize_1x128_us", shape=shape, backend="triton",
                                    value=round(graph_us(lambda: quant.quantize_1x128(x, False)), 3), ratio_vs_bf16=None))
            ref_big = xqs[max(ms)].dequantize(torch.float32) @ wq.dequantize(torch.float32).t()

            def fp8_run(cfg, xqs=xqs, wq=wq):
                return lambda m: ig.fp8_gemm_nt_invariant(
                    xqs[m].data, xqs[m].scale, wq.data, wq.scale, 128, torch.bfloat16, cfg)

            tune(label, n, k, torch.float8_e4m3fn, fp8_run, ref_big, bf16_us)
        # lm_head: BF16 against its invariant twin.
        label = f"lm_head {name}"
        w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).bfloat16()
        x_all = torch.randn(max(ms), hidden, device="cuda", generator=g).bfloat16()
        xs = {m: x_all[:m] for m in ms}
        bf16_us = {}
        for m in ms:
            bf16_us[m] = graph_us(lambda m=m: F.linear(xs[m], w))
            rec(f"{label} M={m} cuda-graph", "bf16", bf16_us[m], bf16_us[m])
        ref_big = xs[max(ms)].float() @ w.float().t()
        tune(label, vocab, hidden, torch.bfloat16, lambda cfg: lambda m: ig.bf16_gemm_nt_invariant(xs[m], w, config=cfg),
             ref_big, bf16_us)
        Path(a.out).write_text(json.dumps(records, indent=1))  # after each model: a timeout keeps what was done

    Path(a.out).write_text(json.dumps(records, indent=1))
    print(f"{len(records)} records -> {a.out} in {time.time() - t_start:.0f} s")
    # One line per (model, M): the sum over a layer's four projections, µs.
    for model in a.models:
        name = MODELS[model][0]
        for m in ms:
            sums = {}
            for r in records:
                if r["name"] == "decode_gemm_us" and r["shape"].endswith(f"{name} M={m} cuda-graph") and not r["shape"].startswith("lm_head"):
                    sums[r["backend"]] = sums.get(r["backend"], 0.0) + r["value"]
            print(f"{name} M={m} layer sum: " + ", ".join(f"{b} {v:.1f}" for b, v in sums.items()), flush=True)


if __name__ == "__main__":
    main()
