"""Plot engine A/B rounds: jet_fp8/bf16 tokens/s per arm, one point per run, from run records.

    python benchmarks/plot_engine_ab.py 2026-12-06_07 2026-12-06_08 ... --out docs/eager_native_ab.png

Each run file (benchmarks/results/runs/<stem>*.json, as `vllm_gpu.py record` writes them) holds the
`vllm_rollout_tokens_per_s` records of one arm: the engine as shipped, or with an engine switch, which the
record's shape names after the mode (e.g. ", JETRL_NATIVE_LINEAR=0"). Single engine runs spread by 10-25% on the
device hosts, so the plot shows every run beside each arm's median rather than one bar per arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "results" / "runs"

__all__ = ["arm_ratios", "plot", "save_figure", "load_run", "main"]

SHIPPED = "as shipped"


def arm_ratios(records: list[dict], prompts: int) -> dict[str, list[float]]:
    """{arm: [jet_fp8/bf16 ratio per record]} for `prompts` prompts; the arm is the shape's engine switches, or
    SHIPPED where there are none."""
    out: dict[str, list[float]] = {}
    for r in records:
        if r.get("name") != "vllm_rollout_tokens_per_s" or r.get("ratio_vs_bf16") is None:
            continue
        shape = r["shape"]
        if f", {prompts} prompts " not in shape:
            continue
        tail = shape.split(", eager", 1)[1] if ", eager" in shape else shape.split(", default", 1)[-1]
        switches = tail.strip(", ")
        out.setdefault(switches or SHIPPED, []).append(float(r["ratio_vs_bf16"]))
    return out


def plot(ratios: dict[str, list[float]], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted(ratios, key=lambda a: (a != SHIPPED, a))
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for i, arm in enumerate(arms):
        vals = ratios[arm]
        ax.scatter([i] * len(vals), vals, s=40, alpha=0.8)
        med = statistics.median(vals)
        ax.hlines(med, i - 0.25, i + 0.25, color="black", lw=2)
        ax.annotate(f"median {med:.3f}", (i + 0.28, med), va="center", fontsize=9)
    ax.axhline(1.0, color="gray", ls="--", lw=0.8)
    ax.set_xticks(range(len(arms)))
    ax.set_xticklabels([f"{arm}\n({len(ratios[arm])} runs)" for arm in arms], fontsize=9)
    ax.set_xlim(-0.6, len(arms) - 0.2)
    ax.set_ylabel("jet_fp8 / bf16 output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Lay out, write (the folder made if missing) and close a figure; returns its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_run(stem: str, runs_dir: Path, tool: str) -> list[dict]:
    """The records of the one run file under `runs_dir` whose name starts with `stem`; anything else is one line."""
    files = sorted(Path(runs_dir).glob(f"{stem}*.json"))
    if len(files) != 1:
        sys.exit(f"{tool}: {stem!r} names {len(files)} run files in {runs_dir}"
                 f"{': ' + ', '.join(f.name for f in files) if files else ''}; give a stem that names exactly one")
    data = json.loads(files[0].read_text())
    return data["records"] if isinstance(data, dict) else data


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run file stems (or their unique prefixes) under benchmarks/results/runs")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--runs-dir", default=str(RUNS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default=None)
    a = ap.parse_args(argv)
    records, devices = [], set()
    for stem in a.runs:
        recs = load_run(stem, Path(a.runs_dir), "plot_engine_ab")
        records += recs
        devices |= {r.get("device", "") for r in recs}
    ratios = arm_ratios(records, a.prompts)
    if not ratios:
        sys.exit(f"plot_engine_ab: no jet_fp8/bf16 throughput ratios at {a.prompts} prompts in those runs")
    title = a.title or f"{', '.join(sorted(d for d in devices if d))}: engine A/B, {a.prompts} prompts, each point one run"
    print(f"wrote {plot(ratios, title, Path(a.out))}")
    for arm, vals in ratios.items():
        print(f"{arm}: median {statistics.median(vals):.3f} of {len(vals)} ({', '.join(f'{v:.3f}' for v in vals)})")


if __name__ == "__main__":
    main()
