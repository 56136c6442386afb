"""Prompt datasets for RL: load records from local files, turn them into prompt strings.

Supported sources (all local; there is no dataset hub on our machines):
- a ``.jsonl`` file (one JSON object per line) or a ``.json`` file (a list of objects,
  ``{split: [...]}``, or JSON lines);
- a ``.parquet`` file;
- a folder written by ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``;
- a folder of ``.jsonl``/``.json``/``.parquet`` files. Files whose name or parent folder
  names a split (``train-00000.parquet``, ``data/test.jsonl``) are selected by ``split``;
  if no file names a split, all files are read.

Several sources, comma-separated, are blended (`blend_prompt_records`, --data.prompt_probs).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = [
    "SUPPORTED_FORMATS", "PromptDataError", "load_prompt_records", "blend_prompt_records", "PromptDataset",
    "collate_prompts",
]

SUPPORTED_FORMATS = (".jsonl", ".json", ".parquet", "a datasets.save_to_disk folder", "a folder of jsonl/json/parquet files")
_FILE_EXTS = (".jsonl", ".json", ".parquet")
_SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev", "eval")


class PromptDataError(ValueError):
    """A prompt dataset that cannot be used; the message names the file (and line) and the fix."""


def _unsupported(path: Path, why: str = "") -> PromptDataError:
    return PromptDataError(
        f"unsupported prompt dataset {str(path)!r}{why}; supported: {', '.join(SUPPORTED_FORMATS)} (--data.prompt_dataset)"
    )


def _not_utf8(path: Path, lineno: int, line: bytes, e: UnicodeDecodeError) -> PromptDataError:
    return PromptDataError(
        f"{path}:{lineno}: byte 0x{line[e.start]:02x} at column {e.start + 1} is not UTF-8; re-encode the file as UTF-8 "
        f"(e.g. iconv -f latin1 -t utf-8 {path.name} > fixed.jsonl)"
    )


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise PromptDataError(f"prompt dataset {path} cannot be read ({e.strerror or e}) (--data.prompt_dataset)") from None


def _read_jsonl(path: Path, raw: bytes | None = None) -> list[dict]:
    records = []
    for lineno, line in enumerate((_read_bytes(path) if raw is None else raw).splitlines(), 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _not_utf8(path, lineno, line, e) from None
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise PromptDataError(f"{path}:{lineno}: invalid JSON at column {e.colno} ({e.msg}); each line must be one JSON object") from None
        if not isinstance(obj, dict):
            raise PromptDataError(f"{path}:{lineno}: each line must be a JSON object, got {type(obj).__name__}")
        records.append(obj)
    return records


def _read_json(path: Path, split: str) -> list[dict]:
    raw = _read_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = raw.count(b"\n", 0, e.start) + 1
        line_start = raw.rfind(b"\n", 0, e.start) + 1
        raise _not_utf8(path, lineno, raw[line_start:], UnicodeDecodeError(e.encoding, e.object, e.start - line_start, e.end - line_start, e.reason)) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return _read_jsonl(path, raw)  # JSON lines with a .json extension (or broken JSON: named by line there)
    named: list[str] = []
    if isinstance(obj, dict):
        named = sorted(k for k, v in obj.items() if k in _SPLIT_NAMES and isinstance(v, list))
        if named and split not in named:
            raise PromptDataError(f"split {split!r} not in {str(path)!r}; available splits: {named} (--data.prompt_split)")
        if isinstance(obj.get(split), list):
            obj = obj[split]
        elif isinstance(obj.get("data"), list):
            obj = obj["data"]
        elif obj and all(isinstance(v, list) for v in obj.values()) and len({len(v) for v in obj.values()}) == 1:
            keys = list(obj)  # column-oriented: {"input": [...], "label": [...]}
            obj = [dict(zip(keys, row)) for row in zip(*obj.values())]
        else:
            obj = [obj]
    if not isinstance(obj, list) or not all(isinstance(r, dict) for r in obj):
        raise PromptDataError(f"{path}: expected a list of JSON objects (or one object per line)")
    if not named:
        err = _single_file_split_error(path, split)
        if err is not None:
            raise err
    return obj


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        raise PromptDataError(f"{path}: not a readable parquet file ({e}); re-export it, or convert it to .jsonl") from None


def _read_file(path: Path, split: str) -> list[dict]:
    ext = path.suffix.lower()
    if ext == ".jsonl":
        return _read_jsonl(path)
    if ext == ".json":
        return _read_json(path, split)
    if ext == ".parquet":
        return _read_parquet(path)
    raise _unsupported(path)


def _file_split(path: Path, root: Path) -> str | None:
    """The split a data file belongs to, from its name (train-0000.parquet) or a parent folder."""
    rel = path.relative_to(root)
    names = [p.lower() for p in rel.parts[:-1]] + [rel.stem.lower()]
    for name in reversed(names):
        head = re.split(r"[-_.]", name)[0]
        if head in _SPLIT_NAMES:
            return head
    return None


def _read_folder(path: Path, split: str) -> list[dict]:
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except (OSError, ValueError, FileNotFoundError) as e:
            raise PromptDataError(f"{path}: not a readable datasets.save_to_disk folder ({type(e).__name__}: {e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise PromptDataError(f"split {split!r} not in {str(path)!r}; available splits: {sorted(ds)} (--data.prompt_split)")
            ds = ds[split]
        return ds.to_list()
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _FILE_EXTS and not p.name.startswith("."))
    if not files:
        raise _unsupported(path, ": the folder holds no .jsonl/.json/.parquet file")
    splits = {p: _file_split(p, path) for p in files}
    found = {s for s in splits.values() if s is not None}
    if found:
        chosen = [p for p in files if splits[p] == split]
        if not chosen:
            raise PromptDataError(f"no {split!r} files in {str(path)!r}; splits found: {sorted(found)} (--data.prompt_split)")
    elif split != "train":
        raise PromptDataError(
            f"split {split!r} asked of {str(path)!r}, whose files name no split (they count as 'train'): drop "
            "--data.prompt_split, or name the files by split (train.jsonl, test.jsonl)"
        )
    else:
        chosen = files
    records: list[dict] = []
    for p in chosen:
        records.extend(_read_file(p, split))
    return records


def _single_file_split_error(path: Path, split: str) -> PromptDataError | None:
    """A single .jsonl/.parquet file (or a .json list) holds one split, `train` (or the one its name says)."""
    if split == "train" or _file_split(path, path.parent) == split:
        return None
    return PromptDataError(
        f"split {split!r} asked of {str(path)!r}, a single file without splits (it counts as 'train'): drop "
        "--data.prompt_split, or point --data.prompt_dataset at a folder (or .json file) that holds that split"
    )


def _read_records(p: Path, split: str) -> list[dict]:
    if p.is_dir():
        return _read_folder(p, split)
    if p.suffix.lower() in (".jsonl", ".parquet"):
        err = _single_file_split_error(p, split)
        if err is not None:
            raise err
    return _read_file(p, split)


def load_prompt_records(
    path: str,
    split: str = "train",
    max_samples: int | None = None,
    *,
    flags: tuple[str, str] = ("--data.prompt_dataset", "--data.prompt_split"),
) -> list[dict]:
    """Read prompt records (dicts) from a local file or folder; see the module docstring.

    `flags` name the dataset and split flags in error messages (the eval set passes its own).
    """
    try:
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(
                f"prompt dataset {str(path)!r} does not exist (--data.prompt_dataset); pass a local "
                f"{'/'.join(_FILE_EXTS)} file or a datasets folder (the hub is not reachable here)"
            )
        records = _read_records(p, split)
        if not records:
            raise PromptDataError(f"prompt dataset {str(path)!r} holds no records (--data.prompt_dataset): point it at a file with prompts")
    except (PromptDataError, FileNotFoundError) as e:
        if flags == ("--data.prompt_dataset", "--data.prompt_split"):
            raise
        raise type(e)(str(e).replace("--data.prompt_dataset", flags[0]).replace("--data.prompt_split", flags[1])) from None
    if max_samples is not None:
        if max_samples < 0:
            raise PromptDataError(f"max_samples must be >= 0, got {max_samples} (--data.max_samples)")
        records = records[: int(max_samples)]
    return records


def blend_prompt_records(
    spec: str, probs: str | None = None, split: str = "train", max_samples: int | None = None, seed: int = 42,
    *, flags: tuple[str, str] = ("--data.prompt_dataset", "--data.prompt_split"),
) -> list[dict]:
    """Records of one source, or of several comma-separated ones (`a.jsonl,b.parquet`), as OpenRLHF blends them:
    each source cut to `max_samples`; without `probs` concatenated, with `probs` (--data.prompt_probs) drawn at
    those rates by `datasets.interleave_datasets` (seeded; the "all_exhausted" strategy repeats the smaller
    sources until every source has been used once); then cut to `max_samples` again."""
    sources = [s.strip() for s in spec.split(",") if s.strip()]
    if len(sources) <= 1:
        return load_prompt_records(spec.strip(), split, max_samples, flags=flags)
    parts = [load_prompt_records(src, split, max_samples, flags=flags) for src in sources]
    if probs is None:
        records = [r for part in parts for r in part]
    else:
        from datasets import Dataset, interleave_datasets

        from openrlhf.config.validation import parse_probs

        # Interleave row indices, not the records: sources may differ in their other columns.
        index = [Dataset.from_dict({"src": [i] * len(part), "row": list(range(len(part)))}) for i, part in enumerate(parts)]
        mixed = interleave_datasets(index, probabilities=parse_probs(probs, len(parts)), seed=seed, stopping_strategy="all_exhausted")
        records = [parts[i][j] for i, j in zip(mixed["src"], mixed["row"])]
    return records[: int(max_samples)] if max_samples is not None else records


def _missing_key(kind: str, key: str, flag: str, index: int, record: dict) -> KeyError:
    return KeyError(
        f"prompt record {index} has no {kind} key {key!r}; its keys are {sorted(record)}. "
        f"Set {flag} to one of them."
    )


class PromptDataset(torch.utils.data.Dataset):
    """Prompts (and optional reference labels) ready for the rollout engine.

    Each item is ``{"prompt": str, "label": str | None, "index": int}`` where ``index`` is the
    record's position in ``records`` (stable across resumes). The prompt is built as:
    the first ``{}`` of ``input_template`` replaced by the input, if a template is given, then,
    with ``apply_chat_template``, wrapped as one user turn with the tokenizer's chat template
    (``add_generation_prompt=True``). An input that is already a list of chat messages is
    passed to the chat template as is. With ``max_prompt_len`` (tokens), longer prompts are
    dropped; ``num_dropped`` counts them.
    """

    def __init__(
        self,
        records: Sequence[dict],
        tokenizer: Any,
        input_key: str = "input",
        label_key: str | None = None,
        apply_chat_template: bool = False,
        input_template: str | None = None,
        max_prompt_len: int | None = None,
    ) -> None:
        super().__init__()
        if input_template is not None and "{}" not in input_template:
            raise PromptDataError(f"--data.input_template must contain '{{}}' where the input goes, got {input_template!r}")
        if (apply_chat_template or max_prompt_len is not None) and tokenizer is None:
            raise ValueError("a tokenizer is required for apply_chat_template / max_prompt_len")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise PromptDataError(
                "--data.apply_chat_template is set but the tokenizer has no chat template; "
                "drop the flag or use --data.input_template"
            )
        self.items: list[dict] = []
        self.num_dropped = 0
        for i, rec in enumerate(records):
            if not isinstance(rec, dict):
                raise TypeError(f"prompt record {i} is a {type(rec).__name__}, expected a dict")
            if input_key not in rec:
                raise _missing_key("input", input_key, "--data.input_key", i, rec)
            label = None
            if label_key is not None:
                if label_key not in rec:
                    raise _missing_key("label", label_key, "--data.label_key", i, rec)
                label = None if rec[label_key] is None else str(rec[label_key])
            prompt = self._build_prompt(rec[input_key], tokenizer, apply_chat_template, input_template)
            if max_prompt_len is not None and len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) > max_prompt_len:
                self.num_dropped += 1
                continue
            self.items.append({"prompt": prompt, "label": label, "index": i})
        if records and not self.items:
            raise PromptDataError(
                f"all {len(records)} prompts are longer than {max_prompt_len} tokens, the prompt budget --data.max_len leaves "
                "(minus --rollout.max_new_tokens): raise --data.max_len or shorten the prompts"
            )

    @staticmethod
    def _build_prompt(value: Any, tokenizer: Any, apply_chat_template: bool, input_template: str | None) -> str:
        if isinstance(value, list) and all(isinstance(m, dict) for m in value):
            if not apply_chat_template:
                raise PromptDataError("the input is a list of chat messages; set --data.apply_chat_template")
            messages = value
        else:
            text = str(value)
            if input_template is not None:
                text = input_template.replace("{}", text, 1)
            if not apply_chat_template:
                return text
            messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> dict:
        return self.items[idx]


def collate_prompts(batch: Sequence[dict]) -> dict[str, list]:
    """DataLoader collate_fn: a dict of lists (labels may be None, which default_collate rejects)."""
    return {
        "prompt": [b["prompt"] for b in batch],
        "label": [b["label"] for b in batch],
        "index": [b["index"] for b in batch],
    }
