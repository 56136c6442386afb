"""Turn a gpu_bench.py JSON into docs: records for docs/benchmarks.json, markdown tables, and a plot.

    python benchmarks/gpu_report.py RUN.json [--json docs/benchmarks.json] [--plot docs/gpu_gemm_tflops.png]

Records whose `name` starts with a GPU benchmark prefix are replaced in the JSON list; records from
other benchmarks (CPU sections) are kept. The markdown tables go to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os

GPU_PREFIXES = (
    "d2d_copy", "quant_", "gemm_", "wgrad_gemm", "triton_decode_diag", "host_us", "linear_", "stack_", "decode_",
)
REQUIRED = ("name", "shape", "backend", "value", "unit", "ratio_vs_bf16", "command", "date")


def load(path):
    with open(path) as f:
        return json.load(f)


def update_json(records, path):
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    keep = [r for r in old if not str(r.get("name", "")).startswith(GPU_PREFIXES)]
    new = []
    for r in records:
        out = {k: r.get(k) for k in REQUIRED}
        out["device"] = "NVIDIA H200 (nvidia-h200 lease)"
        out.update({k: v for k, v in r.items() if k not in REQUIRED})
        new.append(out)
    with open(path, "w") as f:
        json.dump(keep + new, f, indent=1)
    return len(new)


def gemm_table(records):
    rows = {}
    for r in records:
        if r["name"] != "gemm_tflops":
            continue
        rows.setdefault(r["shape"], {})[r["backend"]] = r
    lines = ["| M | layer (N x K) | BF16 | torch (cuBLASLt blockwise) | triton (ours) | rel. err vs fp32 (torch / triton) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for shape, d in rows.items():
        m, layer, n, k = shape.split()
        bf = d["bf16"]["value"]

        def cell(b):
            return f"{d[b]['value']:.0f} ({d[b]['ratio_vs_bf16']:.2f}x)" if b in d else "-"

        err = " / ".join(
            "-" if d.get(b, {}).get("rel_err_vs_fp32") is None else f"{d[b]['rel_err_vs_fp32']:.2e}" for b in ("torch", "triton")
        )
        lines.append(f"| {m[2:]} | {layer} ({n[2:]} x {k[2:]}) | {bf:.0f} | {cell('torch')} | {cell('triton')} | {err} |")
    return "\n".join(lines)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {}
    for r in records:
        if r["name"] == "gemm_tflops":
            rows.setdefault(r["shape"], {})[r["backend"]] = r["value"]
    labels = [f"{s.split()[0][2:]}\n{s.split()[1]}" for s in rows]
    backends = ["bf16", "torch", "triton"]
    colors = {"bf16": "#888888", "torch": "#1f77b4", "triton": "#ff7f0e"}
    fig, ax = plt.subplots(figsize=(16, 5.5))
    width = 0.27
    for i, b in enumerate(backends):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, [d.get(b, math.nan) for d in rows.values()], width, label={"bf16": "BF16 cuBLAS (F.linear)",
               "torch": "FP8 blockwise, torch backend (cuBLASLt)", "triton": "FP8 blockwise, triton backend (ours)"}[b],
               color=colors[b])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_xlabel("M (tokens) / layer: qkv 6144x4096, o_proj 4096x4096, gate_up 28672x4096, down 4096x14336")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("H200, Llama-3.1-8B GEMM shapes: FP8 1x128 x 128x128 blockwise vs BF16 (same run, 2026-11-29)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--json", default="docs/benchmarks.json")
    ap.add_argument("--plot", default="docs/gpu_gemm_tflops.png")
    args = ap.parse_args()
    run = load(args.run)
    n = update_json(run["records"], args.json)
    print(f"<!-- {n} GPU records written to {args.json} -->\n")
    print(gemm_table(run["records"]))
    plot(run["records"], args.plot)


if __name__ == "__main__":
    main()
