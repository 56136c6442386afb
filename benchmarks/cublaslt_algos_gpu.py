"""Whether cuBLASLt offers a faster algorithm than the one its heuristic puts first (the one torch's scaled_mm runs)
for the training GEMMs of the four Llama-3.1-8B projections.

Why: WGrad (1x128 x 1x128, the reduction over the tokens) takes 1.35-1.47x the time of the fprop kernel with the same
FLOPs (run record 2026-12-06_14, M = 8192), and its scales are the recipe's, so a faster kernel for it is the
training speed-up left that does not change a byte of the quantization. fprop and DGrad (1x128 x 128x128) are swept
beside it for comparison.

For each GEMM the heuristic's first `--count` algorithms (`LtBlockwiseGemm.offer_algorithms`) are timed with CUDA
events, taking turns within each round (median of the rounds), and each one's output is compared bit for bit with the
first's: an algorithm that splits K differently rounds differently, which a training GEMM may do but a user should know.

    python benchmarks/cublaslt_algos_gpu.py [--tokens 8192] [--count 16] [--kinds wgrad,fprop,dgrad] [--json OUT]

and where the JSON came back to: `python benchmarks/cublaslt_algos_gpu.py --from OUT --record --command "..."` files
each GEMM's speed-up as a run record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# (in_features, out_features) of one Llama-3.1-8B decoder layer's projections, q/k/v and gate/up stacked
PROJECTIONS = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
KINDS = ("wgrad", "fprop", "dgrad")


def gemm_shapes(tokens: int, kinds: tuple[str, ...] = KINDS) -> list[tuple[str, str, int, int, int, str]]:
    """(projection, kind, M, N, K, B's blocks) of out[M, N] = a[M, K] @ b[N, K]^T for each training GEMM:
    fprop x . W^T, DGrad dY . W, WGrad dY^T . x (both quantized along the tokens)."""
    out = []
    for name, (k_in, n_out) in PROJECTIONS.items():
        dims = {"fprop": (tokens, n_out, k_in, "128x128"), "dgrad": (tokens, k_in, n_out, "128x128"),
                "wgrad": (n_out, k_in, tokens, "1x128")}
        out += [(name, kind, *dims[kind]) for kind in kinds]
    return out


def operands(m: int, n: int, k: int, block_b: str, device, seed: int = 0) -> tuple:
    """(a, b_t, sa, sb) in the layouts the plans read, from random data with outlier rows and columns."""
    import torch

    from jetrl_precision.kernels.layout import mn_major, row_major_padded_t
    from jetrl_precision.quantize import quantize_fp8

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=g) * torch.exp(2 * torch.randn(m, 1, device=device, generator=g))
    x[:, ::97] *= 300.0
    w = torch.randn(n, k, device=device, generator=g) * 0.05
    w[::31] *= 40.0
    aq = quantize_fp8(x, (1, 128))
    wq = quantize_fp8(w, (128, 128) if block_b == "128x128" else (1, 128))
    sb = row_major_padded_t(wq.scale) if block_b == "128x128" else mn_major(wq.scale)
    return aq.data, wq.data.t(), mn_major(aq.scale), sb


def cuda_timer(fn: Callable[[], object], iters: int) -> float:
    """ms per call of `fn`, from CUDA events around `iters` calls."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def host_timer(fn: Callable[[], object], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def sweep(gemm, args: tuple, out_dtype, count: int, rounds: int, iters: int, timer: Callable = cuda_timer) -> list[dict]:
    """Each offered algorithm of `gemm` for `args`: ms per call (median of `rounds`, the algorithms taking turns in
    each round), whether its output equals the heuristic's first's bit for bit, or the error it raised."""
    import torch

    a, b_t = args[0], args[1]
    m, k, n = a.shape[0], a.shape[1], b_t.shape[1]
    rows = gemm.offer_algorithms(*args, out_dtype, count=count)
    want = None
    for row in rows:
        gemm.use_algorithm(m, n, k, out_dtype, row["index"])
        try:
            got = gemm(*args, out_dtype)
        except RuntimeError as e:  # an offered algorithm the library then refuses to run: noted, not timed
            row["error"] = str(e).splitlines()[0]
            continue
        want = got if want is None else want
        row["bits_equal_first"] = bool(torch.equal(got, want))
        row["ms_each"] = []
    live = [r for r in rows if "error" not in r]
    for _ in range(rounds):
        for row in live:
            gemm.use_algorithm(m, n, k, out_dtype, row["index"])
            row["ms_each"].append(round(timer(lambda: gemm(*args, out_dtype), iters), 4))
    for row in live:
        row["ms"] = round(statistics.median(row["ms_each"]), 4)
    gemm.use_algorithm(m, n, k, out_dtype, 0)
    return rows


def summary(name: str, kind: str, m: int, n: int, k: int, rows: list[dict]) -> dict:
    """The heuristic's first against the fastest offered algorithm for one GEMM."""
    live = [r for r in rows if "ms" in r]
    first = next((r for r in live if r["index"] == 0), None)
    best = min(live, key=lambda r: r["ms"]) if live else None
    tflops = (lambda ms: round(2 * m * n * k / (ms * 1e-3) / 1e12, 1) if ms else None)
    return {"projection": name, "kind": kind, "m": m, "n": n, "k": k, "offered": len(rows),
            "first_ms": first and first["ms"], "first_tflops": first and tflops(first["ms"]),
            "best_index": best and best["index"], "best_ms": best and best["ms"], "best_tflops": best and tflops(best["ms"]),
            "speedup": round(first["ms"] / best["ms"], 4) if first and best else None,
            "best_bits_equal_first": best and best.get("bits_equal_first"), "algorithms": rows}


def table(results: list[dict]) -> str:
    lines = ["| projection | GEMM | M x N x K | offered | first (ms, TFLOP/s) | fastest (index, ms, TFLOP/s) | speed-up | same bits |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['projection']} | {r['kind']} | {r['m']} x {r['n']} x {r['k']} | {r['offered']} | "
                     f"{r['first_ms']}, {r['first_tflops']} | {r['best_index']}, {r['best_ms']}, {r['best_tflops']} | "
                     f"{r['speedup']}x | {r['best_bits_equal_first']} |")
    return "\n".join(lines)


def records(results: list[dict], device: str, date: str, command: str) -> list[dict]:
    """One run record per GEMM: the fastest offered algorithm's speed-up over the heuristic's first."""
    return [{"name": "cublaslt_fastest_offered_algo_speedup", "shape": f"M={r['m']} N={r['n']} K={r['k']} {r['projection']} {r['kind']}",
             "backend": "torch", "value": r["speedup"], "unit": "x heuristic's first", "ratio_vs_bf16": None, "command": command, "date": date,
             "device": device, "first_ms": r["first_ms"], "best_ms": r["best_ms"], "best_index": r["best_index"],
             "best_bits_equal_first": r["best_bits_equal_first"], "offered": r["offered"]}
            for r in results if r["speedup"] is not None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--count", type=int, default=16, help="how many algorithms to ask the heuristic for")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--projections", default=",".join(PROJECTIONS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--from", dest="from_json", default="", help="a --json file of an earlier run: print it (and --record it)")
    ap.add_argument("--record", action="store_true", help="with --from: file the speed-ups in benchmarks/results/runs")
    ap.add_argument("--command", default="python3 benchmarks/cublaslt_algos_gpu.py", help="--record: how the run was made")
    ap.add_argument("--runs-dir", default=None, help="--record: the run records' folder (benchmarks/results/runs)")
    a = ap.parse_args(argv)
    if a.record and not a.from_json:
        ap.error("--record files a run already made: pass --from FILE (the --json it wrote)")
    if a.from_json:
        run = json.loads(Path(a.from_json).read_text())
        print(table(run["results"]))
        if a.record:
            from headline import RUNS, write_run

            recs = records(run["results"], run["device"], run["date"], a.command)
            print(write_run(recs, "cublaslt-algos", run["date"], Path(a.runs_dir) if a.runs_dir else RUNS))
        return 0
    kinds = tuple(x for x in a.kinds.split(",") if x)
    if set(kinds) - set(KINDS):
        ap.error(f"--kinds: {sorted(set(kinds) - set(KINDS))} are not among {list(KINDS)}")

    import torch

    if not torch.cuda.is_available():
        print("cublaslt_algos_gpu: needs a CUDA GPU (cuBLASLt's blockwise FP8 GEMM, sm90)", file=sys.stderr)
        return 2
    from jetrl_precision.gemm.cublaslt import LtBlockwiseGemm

    device = torch.device("cuda")
    gemms = {b: LtBlockwiseGemm(device, "1x128", b) for b in ("1x128", "128x128")}
    results = []
    for i, (name, kind, m, n, k, block_b) in enumerate(gemm_shapes(a.tokens, kinds)):
        if name not in a.projections.split(","):
            continue
        args = operands(m, n, k, block_b, device, seed=i)
        rows = sweep(gemms[block_b], args, torch.bfloat16, a.count, a.rounds, a.iters)
        results.append(summary(name, kind, m, n, k, rows))
        r = results[-1]
        print(f"[cublaslt_algos] {name} {kind} {m}x{n}x{k}: {r['offered']} offered, first {r['first_ms']} ms, "
              f"fastest #{r['best_index']} {r['best_ms']} ms ({r['speedup']}x, same bits: {r['best_bits_equal_first']})", flush=True)
        del args
    print(table(results))
    if a.json:
        run = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "tokens": a.tokens, "results": results}
        Path(a.json).write_text(json.dumps(run, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
