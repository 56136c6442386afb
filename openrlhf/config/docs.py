"""docs/cli.md's flag tables, rendered from the schema.

    python -m openrlhf.config.docs docs/cli.md    # refresh the generated blocks; a test fails when stale
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from .fields import BOUNDS
from .flags import default_str, flag_specs, section_help
from .parity import OPENRLHF_V0_11

__all__ = ["render_flag_table", "render_alias_table", "render_parity_table", "update_docs"]


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def render_flag_table() -> str:
    """Markdown: one table per section with flag, type, default, aliases and description."""
    helps = section_help()
    parts: list[str] = []
    current = None
    for spec in flag_specs():
        if spec.section != current:
            current = spec.section
            title = f"`--{current}.*`" if current else "launcher"
            desc = helps.get(current, "set by launchers")
            parts.append(f"\n### {title}: {desc}\n")
            parts.append("| flag | type | default | aliases | description |\n|---|---|---|---|---|")
        aliases = ", ".join(f"`{a}`" for a in spec.aliases + tuple(a for a, _ in spec.const_aliases))
        bounds = ", ".join(f"{BOUNDS[op][0]} {b}" for op, b in spec.bounds)
        desc = spec.help + (f" (range: {bounds})" if bounds else "")
        default = "off" if spec.type is bool and spec.default is False else f"`{default_str(spec.default)}`"
        parts.append(f"| `{spec.flag}` | {_md(spec.type_str())} | {_md(default)} | {aliases} | {_md(desc)} |")
    return "\n".join(parts).lstrip("\n") + "\n"


def render_alias_table() -> str:
    """Markdown: flat (pre-0.11) alias -> dotted flag, sorted by alias."""
    rows = []
    for spec in flag_specs():
        rows += [(a, f"`{spec.flag}`") for a in spec.aliases]
        rows += [(a, f"`{spec.flag} {c}`") for a, c in spec.const_aliases]
    lines = ["| flat alias | same as |", "|---|---|"]
    lines += [f"| `{a}` | {target} |" for a, target in sorted(rows)]
    return "\n".join(lines) + "\n"


_STATUS = {"supported": "supported", "differs": "**supported differently**", "refused": "**refused**"}


def render_parity_table() -> str:
    """Markdown: every OpenRLHF v0.11 train_ppo_ray flag, in v0.11's order, with its status here and the note
    (how it differs, why it is refused), followed by the counts."""
    lines = ["| OpenRLHF v0.11 flag | here | how / why |", "|---|---|---|"]
    lines += [f"| `{flag}` | {_STATUS[p.status]} | {_md(p.note)} |" for flag, p in OPENRLHF_V0_11.items()]
    counts = {s: sum(p.status == s for p in OPENRLHF_V0_11.values()) for s in _STATUS}
    lines.append("")
    lines.append(
        f"{len(OPENRLHF_V0_11)} flags: {counts['supported']} supported, {counts['differs']} supported differently, "
        f"{counts['refused']} refused."
    )
    return "\n".join(lines) + "\n"


_GENERATED = {"flags": render_flag_table, "aliases": render_alias_table, "parity": render_parity_table}


def update_docs(path: str | Path) -> bool:
    """Rewrite the generated blocks of a doc (between `<!-- BEGIN GENERATED: name -->` and
    `<!-- END GENERATED: name -->`). Returns whether the file changed."""
    path = Path(path)
    text = original = path.read_text()
    for name, render in _GENERATED.items():
        pattern = re.compile(rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: {name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"{path} has no '<!-- BEGIN GENERATED: {name} -->' block")
        text = pattern.sub(lambda m: m.group(1) + render() + m.group(2), text)
    if text != original:
        path.write_text(text)
    return text != original


if __name__ == "__main__":  # python -m openrlhf.config.docs docs/cli.md  -> refresh the generated tables
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m openrlhf.config.docs <doc.md>")
    print(("updated " if update_docs(sys.argv[1]) else "up to date: ") + sys.argv[1])
