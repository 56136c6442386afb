"""Checkpoint integrity: checksums written at save and verified at load, and a `latest` pointer
that only ever names a complete, verified checkpoint.

A DeepSpeed checkpoint is a folder `<ckpt_dir>/<tag>/` of shard files plus `<ckpt_dir>/latest`
(the tag to resume from). The strategy writes a new checkpoint into `<tag>.partial/`, records a
SHA-256 of every file in `<tag>.partial/CHECKSUMS.json`, renames the folder to `<tag>/`, and only
then points `latest` at it (atomically). A run killed mid-save leaves `latest` on the previous
checkpoint; a flipped byte on disk is found before a single weight is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "checkpoint_files",
    "hash_files",
    "write_manifest",
    "manifest_entries",
    "verify_manifest",
    "read_latest",
    "write_latest",
    "step_tags",
    "stale_tags",
    "folder_bytes",
]

MANIFEST = "CHECKSUMS.json"
_TAG = re.compile(r"^global_step(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or found; the message names the file and what to do."""


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync_write(path: Path, text: str) -> None:
    """Write `text` to `path` atomically: a temporary file, fsync, then rename over the target."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint_files(tag_dir: Path) -> list[str]:
    """Paths (relative to `tag_dir`) of every file a manifest covers."""
    tag_dir = Path(tag_dir)
    return sorted(str(p.relative_to(tag_dir)) for p in tag_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def hash_files(tag_dir: Path, rels: list[str]) -> dict[str, dict]:
    """Manifest entries ({"sha256", "bytes"}) of these files: ranks each hash their share of a checkpoint."""
    tag_dir = Path(tag_dir)
    return {rel: {"sha256": _sha256(tag_dir / rel), "bytes": (tag_dir / rel).stat().st_size} for rel in rels}


def write_manifest(tag_dir: Path, entries: dict[str, dict] | None = None) -> dict[str, dict]:
    """Write `tag_dir/CHECKSUMS.json` from `entries` (default: hash every file here); returns the entries."""
    tag_dir = Path(tag_dir)
    if entries is None:
        entries = hash_files(tag_dir, checkpoint_files(tag_dir))
    if not entries:
        raise CheckpointError(f"checkpoint folder {tag_dir} is empty after saving: the save failed (see the log above)")
    _fsync_write(tag_dir / MANIFEST, json.dumps({"algorithm": "sha256", "files": dict(sorted(entries.items()))}, indent=1))
    return entries


def manifest_entries(tag_dir: Path) -> dict[str, dict] | None:
    """The manifest's entries, None without one; an unreadable manifest raises CheckpointError."""
    manifest = Path(tag_dir) / MANIFEST
    if not manifest.is_file():
        return None
    try:
        entries = json.loads(manifest.read_text())["files"]
        if not isinstance(entries, dict):
            raise TypeError("'files' is not a mapping")
        return entries
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest} is unreadable ({type(e).__name__}: {e})") from None


def verify_manifest(tag_dir: Path, rels: list[str] | None = None) -> list[str] | None:
    """Every way the files under `tag_dir` (or just `rels`) differ from its manifest (empty: verified),
    or None without a manifest."""
    tag_dir = Path(tag_dir)
    try:
        entries = manifest_entries(tag_dir)
    except CheckpointError as e:
        return [str(e)]
    if entries is None:
        return None
    problems = []
    for rel in entries if rels is None else rels:
        want, p = entries[rel], tag_dir / rel
        if not p.is_file():
            problems.append(f"{p} is missing")
        elif p.stat().st_size != want["bytes"]:
            problems.append(f"{p} has {p.stat().st_size} bytes, {want['bytes']} when saved")
        elif _sha256(p) != want["sha256"]:
            problems.append(f"{p} has changed since it was saved (sha256 differs from {MANIFEST})")
    return problems


def read_latest(ckpt_dir: Path, name: str = "latest") -> str | None:
    """The tag `ckpt_dir/latest` (or `ckpt_dir/<name>`) names, or None when there is no such file."""
    latest = Path(ckpt_dir) / name
    if not latest.is_file():
        return None
    try:
        tag = latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{latest} cannot be read ({type(e).__name__}: {e}); delete it to start fresh") from None
    if not tag or "/" in tag or tag in (".", ".."):
        raise CheckpointError(f"{latest} holds {tag!r}, not a checkpoint tag such as global_step10; fix or delete it")
    return tag


def write_latest(ckpt_dir: Path, tag: str) -> None:
    _fsync_write(Path(ckpt_dir) / "latest", tag)


def step_tags(ckpt_dir: Path) -> list[str]:
    """Complete `global_step<N>` folders in `ckpt_dir`, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and _TAG.match(p.name)]
    return sorted(tags, key=lambda t: int(_TAG.match(t).group(1)))


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def stale_tags(ckpt_dir: Path, keep: str, max_num: int, max_gb: float | None = None) -> list[str]:
    """The checkpoints to remove, oldest first, so that at most `max_num` remain and (with `max_gb`,
    --ckpt.max_mem) they take at most that many GiB together; `keep` (the one just saved) is never removed."""
    tags = step_tags(ckpt_dir)
    sizes = {t: folder_bytes(Path(ckpt_dir) / t) for t in tags}
    budget = None if max_gb is None else max_gb * 2**30
    remove: list[str] = []
    for tag in tags:  # oldest first
        left = [t for t in tags if t not in remove]
        over_num = max_num > 0 and len(left) > max_num
        over_mem = budget is not None and sum(sizes[t] for t in left) > budget
        if not (over_num or over_mem):
            break
        if tag != keep:
            remove.append(tag)
    return remove
