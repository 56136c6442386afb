"""`--profile.step`: the trainer's phases of one step profiled by torch.profiler, one JSON per phase."""

from __future__ import annotations

import json

import torch

from openrlhf.utils.profiling import ProfileSettings, StepProfiler


def _work():
    a = torch.randn(96, 96)
    for _ in range(3):
        a = torch.tanh(a @ a.T / 96)
    return a


def test_only_the_chosen_step_is_profiled(tmp_path):
    prof = StepProfiler(ProfileSettings(step=2, out_dir=str(tmp_path / "p")), rank=0)
    for step in (1, 2, 3):
        prof.begin_step(step)
        with prof.phase("update"):
            _work()
        with prof.phase("weight_sync"):
            pass
    files = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert files == ["step2_rank0_update.json", "step2_rank0_weight_sync.json"]
    got = json.loads((tmp_path / "p" / "step2_rank0_update.json").read_text())
    assert got["step"] == 2 and got["phase"] == "update" and got["wall_s"] > 0
    assert any("mm" in k for k in got["kernels_us"]) and any("tanh" in k for k in got["kernels_us"])
    assert abs(got["kernel_s"] - sum(got["kernels_us"].values()) / 1e6) < 1e-3


def test_off_by_default_writes_nothing(tmp_path):
    prof = StepProfiler(ProfileSettings(step=0, out_dir=str(tmp_path / "p")))
    prof.begin_step(1)
    with prof.phase("update"):
        _work()
    assert not (tmp_path / "p").exists()


def test_trace_is_written_when_asked(tmp_path):
    prof = StepProfiler(ProfileSettings(step=1, out_dir=str(tmp_path), trace=True), rank=3)
    prof.begin_step(1)
    with prof.phase("experience"):
        _work()
    assert (tmp_path / "step1_rank3_experience.trace.json").stat().st_size > 0
    assert (tmp_path / "step1_rank3_experience.json").exists()


def test_a_gpu_profile_records_kernels_only_unless_traced():
    from torch.profiler import ProfilerActivity

    from openrlhf.utils.profiling import profiler_activities

    # Host op events of a whole update take minutes to tabulate; the phase tables need only the kernels.
    assert profiler_activities(cuda=True, trace=False) == [ProfilerActivity.CUDA]
    assert set(profiler_activities(cuda=True, trace=True)) == {ProfilerActivity.CPU, ProfilerActivity.CUDA}
    assert profiler_activities(cuda=False, trace=False) == [ProfilerActivity.CPU]
