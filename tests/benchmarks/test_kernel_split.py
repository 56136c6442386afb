"""benchmarks/gpu_sections/kernel_split.py: the FP8 ceiling worked out from two kernel splits (pure arithmetic; the
splits themselves come from torch.profiler on a GPU)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gpu_sections.kernel_split import ceiling, ceiling_line  # noqa: E402

BF16 = {"gemm bf16": 60.0, "attention": 15.0, "elementwise": 20.0, "copy/fill": 5.0}
FP8 = {"gemm fp8": 30.0, "quantize": 6.0, "attention": 15.0, "elementwise": 17.0, "copy/fill": 5.0}


def test_ceiling_is_bf16_time_over_what_fp8_leaves():
    c = ceiling(BF16, FP8, goal=1.5)
    assert c["bf16_kernel_ms"] == 100.0 and c["fp8_kernel_ms"] == 73.0
    assert c["fp8_rest_ms"] == pytest.approx(37.0)  # attention + elementwise + copies of the FP8 call
    assert c["ceiling"] == pytest.approx(100.0 / 37.0)
    assert c["kernel_ratio"] == pytest.approx(100.0 / 73.0)
    assert c["gemm_gain"] == pytest.approx(60.0 / 36.0)  # BF16 GEMMs over FP8 GEMMs + quantizers
    # 1.5x allows 66.7 ms; the rest takes 37, so the FP8 part may take 29.7 ms: 60 / 29.67 of BF16's GEMMs.
    assert c["gemm_gain_needed"] == pytest.approx(60.0 / (100.0 / 1.5 - 37.0))
    # FP8 GEMMs at twice BF16's rate and free quantizers: 37 + 60 / 2 = 67 ms.
    assert c["at_peak"] == pytest.approx(100.0 / 67.0)
    assert "caps the call at 2.70x, and at 1.49x" in ceiling_line("jet_fp8 torch", c)


def test_bf16_gemms_the_fp8_call_keeps_are_not_counted_as_replaced():
    """A GEMM FP8 leaves in BF16 (lm_head) is part of the rest, not of what the FP8 GEMMs replaced."""
    c = ceiling({**BF16, "gemm bf16": 70.0}, {**FP8, "gemm bf16": 10.0})
    assert c["fp8_rest_ms"] == pytest.approx(47.0)
    assert c["gemm_gain"] == pytest.approx(60.0 / 36.0)


def test_a_goal_the_rest_alone_exceeds_is_unreachable():
    c = ceiling(BF16, FP8, goal=3.0)  # 33.3 ms allowed, the rest takes 37
    assert math.isinf(c["gemm_gain_needed"])
    assert "unreachable" in ceiling_line("jet_fp8 torch", c)


def test_a_sections_report_prints_and_records_each_variant(capsys):
    """stack/reference's report of `--kernel-split` (gpu_sections/stack.py), from made-up splits: one record per
    variant and group, one ceiling per FP8 variant with its largest kernels outside the GEMMs."""
    from gpu_sections import stack, timing

    top = [("_rmsnorm_quant_kernel", 1.5, "quantize"), ("elementwise_kernel<add>", 1.0, "elementwise")]
    splits = {"bf16": (BF16, top), "jet_fp8/auto": (FP8, top), "jet_fp8/auto:plainnorm": (FP8, top)}
    before = len(timing.RECORDS)
    stack._report_split(splits, "4 layers", 1.8, "no-grad forward")
    recs = timing.RECORDS[before:]
    del timing.RECORDS[before:]
    groups = [r for r in recs if r["name"] == "kernel_group_ms"]
    ceilings = [r for r in recs if r["name"] == "fp8_ceiling"]
    assert len(groups) == len(BF16) + 2 * len(FP8) and len(ceilings) == 2
    assert ceilings[0]["top_rest_kernels"][0] == ["_rmsnorm_quant_kernel", 1.5, "quantize"]
    assert ceilings[0]["value"] == pytest.approx(100.0 / 37.0, abs=1e-3)
    out = capsys.readouterr().out
    assert "the largest kernels outside the GEMMs" in out and "caps the call at" in out
