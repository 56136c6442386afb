"""Sweep the launch shapes of the shipped 128x1ᵀ / requant / 1x128 quantizers on a GPU, byte-checked first.

The shipped defaults come from this sweep (`quant.TILE_128x1_T`: 64 columns x 2 warps, row blocks fastest, for the
bf16 -> 128x1ᵀ writer; `quant.TILE_REQUANT_T`: 16 x 1, column blocks fastest, for the Triton requantizer). Re-run it
after changing the kernels' per-element arithmetic: fewer instructions per element favour wider tiles. Its figures
are the `quant_sweep_*` records in benchmarks/results/runs/.

Every launch shape is first checked byte for byte (scales by their bits, so NaN scales compare) against the
reference quantizer on a tensor holding NaN and +-inf; a mismatch drops it before timing.

  python3 benchmarks/quant_sweep.py --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jetrl_precision.kernels import quant  # noqa: E402
from jetrl_precision.quantize import quantize_fp8, requantize_fp8  # noqa: E402

TILES = [quant.Tile128x1(bc, nw, cf) for bc in (16, 32, 64) for nw in (1, 2, 4) for cf in (False, True)]
BLOCK_R = (8, 16, 32, 64)  # 1x128: rows per program


def data(m, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda") * torch.exp(0.5 * torch.randn(m, 1, generator=g, device="cuda"))
    x = torch.where(torch.rand(m, k, generator=g, device="cuda") < 1e-4, x * 50, x)
    return x.to(torch.bfloat16)


def same(got, ref) -> bool:
    """Byte equality of data and of the scales' bits."""
    bits = lambda s: s.contiguous().view(torch.int32)  # noqa: E731
    return torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(bits(got.scale), bits(ref.scale))


def kernels(x, xq):
    """kind -> (launch shape -> the call), for the shipped kernels."""
    return {
        "128x1T": {t: (lambda t=t: quant.quantize_128x1_t(x, tile=t)) for t in TILES},
        "requantT": {t: (lambda t=t: quant.requantize_1x128_to_128x1(xq, True, tile=t)) for t in TILES},
        "1x128": {br: (lambda br=br: quant.quantize_1x128(x, block_r=br)) for br in BLOCK_R},
    }


def byte_exact_configs() -> dict[str, list]:
    x = data(1000, 1600, 7)  # partial row and column blocks
    x[3, 5], x[700, 300], x[900, 1000] = float("nan"), float("inf"), -float("inf")
    xq = quantize_fp8(x, (1, 128), nonfinite="propagate")
    refs = {"128x1T": quantize_fp8(x, (128, 1), nonfinite="propagate").t(),
            "requantT": requantize_fp8(xq, (128, 1)).t(),
            "1x128": quantize_fp8(x, (1, 128), nonfinite="propagate")}
    ok: dict[str, list] = {}
    for kind, calls in kernels(x, xq).items():
        ok[kind] = []
        for cfg, fn in calls.items():
            try:
                good = same(fn(), refs[kind])
            except Exception as e:  # noqa: BLE001 - a launch shape the kernel refuses is reported, not fatal
                print(f"{kind} {cfg}: failed to run: {type(e).__name__}: {str(e)[:200]}")
                continue
            if good:
                ok[kind].append(cfg)
            else:
                print(f"{kind} {cfg}: BYTES DIFFER, dropped")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="quant_sweep.json")
    ap.add_argument("--shapes", default="16384x4096,16384x14336,8192x4096")
    args = ap.parse_args()
    n = 2**29
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_bw = 2 * n * 2 / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3) / 1e12
    del src, dst
    print(f"copy {copy_bw:.2f} TB/s", flush=True)
    ok = byte_exact_configs()
    print("byte-exact: " + ", ".join(f"{k} {len(v)}" for k, v in ok.items()), flush=True)

    recs = []
    t_start = time.time()
    for shp in args.shapes.split(","):
        m, k = map(int, shp.split("x"))
        x = data(m, k, 1)
        xq = quant.quantize_1x128(x)
        io = {"128x1T": m * k * 3 + 4 * k * math.ceil(m / 128),
              "requantT": 2 * m * k + 4 * m * math.ceil(k / 128) + 4 * k * math.ceil(m / 128),
              "1x128": m * k * 3 + 4 * m * math.ceil(k / 128)}
        defaults = {"128x1T": quant.TILE_128x1_T, "requantT": quant.TILE_REQUANT_T, "1x128": quant._block_r_1x128(m)}
        for kind, calls in kernels(x, xq).items():
            for cfg in ok[kind]:
                t = do_bench(calls[cfg], warmup=10, rep=40, return_mode="median")
                bw = io[kind] / (t * 1e-3) / 1e12
                recs.append({"kind": kind, "shape": shp, "config": str(cfg), "default": cfg == defaults[kind],
                             "us": round(t * 1e3, 2), "tb_s": round(bw, 3), "frac_of_copy": round(bw / copy_bw, 3)})
        print(f"{shp} done ({time.time() - t_start:.0f} s)", flush=True)
        del x, xq
    print(f"\n{'kind':9s} {'shape':>12s} {'launch shape':>60s} {'us':>8s} {'%copy':>6s}")
    for kind in ("128x1T", "requantT", "1x128"):
        for shp in args.shapes.split(","):
            rows = sorted((r for r in recs if r["kind"] == kind and r["shape"] == shp), key=lambda r: r["us"])
            for r in rows[:5] + [r for r in rows[5:] if r["default"]]:
                mark = " (default)" if r["default"] else ""
                print(f"{kind:9s} {shp:>12s} {r['config'] + mark:>60s} {r['us']:8.1f} {100 * r['frac_of_copy']:5.0f}%")
    Path(args.out).write_text(json.dumps({"copy_tb_s": copy_bw, "records": recs}, indent=1))


if __name__ == "__main__":
    main()
