"""gpu_bench.py's section loop on CPU, the sections stubbed. It imports the Triton kernels' modules, so it runs where
Triton imports: `make test-triton` (Triton lives outside the main venv)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.parametrize("sections, expected", [
    ("env,quant", ["copy", ("quant", 3.0)]),
    ("copy,quant,quant", ["copy", ("quant", 3.0), ("quant", 3.0)]),
])
def test_quantizers_share_of_copy_divides_by_this_devices_copy(monkeypatch, tmp_path, sections, expected):
    """`--sections quant` without `copy` measures the copy first: a fixed figure from another card (the H200's
    4.25 TB/s) made an H100's quantizers read 65% of a copy it never ran."""
    import gpu_bench

    seen = []
    monkeypatch.setattr(gpu_bench, "section_env", lambda args: {"gpu": "test"})
    monkeypatch.setattr(gpu_bench, "section_copy", lambda args: seen.append("copy") or 3.0)
    monkeypatch.setattr(gpu_bench, "section_quant", lambda args, copy_bw: seen.append(("quant", copy_bw)))
    monkeypatch.setattr(gpu_bench.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(sys, "argv", ["gpu_bench.py", "--sections", sections, "--out", str(tmp_path / "bench.json")])
    gpu_bench.main()
    assert seen == expected
