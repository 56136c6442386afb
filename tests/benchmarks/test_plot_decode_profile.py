"""plot_decode_profile.py: a decode-profile run's records become each recipe's kernel groups beside its wall time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _profiles(unprofiled: bool = True) -> list[dict]:
    """Two recipes' decode profiles as `vllm_decode_profile.job` returns them."""
    return [{"recipe": r, "mode": "eager", "layers": 16, "prompts": 256, "prompt_len": 256, "steps": 32, "kernels_captured": 30,
            "decode_step_wall_us": w, "decode_step_kernel_us": k, "top_kernels_us": [["x", 1.0, "gemm"]], "date": "2026-12-06",
            "categories_us": {"gemm": g, "attention": 2000.0, "norm": 100.0, "weird": 50.0, **({"quantize": 230.0} if r != "bf16" else {})},
            **({"decode_step_wall_unprofiled_us": w - 500} if unprofiled else {})}
           for r, w, k, g in (("bf16", 14000.0, 6000.0, 3600.0), ("jet_fp8", 13500.0, 5100.0, 2500.0))]


def test_groups_walls_and_the_plot(tmp_path, capsys):
    import plot_decode_profile as pdp
    import vllm_decode_profile as vdp

    run = vdp.record(_profiles(), "NVIDIA H100 80GB HBM3", "cmd", runs_dir=tmp_path)
    times = pdp.step_times(json.loads(run.read_text()))
    assert times["jet_fp8"]["groups"] == {"gemm": 2500.0, "attention": 2000.0, "norm": 100.0, "other": 50.0, "quantize": 230.0}
    assert times["bf16"]["wall"] == 13500.0 and times["bf16"]["wall_source"] == "no profiler"
    out = tmp_path / "step.png"
    pdp.main([run.stem, "--runs-dir", str(tmp_path), "--out", str(out)])
    assert out.stat().st_size > 5000
    assert "jet_fp8: wall 13000 us (no profiler), kernels 4880 us" in capsys.readouterr().out


def test_a_run_without_the_unprofiled_wall_uses_the_profiled_one_and_a_bad_stem_is_one_line(tmp_path):
    import plot_decode_profile as pdp
    import vllm_decode_profile as vdp

    times = pdp.step_times(json.loads(vdp.record(_profiles(unprofiled=False), "NVIDIA H200", "cmd", runs_dir=tmp_path).read_text()))
    assert times["jet_fp8"]["wall"] == 13500.0 and times["jet_fp8"]["wall_source"] == "under the profiler"
    with pytest.raises(SystemExit, match="'nope' names 0 run files"):
        pdp.main(["nope", "--runs-dir", str(tmp_path), "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match="no wall time or kernel groups for bf16"):
        pdp.step_times([{"name": "vllm_rollout_tokens_per_s", "backend": "bf16", "shape": "s", "value": 1.0}])
