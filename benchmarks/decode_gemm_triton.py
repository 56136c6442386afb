"""Decode GEMMs under CUDA graphs: the batch-invariant Triton kernel (`triton_invariant`) against BF16 and cuBLASLt,
and the measurement that fills its tables (`TUNED_NUMERICS`, `TUNED_TILES` in jetrl_precision/kernels/invariant_gemm.py).

    python benchmarks/decode_gemm_triton.py --out $OUT/decode_gemm_invariant.json [--m 1 32 64 128 256 1024]
        [--models 8b smollm2] [--budget 200] [--no-tune]
    TRITON_INTERPRET=1 python benchmarks/decode_gemm_triton.py --models tiny --m 1 4 --out /tmp/dg.json   # CPU

For each projection of Llama-3.1-8B (qkv, o, gate_up, down) and SmolLM2-135M (the same) and each M, it times one
GEMM under a CUDA graph (no host cost): BF16 `F.linear`; cuBLASLt blockwise (the torch backend's prepared
`scaled_mm`, what the jetrl_fp8 engine runs by default); and `fp8_gemm_nt_invariant`, first with the configuration
the tables give now (`invariant_config(N, K, dtype, M)`), then with every candidate (`candidate_configs`: each
candidate numerics with each candidate tile) at every M. The quantizer's launch, which both FP8 paths add per
call, is timed on its own. The lm_heads run BF16 `F.linear` against `bf16_gemm_nt_invariant`.

Before timing, each candidate is checked: its rows for the smallest M equal the same rows of the largest M bit for
bit, and its error against an fp32 product is below 5e-3 relative; a candidate failing either is recorded, not
timed. Candidates that share a numerics must give identical bits whatever their tile (the premise that lets the
tile follow M and N); each shape records whether they did (`decode_gemm_tilings_same_bits`).

From the times it derives, and prints as Python literals to paste into invariant_gemm.py:
- per (K, dtype), the numerics with the least time summed over all shapes sharing that K and over the Ms, each
  (shape, M bucket) at its best tile under that numerics (the numerics may not follow N or M; the tile may);
- per (N, K, dtype) and M bucket (`M_BUCKETS`), the fastest tile under that numerics (summed over the bucket's Ms).
The per-M times of the derived tables are recorded (`triton_invariant/derived`) beside BF16 and cuBLASLt.
Each candidate's time at each M is kept, compactly, in one `decode_gemm_candidates` record per shape.
Tuning stops starting new shapes after --budget seconds (those then time the current tables only) and says so.

On a CPU under TRITON_INTERPRET=1 (`--models tiny`) the same selection runs on wall-clock times of the interpreted
kernels; CUDA graphs, cuBLASLt and the quantizer's timing are skipped. The times mean nothing there: it proves
the script end to end before a device run.

Records follow benchmarks/headline.py (name, shape, backend, value, unit, ratio_vs_bf16, command, date, device);
`python benchmarks/decode_gemm_triton.py --record FILE` files a measured FILE under benchmarks/results/runs/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["graph_us", "probe_parser", "record_or_check_device", "derive_tables", "format_tables", "main"]

MODELS = {
    "8b": ("Llama-3.1-8B", {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
           (128256, 4096)),
    "smollm2": ("SmolLM2-135M", {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
                (49152, 576)),
    # CPU proof of the script (TRITON_INTERPRET=1): two projections sharing K, one lm_head.
    "tiny": ("tiny", {"qkv": (256, 256), "o": (128, 256)}, (256, 128)),
}
_TILE_FIELDS = ("block_n", "block_m", "num_warps", "num_stages")
_NUM_FIELDS = ("block_k", "split_k")


def graph_us(fn, reps: int | None = None) -> float:
    """Median µs per call of `fn` over 5 replays of a CUDA graph holding `reps` calls (by default enough calls
    for about 2 ms per replay, 5 to 50)."""
    fn()
    torch.cuda.synchronize()
    if reps is None:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(3):
            fn()
        e1.record()
        torch.cuda.synchronize()
        reps = int(min(50, max(5, 2000 / max(e0.elapsed_time(e1) * 1000 / 3, 1e-3))))
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


def probe_parser(doc: str | None) -> argparse.ArgumentParser:
    """The device probes' parser: `--out FILE` to measure into, `--record FILE` to file a device result instead
    (`record_or_check_device`); each probe adds its own sizes."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON file for the records")
    ap.add_argument("--record", metavar="FILE", default=None,
                    help="instead of measuring: file FILE's records (from --out) as a run under benchmarks/results/runs/")
    return ap


def record_or_check_device(ap: argparse.ArgumentParser, a: argparse.Namespace, label: str) -> bool:
    """The device GEMM scripts' start: with `--record FILE`, file FILE's records as a run named `label` and return
    True (nothing to measure); else require `--out` and a CUDA device, or Triton's interpreter on a CPU."""
    if a.record:
        from headline import write_run

        records = json.loads(Path(a.record).read_text())
        print(write_run(records, label, records[0]["date"]))
        return True
    if not a.out:
        ap.error("--out FILE is needed to measure")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("no CUDA device: run it under TRITON_INTERPRET=1 (with --models tiny) to check it on a CPU")
    return False


def wall_us(fn) -> float:
    """CPU stand-in for `graph_us` (the interpreter): one call's wall time after a warm-up call."""
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _check(run, ms: list[int], ref: torch.Tensor) -> tuple[str | None, torch.Tensor | None]:
    """(None, the output at the largest M) if `run` (M -> output; the inputs of smaller M are the first rows of
    larger ones) is right and batch-invariant, else (why not, None)."""
    m_lo, m_hi = min(ms), max(ms)
    big, small = run(m_hi), run(m_lo)
    if not torch.equal(_bits(small), _bits(big[:m_lo])):
        return f"rows of M={m_lo} differ from the same rows at M={m_hi}", None
    err = float((big.float() - ref).norm() / ref.norm())
    return (None, big) if err < 5e-3 else (f"relative error {err:.2e} against the fp32 product", None)


def _cfg_dict(cfg) -> dict:
    return {k: getattr(cfg, k) for k in (*_TILE_FIELDS[:2], "split_k", *_TILE_FIELDS[2:], "block_k")}


# ---- selection (no device needed) ------------------------------------------------------------------
def derive_tables(shapes: list[dict], buckets: tuple[int, ...], bucket_of) -> tuple[dict, dict, dict]:
    """From each tuned shape's times, the tables to paste and what each numerics would cost.

    `shapes`: dicts with n, k, dtype (a name), ms, and times {(numerics, tile): [µs per M]} (numerics and tile
    as tuples of `_NUM_FIELDS` and `_TILE_FIELDS`). Returns (numerics by (K, dtype), {(N, K, dtype): {bucket:
    tile}}, {(K, dtype): {numerics: summed µs}}). A numerics competes for a K only if every shape of that K has
    it timed; each shape's M bucket counts at its fastest tile under it (each M, where every M has a bucket of
    its own)."""
    by_k: dict[tuple[int, str], list[dict]] = {}
    for s in shapes:
        by_k.setdefault((s["k"], s["dtype"]), []).append(s)

    def best_sum(s: dict, nu: tuple, idx: list[int]) -> tuple[float, tuple | None]:
        options = [(sum(t[i] for i in idx), tile) for (n_, tile), t in s["times"].items() if n_ == nu]
        return min(options) if options else (float("inf"), None)

    def per_bucket(s: dict) -> list[tuple[int, list[int]]]:
        out = [(b, [i for i, m in enumerate(s["ms"]) if bucket_of(m) == b]) for b in buckets]
        return [(b, idx) for b, idx in out if idx]

    numerics, totals, tiles = {}, {}, {}
    for key, group in by_k.items():
        common = set.intersection(*({nu for nu, _ in s["times"]} for s in group))
        # The tile follows M's bucket, so each bucket of each shape counts at its own best tile.
        totals[key] = {nu: sum(best_sum(s, nu, idx)[0] for s in group for _, idx in per_bucket(s)) for nu in common}
        if not totals[key]:
            continue
        numerics[key] = nu = min(totals[key], key=lambda v: (totals[key][v], v[1]))  # ties: the fewer splits
        for s in group:
            table, prev = {}, None
            for b, idx in per_bucket(s):
                tile = best_sum(s, nu, idx)[1]
                if tile is not None and tile != prev:  # a bucket like the one below it needs no entry
                    table[b] = prev = tile
            tiles[(s["n"], s["k"], s["dtype"])] = table
    return numerics, tiles, totals


def format_tables(numerics: dict, tiles: dict) -> str:
    """The two tables as Python literals in invariant_gemm.py's spelling."""
    lines = ["TUNED_NUMERICS: dict[tuple[int, str], InvariantNumerics] = {"]
    for (k, dt), nu in sorted(numerics.items()):
        lines.append(f'    ({k}, "{dt}"): InvariantNumerics(block_k={nu[0]}, split_k={nu[1]}),')
    lines += ["}", "TUNED_TILES: dict[tuple[int, int, str], dict[int, InvariantTile]] = {"]
    for (n, k, dt), table in sorted(tiles.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        body = ", ".join(f"{b}: _t{tuple(t)}" for b, t in sorted(table.items()))
        lines.append(f'    ({n}, {k}, "{dt}"): {{{body}}},')
    lines.append("}")
    return "\n".join(lines)


# ---- measurement -----------------------------------------------------------------------------------
def main() -> None:
    ap = probe_parser(__doc__)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32, 64, 128, 256, 1024],
                    help="batch sizes; one per M bucket of invariant_gemm.M_BUCKETS fills every bucket")
    ap.add_argument("--models", nargs="+", default=["8b", "smollm2"], choices=list(MODELS))
    ap.add_argument("--budget", type=float, default=200.0, help="seconds after which no new shape is tuned")
    ap.add_argument("--no-tune", dest="tune", action="store_false")
    a = ap.parse_args()
    if record_or_check_device(ap, a, "decode-gemm-invariant"):
        return
    cuda = torch.cuda.is_available()
    import torch.nn.functional as F

    from jetrl_precision import quantize_fp8
    from jetrl_precision.kernels import invariant_gemm as ig  # needs triton: imported after --help

    dev = "cuda" if cuda else "cpu"
    timer = graph_us if cuda else wall_us
    how = "cuda-graph" if cuda else "interpreted"
    if cuda:
        from jetrl_precision.gemm import resolve_backend, torch_backend
        from jetrl_precision.kernels import quant
        from jetrl_precision.kernels.layout import row_major_padded_t

        resolve_backend("torch", "cuda")  # fails with one line where cuBLASLt blockwise cannot run
        resolve_backend("triton_invariant", "cuda")
        mm = torch_backend.prepared_scaled_mm("cuda")
    ms = sorted(set(a.m))
    t_start = time.time()
    device = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
    base = {"command": "python " + " ".join(["benchmarks/decode_gemm_triton.py", *sys.argv[1:]]),
            "date": datetime.date.today().isoformat(), "device": device, "unit": "us", "name": "decode_gemm_us"}
    records: list[dict] = []
    g = torch.Generator(device=dev).manual_seed(0)
    tuned: list[dict] = []  # per tuned shape: n, k, dtype (a name), ms, times {(numerics, tile): [µs per M]}, label
    baselines: dict[str, dict] = {}

    def rec(shape: str, backend: str, us: float, bf16_us: float, **extra) -> None:
        records.append(dict(base, shape=shape, backend=backend, value=round(us, 3),
                            ratio_vs_bf16=round(bf16_us / us, 4) if backend != "bf16" else None, **extra))

    def measure(label: str, n: int, k: int, dtype, make_run, ref, bf16_us, lt_us) -> None:
        """Time the tables' configuration per M and (budget allowing) every candidate at every M."""
        dname = str(dtype).removeprefix("torch.")
        for m in ms:
            cfg = ig.invariant_config(n, k, dtype, m)
            rec(f"{label} M={m} {how}", "triton_invariant/table", timer(lambda cfg=cfg, m=m: make_run(cfg)(m)), bf16_us[m],
                config=_cfg_dict(cfg))
        baselines[label] = {"bf16": bf16_us, "cublaslt": lt_us}
        if not a.tune:
            return
        if time.time() - t_start > a.budget:
            print(f"  {label}: tuning budget spent; the tables' configuration only", flush=True)
            return
        times, rejected, first, differ = {}, [], {}, {}
        for cfg in ig.candidate_configs(n, k, dtype):
            run = make_run(cfg)
            nu, tile = tuple(getattr(cfg, f) for f in _NUM_FIELDS), tuple(getattr(cfg, f) for f in _TILE_FIELDS)
            try:
                why, big = _check(run, ms, ref)
                if why is None:
                    times[(nu, tile)] = [round(timer(lambda run=run, m=m: run(m)), 3) for m in ms]
                    if nu not in first:
                        first[nu], differ[nu] = _bits(big), []
                    elif not torch.equal(_bits(big), first[nu]):
                        differ[nu].append(tile)
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile is recorded, not fatal
                why = f"{type(e).__name__}: {str(e)[:120]}"
            if why is not None:
                rejected.append([_cfg_dict(cfg), why])
        del first
        n_differ = sum(map(len, differ.values()))
        records.append(dict(base, name="decode_gemm_tilings_same_bits", shape=label, backend="triton_invariant",
                            value=int(n_differ == 0), unit="bool", ratio_vs_bf16=None, configs=len(times),
                            differing_tiles_by_numerics={str(nu): d for nu, d in differ.items()}))
        print(f"  {label}: tiles under one numerics give {'the same' if n_differ == 0 else 'DIFFERENT'} bits "
              f"({len(times)} configs timed, {n_differ} differ, {len(rejected)} rejected)", flush=True)
        records.append(dict(base, name="decode_gemm_candidates", shape=label, backend="triton_invariant",
                            value=len(times), unit="configs", ratio_vs_bf16=None, n=n, k=k, dtype=dname, ms=ms,
                            columns=[*_NUM_FIELDS, *_TILE_FIELDS, *(f"us_m{m}" for m in ms)],
                            rows=[[*nu, *tile, *t] for (nu, tile), t in times.items()]))
        if rejected:
            records.append(dict(base, name="decode_gemm_rejected_configs", shape=label, backend="triton_invariant",
                                value=len(rejected), unit="configs", ratio_vs_bf16=None, rejected=rejected))
        if times:
            tuned.append(dict(n=n, k=k, dtype=dname, ms=ms, times=times, label=label))

    for model in a.models:
        name, projs, (vocab, hidden) = MODELS[model]
        for proj, (n, k) in projs.items():
            label = f"{proj} {name}"
            print(f"{label}: N={n} K={k}", flush=True)
            w = (torch.randn(n, k, device=dev, generator=g) * 0.02).bfloat16()
            wq = quantize_fp8(w, (128, 128))
            # Each M's rows are the first rows of the largest M's, so a configuration's invariance can be checked.
            x_all = (torch.randn(max(ms), k, device=dev, generator=g)
                     * torch.exp(torch.randn(max(ms), 1, device=dev, generator=g))).bfloat16()
            xs = {m: x_all[:m] for m in ms}
            xqs = {m: quantize_fp8(xs[m], (1, 128)) for m in ms}
            bf16_us, lt_us = {}, {}
            if cuda:
                wt, sbp = wq.data.t(), row_major_padded_t(wq.scale)
            for m in ms:
                x = xs[m]
                bf16_us[m] = timer(lambda x=x: F.linear(x, w))
                rec(f"{label} M={m} {how}", "bf16", bf16_us[m], bf16_us[m])
                if cuda:
                    mp = -(-m // 4) * 4  # cuBLASLt needs M % 4 == 0 for these scales: the engine pads likewise
                    xqp = quant.quantize_1x128(x, False, rows_alloc=mp)
                    lt_us[m] = graph_us(lambda: mm(xqp.data, wt, xqp.scale, sbp, torch.bfloat16))
                    rec(f"{label} M={m} {how}", "scaled_mm/cublaslt", lt_us[m], bf16_us[m])
                    records.append(dict(base, name="quantize_1x128_us", shape=f"{label} M={m} {how}", backend="triton",
                                        value=round(graph_us(lambda: quant.quantize_1x128(x, False)), 3),
                                        ratio_vs_bf16=None))
            ref_big = xqs[max(ms)].dequantize(torch.float32) @ wq.dequantize(torch.float32).t()

            def fp8_run(cfg, xqs=xqs, wq=wq):
                return lambda m: ig.fp8_gemm_nt_invariant(
                    xqs[m].data, xqs[m].scale, wq.data, wq.scale, 128, torch.bfloat16, cfg)

            measure(label, n, k, torch.float8_e4m3fn, fp8_run, ref_big, bf16_us, lt_us)
        # lm_head: BF16 against its invariant twin.
        label = f"lm_head {name}"
        print(f"{label}: N={vocab} K={hidden}", flush=True)
        w = (torch.randn(vocab, hidden, device=dev, generator=g) * 0.02).bfloat16()
        x_all = torch.randn(max(ms), hidden, device=dev, generator=g).bfloat16()
        xs = {m: x_all[:m] for m in ms}
        bf16_us = {}
        for m in ms:
            bf16_us[m] = timer(lambda m=m: F.linear(xs[m], w))
            rec(f"{label} M={m} {how}", "bf16", bf16_us[m], bf16_us[m])
        ref_big = xs[max(ms)].float() @ w.float().t()
        measure(label, vocab, hidden, torch.bfloat16,
                lambda cfg, xs=xs, w=w: lambda m: ig.bf16_gemm_nt_invariant(xs[m], w, config=cfg), ref_big, bf16_us, {})
        Path(a.out).write_text(json.dumps(records, indent=1))  # after each model: a timeout keeps what was done

    numerics, tiles, totals = derive_tables(tuned, ig.M_BUCKETS, ig.m_bucket)
    for s in tuned:
        key = (s["k"], s["dtype"])
        if key not in numerics:
            continue
        nu = numerics[key]
        table = tiles[(s["n"], s["k"], s["dtype"])]
        for i, m in enumerate(s["ms"]):
            keys = [b for b in sorted(table) if b <= ig.m_bucket(m)] or sorted(table)
            tile = table[keys[-1]]
            us = s["times"][(nu, tile)][i]
            lt = baselines[s["label"]]["cublaslt"].get(m)
            rec(f"{s['label']} M={m} {how}", "triton_invariant/derived", us, baselines[s["label"]]["bf16"][m],
                config=dict(zip((*_NUM_FIELDS, *_TILE_FIELDS), (*nu, *tile))),
                ratio_vs_cublaslt=round(lt / us, 4) if lt else None)
    for key, tot in sorted(totals.items()):
        print(f"K={key[0]} {key[1]}: µs summed over shapes and Ms, by (block_k, split_k): "
              + ", ".join(f"{nu} {v:.1f}" for nu, v in sorted(tot.items(), key=lambda kv: kv[1])), flush=True)
    records.append(dict(base, name="decode_gemm_derived_tables", shape="all", backend="triton_invariant",
                        value=len(tiles), unit="shapes", ratio_vs_bf16=None,
                        numerics={f"{k} {dt}": list(nu) for (k, dt), nu in numerics.items()},
                        tiles={f"{n} {k} {dt}": {str(b): list(t) for b, t in tb.items()} for (n, k, dt), tb in tiles.items()}))
    Path(a.out).write_text(json.dumps(records, indent=1))
    print(f"{len(records)} records -> {a.out} in {time.time() - t_start:.0f} s")
    if numerics:
        print("# Paste into jetrl_precision/kernels/invariant_gemm.py:\n" + format_tables(numerics, tiles), flush=True)
    # One line per (model, M): the sum over a layer's four projections, µs.
    for model in a.models:
        name = MODELS[model][0]
        for m in ms:
            sums: dict[str, float] = {}
            for r in records:
                if r["name"] == "decode_gemm_us" and r["shape"].endswith(f"{name} M={m} {how}") and not r["shape"].startswith("lm_head"):
                    sums[r["backend"]] = sums.get(r["backend"], 0.0) + r["value"]
            print(f"{name} M={m} layer sum: " + ", ".join(f"{b} {v:.1f}" for b, v in sums.items()), flush=True)


if __name__ == "__main__":
    main()
