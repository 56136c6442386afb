"""Turn a gpu_bench.py JSON into results: a run file under benchmarks/results/runs/, markdown tables and plots.

    python benchmarks/gpu_report.py RUN.json [--run-label LABEL] [--plot docs/gpu_gemm_tflops.png]
        [--linear-plot docs/gpu_linear_fwd_bwd.png]
    python benchmarks/gpu_report.py --goals [benchmarks/results/runs]

The run's records go to `benchmarks/results/runs/<date>_<NN>_<label>.json` (see `headline.py`); then run
`python benchmarks/headline.py` to refresh headline.json and the README's table. The markdown tables go to
stdout; the GEMM plot is drawn when the run has GEMM records, the linear-layer plot when it has linear records.
`--goals` prints the goals table from every recorded run, the newest figure of each winning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from typing import Callable

from headline import RUNS, load_records, write_run  # benchmarks/ is on sys.path: this file runs as a script from there

REQUIRED = ("name", "shape", "backend", "value", "unit", "ratio_vs_bf16", "command", "date")


def load(path):
    with open(path) as f:
        return json.load(f)


def run_records(run: dict, run_label: str | None = None) -> list[dict]:
    """gpu_bench.py's records in the results format: the required fields first, the device, the run label."""
    device = (run.get("env") or {}).get("gpu") or "GPU (see the run's env)"
    out = []
    for r in run["records"]:
        rec = {k: r.get(k) for k in REQUIRED}
        rec["device"] = device
        rec.update({k: v for k, v in r.items() if k not in REQUIRED})
        if run_label is not None:
            rec["run"] = run_label
        out.append(rec)
    return out


def _last(records, name, shape=None, backend=None):
    """The last record with this name (and shape / backend, when given), or None."""
    hits = [r for r in records if r.get("name") == name and (shape is None or r.get("shape") == shape)
            and (backend is None or r.get("backend") == backend)]
    return hits[-1] if hits else None


@dataclass(frozen=True)
class Target:
    """A goal of the FP8 path: `value(records)` -> (measured number or None, the record it came from)."""

    label: str
    unit: str  # "%" or "x"
    goal: float | None  # None: reported, no target
    value: Callable[[list], tuple[float | None, str]]
    at_most: bool = False  # the goal is a ceiling (host time, memory), not a floor
    record: str = ""  # the record name it reads (for the goals that summary records carry)


def _quant_row(label, name, shape):
    def value(records):
        # A record without a share of copy (its run measured no copy on that device) does not hide an older one.
        r = _last([x for x in records if x.get("frac_of_copy") is not None], name, shape)
        return (None, "") if r is None else (100 * r["frac_of_copy"], f"{name} {shape}")
    return Target(label, "%", 85.0, value)


def _gemm_row(backend):
    def value(records):
        r = _last(records, "gemm_geomean_ratio_M_ge_4096", backend=backend)
        if r is None:
            return None, ""
        # Timed at the power cap, with do_bench's figure beside it (gpu_sections.timing.bench_sustained).
        how = f", at the power cap; do_bench {r['flush_geomean']}x" if "flush_geomean" in r else ""
        return r["value"], f"gemm_geomean_ratio_M_ge_4096 ({r['shape']}{how})"
    return Target(f"GEMM TFLOP/s vs BF16, M >= 4096, geomean, {backend}", "x", 1.6, value)


def _auto_backend(records):
    r = _last(records, "linear_fwd_bwd_geomean_ratio", "M=8192 4 layers graph")
    return None if r is None else r["backend"]


def _linear_row(label, kind, goal=1.4):
    def value(records):
        auto = _auto_backend(records)
        shape = {"graph": "M=8192 4 layers graph", "1thread": "M=8192 4 layers engine_on_calling_thread"}.get(
            kind, f"M=8192 4 layers {auto}_cached")
        r = _last(records, "linear_fwd_bwd_geomean_ratio", shape)
        return (None, "") if r is None else (r["value"], f"linear_fwd_bwd_geomean_ratio '{shape}'")
    return Target(label, "x", goal, value)


def _last_stack_backend(records):
    r = [x for x in records if x.get("name") == "stack_train_tokens_per_s" and x.get("backend", "").startswith("jet_fp8 ")]
    return r[0]["backend"].split(" ", 1)[1] if r else None  # the first jet_fp8 variant is the `auto` one


def _ratio_row(label, name, shape):
    def value(records):
        auto = _auto_backend(records) or _last_stack_backend(records)
        r = _last(records, name, shape, f"jet_fp8 {auto}") if auto else None
        return (None, "") if r is None else (r["ratio_vs_bf16"], f"{name} '{shape}' jet_fp8 {auto}")
    return Target(label, "x", None, value)


def _summary_row(label, name, backend, goal, field="value", at_most=False, where=None):
    """A goal read from one summary record of the training-speed sections (linear, stack, reference)."""
    def value(records):
        hits = [r for r in records if r.get("name") == name and r.get("backend") == backend and (where is None or where(r))]
        if not hits or hits[-1].get(field) is None:
            return None, ""
        return hits[-1][field], f"{name} {backend} {field} ({hits[-1]['shape']})"
    return Target(label, "x", goal, value, at_most, name)


TRAIN_TARGETS = (
    _summary_row("FP8 linear fwd+bwd vs BF16, eager, M=8192, 4 layers, torch", "linear_fwd_bwd_eager_ratio", "torch", 1.45),
    _summary_row("FP8 linear fwd+bwd vs BF16, eager, M=8192, 4 layers, deep_gemm", "linear_fwd_bwd_eager_ratio", "deep_gemm", 1.6),
    _summary_row("  slowest projection, torch", "linear_fwd_bwd_eager_ratio", "torch", 1.2, "min_layer_ratio"),
    _summary_row("  slowest projection, deep_gemm", "linear_fwd_bwd_eager_ratio", "deep_gemm", 1.2, "min_layer_ratio"),
    _summary_row("  host time per step over BF16's (geomean), torch", "linear_fwd_bwd_eager_ratio", "torch", 1.3,
                 "host_ratio_vs_bf16", at_most=True),
    _summary_row("  host time per step over BF16's (geomean), deep_gemm", "linear_fwd_bwd_eager_ratio", "deep_gemm", 1.3,
                 "host_ratio_vs_bf16", at_most=True),
    _summary_row("4-layer stack train step tokens/s vs BF16, torch", "stack_train_step_ratio", "torch", 1.5),
    _summary_row("  peak memory over BF16's, torch", "stack_train_step_ratio", "torch", 1.0, "peak_ratio_vs_bf16", at_most=True),
    _summary_row("4-layer stack train step tokens/s vs BF16, deep_gemm", "stack_train_step_ratio", "deep_gemm", 1.5),
    _summary_row("reference forward (no grad, 16K tokens) vs BF16, torch", "reference_forward_ratio", "torch", 1.8,
                 where=lambda r: r.get("tokens") == 16384),
    _summary_row("reference forward (no grad, 16K tokens) vs BF16, deep_gemm", "reference_forward_ratio", "deep_gemm", 1.8,
                 where=lambda r: r.get("tokens") == 16384),
)

TARGETS = (
    _quant_row("quantizer 1x128 (x, dY), % of copy", "quant_1x128", "16384x14336"),
    _quant_row("quantizer 128x1 written transposed (dY^T), % of copy", "quant_128x1_transposed", "16384x14336"),
    _quant_row("requantize 1x128 -> 128x1^T (saved x8), % of copy", "quant_requant_1x128_to_128x1_T", "16384x14336"),
    _quant_row("quantizer 128x128 (weights), % of copy", "quant_128x128", "28672x4096"),
    _gemm_row("torch"),
    _gemm_row("deep_gemm"),
    _linear_row("FP8 linear fwd+bwd vs BF16, M=8192, 4 layers, eager (auto)", "eager"),
    # Not a goal: the eager steps again with a process-wide knob (docs/performance.md, step 6).
    _linear_row("FP8 linear fwd+bwd vs BF16, M=8192, 4 layers, eager, autograd engine on the calling thread (auto)", "1thread", None),
    _linear_row("FP8 linear fwd+bwd vs BF16, M=8192, 4 layers, CUDA graph (auto)", "graph"),
    _ratio_row("4-layer stack fwd+bwd+AdamW tokens/s vs BF16 (auto)", "stack_train_tokens_per_s", "4 layers, batch 16 x seq 4096"),
    _ratio_row("decode forward, M=64, CUDA graph, vs BF16 (auto)", "decode_forward_us", "M=64 4 layers cuda-graph"),
) + TRAIN_TARGETS


def targets_table(records) -> str:
    """One markdown table: each goal, the measured value, and whether it is met."""
    lines = ["| target | goal | measured | met | from |", "| --- | --- | --- | --- | --- |"]
    for t in TARGETS:
        label, unit, goal = t.label, t.unit, t.goal
        v, src = t.value(records)
        sign = "<=" if t.at_most else ">="
        goal_s = "-" if goal is None else (f"{sign} {goal:.0f}%" if unit == "%" else f"{sign} {goal:.2f}x")
        if v is None:
            lines.append(f"| {label} | {goal_s} | not measured in this run | - | |")
            continue
        v_s = f"{v:.0f}%" if unit == "%" else f"{v:.3f}x"
        met = "-" if goal is None else ("yes" if (v <= goal if t.at_most else v >= goal) else "no")
        lines.append(f"| {label} | {goal_s} | {v_s} | {met} | {src} |")
    return "\n".join(lines)


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


def _card(records) -> str:
    """The GPU the plotted records ran on, for a plot's title (lent machines are H100s or H200s)."""
    return (records[0].get("device") or "GPU").removeprefix("NVIDIA ") if records else "GPU"


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
    gemm = [r for r in records if r["name"] == "gemm_tflops"]
    how = ", each at the 700 W power cap" if any(r.get("timing") == "sustained" for r in gemm) else ""
    ax.set_title(f"{_card(gemm)}, Llama-3.1-8B GEMM shapes: FP8 1x128 x 128x128 blockwise vs BF16 (same run{how}, {gemm[0]['date']})")
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
        elif kind == "weight-cached engine-on-calling-thread":
            ratios.setdefault(f"{r['backend']}, eager, backward on the calling thread", {})[layer] = r["ratio_vs_bf16"]
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
    # the run label on its own line: long labels ran off a one-line title
    ax.set_title(f"{_card(records)}, FP8 linear fwd+bwd vs nn.Linear BF16, M=8192, weights cached\n{run_label}", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run", nargs="?", help="gpu_bench.py's JSON (with --goals: a folder of run files)")
    ap.add_argument("--results", default=str(RUNS), help="where run files go")
    ap.add_argument("--plot", default="docs/gpu_gemm_tflops.png")
    ap.add_argument("--run-label", default="gpu_bench", help='names the run file, e.g. "gpu_bench linear deep_gemm"')
    ap.add_argument("--linear-plot", default="docs/gpu_linear_fwd_bwd.png")
    ap.add_argument("--goals", "--targets", dest="goals", action="store_true",
                    help="only print the goals table from the recorded runs (the newest figure of each wins)")
    args = ap.parse_args()
    if args.goals:
        records = load_records(args.run or args.results)
        if not records:
            ap.error(f"no run records in {args.run or args.results}")
        print(targets_table(records))
        return
    if args.run is None:
        ap.error("give gpu_bench.py's JSON (or --goals)")
    run = load(args.run)
    records = run_records(run, args.run_label)
    date = max(r["date"] for r in records) if records else "unknown-date"
    path = write_run(records, args.run_label, date, args.results)
    print(f"<!-- {len(records)} GPU records written to {os.path.relpath(path)} -->\n")
    if any(r["name"] == "gemm_tflops" for r in records):
        print(gemm_table(records))
        plot(records, args.plot)
    if plot_linear(records, args.linear_plot, args.run_label):
        print(f"<!-- linear plot written to {args.linear_plot} -->")


if __name__ == "__main__":
    main()
