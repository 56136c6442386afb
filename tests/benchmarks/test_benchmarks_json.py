"""docs/benchmarks.json is read by tools: every record carries the fields the issue names, well typed."""

from __future__ import annotations

import json
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.json"
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


def _gpu_report():
    import importlib.util
    import sys

    if "gpu_report" in sys.modules:
        return sys.modules["gpu_report"]
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_report.py"
    spec = importlib.util.spec_from_file_location("gpu_report", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_report"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _rec(name, shape, backend, value, ratio=None, **extra):
    return dict(name=name, shape=shape, backend=backend, value=value, unit="x", ratio_vs_bf16=ratio, **extra)


def test_targets_table_reads_each_target_and_says_whether_it_is_met():
    """The one-table summary gpu_bench prints at the end: the issue's targets against a run's records."""
    rows = {line.split(" | ")[0].lstrip("| "): line for line in _gpu_report().targets_table([
        _rec("quant_1x128", "16384x14336", "triton", 3.7, frac_of_copy=0.887),
        _rec("quant_128x1_transposed", "16384x14336", "triton", 2.1, frac_of_copy=0.50),
        _rec("quant_128x1_transposed", "16384x14336", "triton", 2.9, frac_of_copy=0.68),  # a later record wins
        _rec("gemm_geomean_ratio_M_ge_4096", "12 shapes", "torch", 1.562, 1.562),
        _rec("gemm_geomean_ratio_M_ge_4096", "12 shapes", "deep_gemm", 1.762, 1.762),
        _rec("linear_fwd_bwd_geomean_ratio", "M=8192 4 layers deep_gemm_cached", "deep_gemm", 1.23, 1.23),
        _rec("linear_fwd_bwd_geomean_ratio", "M=8192 4 layers torch_cached", "torch", 1.5, 1.5),
        _rec("linear_fwd_bwd_geomean_ratio", "M=8192 4 layers graph", "deep_gemm", 1.458, 1.458),
        _rec("stack_train_tokens_per_s", "4 layers, batch 16 x seq 4096", "jet_fp8 deep_gemm", 113367.0, 1.267),
    ]).splitlines()[2:]}
    assert "| 89% | yes |" in rows["quantizer 1x128 (x, dY), % of copy"]
    assert "| 68% | no |" in rows["quantizer 128x1 written transposed (dY^T), % of copy"]
    assert "not measured in this run" in rows["quantizer 128x128 (weights), % of copy"]
    assert "| 1.562x | no |" in rows["GEMM TFLOP/s vs BF16, M >= 4096, geomean, torch"]
    assert "| 1.762x | yes |" in rows["GEMM TFLOP/s vs BF16, M >= 4096, geomean, deep_gemm"]
    # eager is the `auto` backend's row (the graph record names it), not the faster-looking torch one
    assert "| 1.230x | no |" in rows["FP8 linear fwd+bwd vs BF16, M=8192, 4 layers, eager (auto)"]
    assert "| 1.458x | yes |" in rows["FP8 linear fwd+bwd vs BF16, M=8192, 4 layers, CUDA graph (auto)"]
    assert "| 1.267x | - |" in rows["4-layer stack fwd+bwd+AdamW tokens/s vs BF16 (auto)"]
    assert "not measured" in rows["decode forward, M=64, CUDA graph, vs BF16 (auto)"]


def test_targets_table_from_the_recorded_runs():
    """`gpu_report.py docs/benchmarks.json --targets --run-label ...` prints every target row from the JSON."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu_report.py", str(DOC), "--targets", "--run-label",
         "session 8 run 4,session 8 run 3"],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(lines) == 2 + len(_gpu_report().TARGETS)
    assert "not measured" not in out  # those two runs cover every target
    bad = subprocess.run([sys.executable, "benchmarks/gpu_report.py", str(DOC), "--targets"], cwd=root,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--run-label" in bad.stderr
