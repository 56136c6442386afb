"""plot_engine_ab.py: engine A/B rounds from run records, arms told apart by the switches their shapes name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

SHAPE = "Llama-3.1-8B shape, 16 layers, {p} prompts x 256 + 1024 new tokens, eager{s}"


def _run(tmp_path, stem, ratio, switches="", prompts=256):
    recs = [{"name": "vllm_rollout_tokens_per_s", "shape": SHAPE.format(p=prompts, s=switches), "backend": b, "value": 1.0,
             "ratio_vs_bf16": r, "device": "NVIDIA H100 80GB HBM3"} for b, r in (("bf16", None), ("jet_fp8/torch", ratio))]
    (tmp_path / f"{stem}_x.json").write_text(json.dumps({"records": recs}))


def test_arms_medians_and_the_plot(tmp_path, capsys):
    import plot_engine_ab

    _run(tmp_path, "a1", 0.94)
    _run(tmp_path, "a2", 1.02)
    _run(tmp_path, "a3", 0.93)
    _run(tmp_path, "b1", 0.77, ", JETRL_NATIVE_LINEAR=0")
    _run(tmp_path, "b2", 0.91, ", JETRL_NATIVE_LINEAR=0")
    _run(tmp_path, "c1", 1.25, prompts=64)  # another prompt count: not in the 256-prompt plot
    out = tmp_path / "ab.png"
    plot_engine_ab.main(["a1", "a2", "a3", "b1", "b2", "c1", "--runs-dir", str(tmp_path), "--out", str(out)])
    assert out.stat().st_size > 5000
    text = capsys.readouterr().out
    assert "as shipped: median 0.940 of 3" in text and "JETRL_NATIVE_LINEAR=0: median 0.840 of 2" in text


def test_an_ambiguous_or_missing_run_is_one_clear_line(tmp_path):
    import plot_engine_ab

    _run(tmp_path, "a1", 0.94)
    _run(tmp_path, "a10", 0.95)
    with pytest.raises(SystemExit, match="names 2 run files"):
        plot_engine_ab.main(["a1", "--runs-dir", str(tmp_path), "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match="no jet_fp8/bf16 throughput ratios at 64 prompts"):
        plot_engine_ab.main(["a10", "--prompts", "64", "--runs-dir", str(tmp_path), "--out", str(tmp_path / "x.png")])
