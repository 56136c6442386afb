"""The module graph of `openrlhf` and `jetrl_precision` at a git revision: which module imports which, file lengths.

    python docs/module_graph.py BEFORE_REV [AFTER_REV] [--png docs/module_graph.png] [--md]

Imports are read with `ast` from the revision's files (`git show REV:path`), including imports inside functions
(the lazy ones), and resolved to project modules. `--md` prints the tables docs/architecture.md quotes; `--png`
draws both revisions side by side: one box per module (`jetrl_precision` per subpackage), its area proportional to
its lines, in layers from entry points (top) to the precision library (bottom); red arrows are imports of an entry
point by a non-entry module, or any other import that points up the layers (`LAYERS`).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("openrlhf", "jetrl_precision")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def modules(rev: str) -> dict[str, tuple[int, str]]:
    """{dotted module: (lines, source)} of the project packages at `rev`."""
    out = {}
    for path in _git("ls-tree", "-r", "--name-only", rev, *PACKAGES).split():
        if not path.endswith(".py"):
            continue
        src = _git("show", f"{rev}:{path}")
        name = path[:-3].replace("/", ".")
        name = name[: -len(".__init__")] if name.endswith(".__init__") else name
        out[name] = (src.count("\n"), src)
    return out


def imports(mods: dict[str, tuple[int, str]]) -> dict[str, set[str]]:
    """{module: project modules it imports anywhere in its body}."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, (_, src) in mods.items():
        is_pkg = any(m.startswith(name + ".") for m in mods)
        base = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(src)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    parts = base.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    mod = ".".join(parts + ([mod] if mod else []))
                targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t.split(".")[0] in PACKAGES:
                    edges[name].add(t)
    # `from pkg import name` also lists `pkg`; keep it only where no submodule of pkg was named.
    for name, ts in edges.items():
        edges[name] = {t for t in ts if not any(u.startswith(t + ".") for u in ts)}
    return edges


def layer(m: str) -> int:
    """The module's layer in `LAYERS`: 0 for entry points, the precision library last."""
    return next(i for i, (_, member) in enumerate(LAYERS) if member(m))


def violations(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports that point up the layers: an entry point imported by anything else, the trainer by an engine,
    the framework by the config schema, `openrlhf` by `jetrl_precision`, ..."""
    return sorted((src, t) for src, ts in edges.items() for t in ts if layer(t) < layer(src))


def summary(rev: str) -> dict:
    mods = modules(rev)
    edges = imports(mods)
    return {"rev": _git("rev-parse", "--short", rev).strip(), "modules": mods, "edges": edges, "violations": violations(edges)}


# ---- tables -------------------------------------------------------------------------------------------
def markdown(before: dict, after: dict) -> str:
    def stats(s):
        lines = {m: n for m, (n, _) in s["modules"].items()}
        fw = {m: n for m, n in lines.items() if m.startswith("openrlhf")}
        return lines, fw

    lb, fb = stats(before)
    la, fa = stats(after)
    out = [f"| | before ({before['rev']}) | after ({after['rev']}) |", "|---|---|---|"]
    out.append(f"| modules (openrlhf / jetrl_precision) | {len(fb)} / {len(lb) - len(fb)} | {len(fa)} / {len(la) - len(fa)} |")
    out.append(f"| lines (openrlhf / jetrl_precision) | {sum(fb.values())} / {sum(lb.values()) - sum(fb.values())} | "
               f"{sum(fa.values())} / {sum(la.values()) - sum(fa.values())} |")
    out.append(f"| longest openrlhf module | {max(fb, key=fb.get)} ({max(fb.values())}) | {max(fa, key=fa.get)} ({max(fa.values())}) |")
    out.append(f"| project imports (edges) | {sum(map(len, before['edges'].values()))} | {sum(map(len, after['edges'].values()))} |")
    out.append(f"| imports that point up the layers (an entry point, the trainer from below, ...) | {len(before['violations'])} | {len(after['violations'])} |")
    out.append("")
    for title, s in (("before", before), ("after", after)):
        out.append(f"**Layer violations {title}:** " + (", ".join(f"`{a}` → `{b}`" for a, b in s["violations"]) or "none"))
        out.append("")
    out.append("| module | lines | imports (project modules) | imported by |")
    out.append("|---|---|---|---|")
    importers = defaultdict(set)
    for src, ts in after["edges"].items():
        for t in ts:
            importers[t].add(src)
    for m in sorted(m for m in la if m.startswith("openrlhf")):
        deps = ", ".join(sorted(t.replace("openrlhf.", "").replace("jetrl_precision", "jp") for t in after["edges"].get(m, ())))
        before_n = f" (was {lb[m]})" if m in lb and lb[m] != la[m] else (" (new)" if m not in lb else "")
        out.append(f"| `{m}` | {la[m]}{before_n} | {deps} | {len(importers[m])} |")
    gone = sorted(m for m in lb if m not in la)
    if gone:
        out.append("")
        out.append("Removed: " + ", ".join(f"`{m}` ({lb[m]} lines)" for m in gone))
    return "\n".join(out)


# ---- the picture --------------------------------------------------------------------------------------
LAYERS = (
    ("entry points", lambda m: m.startswith("openrlhf.cli")),
    ("Ray mode", lambda m: m.startswith("openrlhf.trainer.ray")),
    ("trainer", lambda m: m.startswith("openrlhf.trainer") and not m.startswith(("openrlhf.trainer.engines", "openrlhf.trainer.ppo_utils"))),
    ("engines, experience", lambda m: m.startswith(("openrlhf.trainer.engines", "openrlhf.trainer.ppo_utils"))),
    ("models, data, rewards, utils", lambda m: m.startswith(("openrlhf.models", "openrlhf.datasets", "openrlhf.rewards", "openrlhf.utils"))),
    ("config", lambda m: m.startswith("openrlhf.config") or m == "openrlhf"),
    ("jetrl_precision", lambda m: m.startswith("jetrl_precision")),
)


def _node(m: str) -> str:
    """Collapse jetrl_precision to its subpackages (and top-level modules) to keep the picture readable."""
    if m.startswith("jetrl_precision."):
        parts = m.split(".")
        return ".".join(parts[:2])
    return m


def _collapsed(s: dict):
    lines: dict[str, int] = defaultdict(int)
    for m, (n, _) in s["modules"].items():
        lines[_node(m)] += n
    edges = {(_node(a), _node(b)) for a, ts in s["edges"].items() for b in ts if _node(a) != _node(b)}
    bad = {(_node(a), _node(b)) for a, b in s["violations"]}
    return lines, edges, bad


def draw(before: dict, after: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    fig, axes = plt.subplots(1, 2, figsize=(26, 15))
    for ax, (title, s) in zip(axes, (("before", before), ("after", after))):
        lines, edges, bad = _collapsed(s)
        pos, size = {}, {}
        for row, (label, member) in enumerate(LAYERS):
            ms = sorted((m for m in lines if member(m)), key=lambda m: (m.count("."), m))
            ms = [m for m in ms if m not in pos]
            y = len(LAYERS) - 1 - row
            ax.text(-0.7, y, label, ha="right", va="center", fontsize=10, weight="bold")
            per_row = 10
            for i, m in enumerate(ms):
                sub = i // per_row
                x = (i % per_row) * 1.3
                pos[m] = (x, y - 0.28 * sub + (0.14 if len(ms) > per_row else 0))
                size[m] = lines[m]
        for a, b in edges:
            if a in pos and b in pos:
                red = (a, b) in bad
                ax.add_patch(FancyArrowPatch(pos[a], pos[b], arrowstyle="-|>", mutation_scale=8,
                                             color="#d62728" if red else "#999999", lw=2.2 if red else 0.5,
                                             alpha=0.95 if red else 0.35, zorder=3 if red else 1,
                                             connectionstyle="arc3,rad=0.08"))
        for m, (x, y) in pos.items():
            side = 0.1 + 0.5 * (size[m] / 1100) ** 0.5
            ax.add_patch(Rectangle((x - side / 2, y - side * 0.22), side, side * 0.44, facecolor="#c6dbef" if m.startswith("openrlhf") else "#fdd0a2",
                                   edgecolor="#333333", lw=0.6, zorder=2))
            short = m.replace("openrlhf.", "").replace("trainer.", "t.").replace("jetrl_precision.", "jp.")
            ax.text(x, y - side * 0.22 - 0.04, f"{short}\n{size[m]}", ha="center", va="top", fontsize=6.3, zorder=4)
        n_lines = sum(n for n, _ in s["modules"].values())
        ax.set_title(f"{title} ({s['rev']}): {len(s['modules'])} modules, {n_lines} lines, "
                     f"{len(s['violations'])} layer violations (red)", fontsize=13)
        ax.set_xlim(-3.4, 12.6)
        ax.set_ylim(-0.8, len(LAYERS) - 0.4)
        ax.axis("off")
    fig.suptitle("openrlhf + jetrl_precision: who imports whom (box area ~ lines; jetrl_precision per subpackage)", fontsize=15)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after", nargs="?", default="HEAD")
    ap.add_argument("--png", default=None)
    ap.add_argument("--md", action="store_true")
    a = ap.parse_args()
    before, after = summary(a.before), summary(a.after)
    if a.md:
        print(markdown(before, after))
    if a.png:
        draw(before, after, Path(a.png))
        print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
