"""Turn a gpu_bench.py JSON into docs: records for docs/benchmarks.json, markdown tables, and a plot.

    python benchmarks/gpu_report.py RUN.json [--json docs/benchmarks.json] [--plot docs/gpu_gemm_tflops.png]
        [--run-label LABEL] [--linear-plot docs/gpu_linear_fwd_bwd.png]

New records are tagged with `--run` (a label such as "2026-11-29 session 3"); an existing record with
the same (name, shape, backend, run) is replaced, everything else is kept, so a partial run (a few
sections) never deletes the figures of another. The markdown tables go to stdout; the GEMM plot is
drawn when the run has GEMM records, the linear-layer plot when it has linear records and a run label.
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


def _key(r):
    return (r.get("name"), r.get("shape"), r.get("backend"), r.get("run"))


def update_json(records, path, run_label=None):
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    new = []
    for r in records:
        out = {k: r.get(k) for k in REQUIRED}
        out["device"] = "NVIDIA H200 (nvidia-h200 lease)"
        out.update({k: v for k, v in r.items() if k not in REQUIRED})
        if run_label is not None:
            out["run"] = run_label
        new.append(out)
    replaced = {_key(r) for r in new}
    keep = [r for r in old if _key(r) not in replaced]
    with open(path, "w") as f:
        json.dump(keep + new, f, indent=1)
    return len(new)


def gemm_table(records):
    rows = {}
    for r in records:
        if r["name"] != "gemm_tflops":
            continue
        rows.setdefault(r["shape"], {})[r["backend"]] = r
    lines = ["| M | layer (N x K) | BF16 | torch (cuBLASLt blockwise) | deep_gemm | triton (ours) | rel. err vs fp32 (torch / deep_gemm / triton) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for shape, d in rows.items():
        m, layer, n, k = shape.split()
        bf = d["bf16"]["value"]

        def cell(b):
            return f"{d[b]['value']:.0f} ({d[b]['ratio_vs_bf16']:.2f}x)" if b in d else "-"

        err = " / ".join(
            "-" if d.get(b, {}).get("rel_err_vs_fp32") is None else f"{d[b]['rel_err_vs_fp32']:.2e}" for b in ("torch", "deep_gemm", "triton")
        )
        lines.append(f"| {m[2:]} | {layer} ({n[2:]} x {k[2:]}) | {bf:.0f} | {cell('torch')} | {cell('deep_gemm')} | {cell('triton')} | {err} |")
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
    backends = [b for b in ("bf16", "torch", "deep_gemm", "triton") if any(b in d for d in rows.values())]
    colors = {"bf16": "#888888", "torch": "#1f77b4", "deep_gemm": "#2ca02c", "triton": "#ff7f0e"}
    labels_b = {"bf16": "BF16 cuBLAS (F.linear)", "torch": "FP8 blockwise, torch backend (cuBLASLt)",
                "deep_gemm": "FP8 blockwise, deep_gemm backend", "triton": "FP8 blockwise, triton backend (ours)"}
    fig, ax = plt.subplots(figsize=(16, 5.5))
    width = 0.8 / len(backends)
    for i, b in enumerate(backends):
        xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [d.get(b, math.nan) for d in rows.values()], width, label=labels_b[b], color=colors[b])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_xlabel("M (tokens) / layer: qkv 6144x4096, o_proj 4096x4096, gate_up 28672x4096, down 4096x14336")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("H200, Llama-3.1-8B GEMM shapes: FP8 1x128 x 128x128 blockwise vs BF16 (same run, 2026-11-29)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_linear(records, path, run_label):
    """FP8 linear fwd+bwd speed-up over BF16 per layer: eager per backend, and under a CUDA graph (host out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = {}
    for r in records:
        if r["name"] != "linear_fwd_bwd_ms" or r.get("run") != run_label or r["backend"] == "bf16":
            continue
        layer, kind = r["shape"].split()[1], " ".join(r["shape"].split()[2:])
        if kind == "weight-cached":
            ratios.setdefault(f"{r['backend']}, eager", {})[layer] = r["ratio_vs_bf16"]
        elif kind == "weight-cached cuda-graph":
            ratios.setdefault(f"{r['backend']}, CUDA graph", {})[layer] = r["ratio_vs_bf16"]
    if not ratios:
        return False
    layers = ["qkv", "o_proj", "gate_up", "down"]
    series = sorted(ratios, key=lambda k: ("graph" in k, k))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(layers))]
        ax.bar(xs, [ratios[name].get(lay, math.nan) for lay in layers], width, label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.4, color="gray", ls="--", lw=0.8, label="target 1.4x")
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels([f"{lay}\n{dims}" for lay, dims in zip(layers, ("6144x4096", "4096x4096", "28672x4096", "4096x14336"))])
    ax.set_ylabel("BF16 time / FP8 time (graph: against BF16 graph)")
    ax.set_ylim(0, 1.85)
    ax.set_title(f"H200, FP8 linear fwd+bwd vs nn.Linear BF16, M=8192, weights cached ({run_label})", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--json", default="docs/benchmarks.json")
    ap.add_argument("--plot", default="docs/gpu_gemm_tflops.png")
    ap.add_argument("--run-label", default=None, help='tag for the new records, e.g. "2026-11-29 session 3 call 1"')
    ap.add_argument("--linear-plot", default="docs/gpu_linear_fwd_bwd.png")
    args = ap.parse_args()
    run = load(args.run)
    n = update_json(run["records"], args.json, args.run_label)
    print(f"<!-- {n} GPU records written to {args.json} -->\n")
    if any(r["name"] == "gemm_tflops" for r in run["records"]):
        print(gemm_table(run["records"]))
        plot(run["records"], args.plot)
    if args.run_label and plot_linear([dict(r, run=args.run_label) for r in run["records"]], args.linear_plot, args.run_label):
        print(f"<!-- linear plot written to {args.linear_plot} -->")


if __name__ == "__main__":
    main()
