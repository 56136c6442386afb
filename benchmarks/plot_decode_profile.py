"""Plot one decode-step profile run: each recipe's GPU time by kernel group beside its wall time per step.

    python benchmarks/plot_decode_profile.py 2026-12-06_15 --out docs/eager_decode_step.png

The run file (benchmarks/results/runs/<stem>*.json, as `vllm_decode_profile.py --record` writes it) holds per recipe
the decode step's wall time (without the profiler where the run measured it), its GPU kernel time, and that time by
kernel group. Where the wall bar stands well above the stacked kernels, the step waits on the host: FP8's GPU saving
shows in tokens/s only where it does not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "results" / "runs"
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

from plot_engine_ab import load_run, save_figure  # noqa: E402  (benchmarks/)

__all__ = ["step_times", "plot", "main"]

# Stacking order, largest first in a typical step; groups not listed go into "other".
GROUPS = ("gemm", "attention", "quantize", "sampler/log-probs", "norm", "rotary", "silu*mul")


def step_times(records: list[dict]) -> dict[str, dict]:
    """{recipe: {"wall": us, "wall_source": ..., "groups": {group: us}}} from a decode-profile run's records."""
    out: dict[str, dict] = {}
    for r in records:
        rec = out.setdefault(r["backend"], {"groups": {}})
        if r["name"] == "decode_step_group_us":
            group = r["shape"].rsplit(", ", 1)[1]
            key = group if group in GROUPS else "other"
            rec["groups"][key] = rec["groups"].get(key, 0.0) + float(r["value"])
        elif r["name"] == "decode_step_wall_unprofiled_us":
            rec["wall"], rec["wall_source"] = float(r["value"]), "no profiler"
        elif r["name"] == "decode_step_wall_us" and rec.get("wall_source") != "no profiler":
            rec["wall"], rec["wall_source"] = float(r["value"]), "under the profiler"
        elif r["name"] == "decode_step_kernel_us":
            rec["kernels"] = float(r["value"])
    missing = [b for b, v in out.items() if "wall" not in v or not v["groups"]]
    if missing:
        raise SystemExit(f"plot_decode_profile: no wall time or kernel groups for {', '.join(missing)}: "
                         "is this a run file that vllm_decode_profile.py --record wrote?")
    return out


def plot(times: dict[str, dict], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = sorted(times, key=lambda b: (b != "bf16", b))
    groups = [g for g in (*GROUPS, "other") if any(times[b]["groups"].get(g) for b in order)]
    fig, ax = plt.subplots(figsize=(9, 1.6 + 1.1 * len(order)))
    colors = plt.get_cmap("tab10")
    for i, b in enumerate(order):
        y, left = 2 * i, 0.0
        for j, g in enumerate(groups):
            ms = times[b]["groups"].get(g, 0.0) / 1e3
            ax.barh(y + 0.45, ms, left=left, height=0.8, color=colors(j), label=g if i == 0 else None)
            left += ms
        ax.annotate(f"{left:.2f} ms of kernels", (left, y + 0.45), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
        wall = times[b]["wall"] / 1e3
        ax.barh(y - 0.45, wall, height=0.8, color="lightgray", edgecolor="black")
        ax.annotate(f"{wall:.2f} ms wall ({times[b]['wall_source']})", (wall, y - 0.45), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks([2 * i for i in range(len(order))])
    ax.set_yticklabels(order)
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step")
    ax.set_xlim(0, 1.35 * max(max(t["wall"], sum(t["groups"].values())) for t in times.values()) / 1e3)
    ax.legend(fontsize=8, ncol=len(groups), loc="upper center", bbox_to_anchor=(0.5, -0.32), frameon=False)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="the run file's stem (or a unique prefix) under benchmarks/results/runs")
    ap.add_argument("--runs-dir", default=str(RUNS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default=None)
    a = ap.parse_args(argv)
    records = load_run(a.run, Path(a.runs_dir), "plot_decode_profile")
    times = step_times(records)
    first = next(r for r in records if r["name"] == "decode_step_wall_us")
    title = a.title or f"decode step, {first['shape']}\n{first['device']}, {first['date']} (run {a.run})"
    print(plot(times, title, Path(a.out)))
    for b, t in times.items():
        print(f"{b}: wall {t['wall']:.0f} us ({t['wall_source']}), kernels {sum(t['groups'].values()):.0f} us")


if __name__ == "__main__":
    main()
