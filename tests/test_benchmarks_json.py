"""docs/benchmarks.json is read by tools: every record carries the fields the issue names, well typed."""

from __future__ import annotations

import json
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.json"
REQUIRED = {"name": str, "shape": str, "backend": str, "unit": str, "command": str, "date": str}


def test_every_record_is_complete_and_typed():
    records = json.loads(DOC.read_text())
    assert isinstance(records, list) and records
    for i, r in enumerate(records):
        where = f"record {i} ({r.get('name')!r})"
        for key, typ in REQUIRED.items():
            assert isinstance(r.get(key), typ) and r[key], f"{where}: {key} missing or not a {typ.__name__}"
        assert isinstance(r.get("value"), (int, float)) and not isinstance(r["value"], bool), f"{where}: value"
        assert "ratio_vs_bf16" in r and (r["ratio_vs_bf16"] is None or isinstance(r["ratio_vs_bf16"], (int, float))), where
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]), f"{where}: date {r['date']!r}"
