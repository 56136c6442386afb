"""memory/* metrics: per-phase allocator peaks and device use on a GPU, host RSS everywhere, maxima over ranks."""

from __future__ import annotations

import torch

from openrlhf.utils.memory import StepMemory


def test_host_rss_follows_an_allocation_and_values_are_reduced_over_ranks():
    calls = []

    def reduce_max(t: torch.Tensor) -> torch.Tensor:  # stands in for the strategy's all-reduce(max)
        calls.append(t.clone())
        return t + 1.0  # a visible change: the returned values must be the reduced ones

    mem = StepMemory(reduce_max)
    mem.begin()
    before = mem.metrics()
    block = torch.ones(96 << 20, dtype=torch.uint8)  # 96 MiB, every page touched
    mem.end_phase("rollout")
    mem.sample_device("rollout_engine_awake")
    during = mem.metrics()
    del block
    assert len(calls) == 2 and calls[0].dtype == torch.float64
    assert set(during) >= {"memory/host_rss_gib", "memory/host_peak_rss_gib"}
    raw_before, raw_during = before["memory/host_rss_gib"] - 1.0, during["memory/host_rss_gib"] - 1.0
    assert raw_during - raw_before >= 0.9 * 96 / 1024, (raw_before, raw_during)
    assert during["memory/host_peak_rss_gib"] >= during["memory/host_rss_gib"] - 1e-6
    if not torch.cuda.is_available():  # no allocator statistics on CPU: host figures only
        assert not any("allocated" in k or "device_used" in k for k in during)


def test_watch_device_catches_a_peak_that_neither_end_of_the_phase_sees():
    """The sampling thread behind memory/<phase>_peak_device_used_gib: the level rises and falls inside the block."""
    import time

    from openrlhf.utils.memory import GiB

    level = [1 * GiB]
    mem = StepMemory(lambda t: t)
    mem.begin()
    with mem.watch_device("train", interval_s=0.005, reader=lambda: level[0]):
        level[0] = 5 * GiB
        time.sleep(0.1)  # twenty sampling intervals
        level[0] = 1 * GiB
    assert mem.metrics()["memory/train_peak_device_used_gib"] == 5.0
    with mem.watch_device("experience"):  # no reader and no GPU: nothing to watch
        pass
    assert "memory/experience_peak_device_used_gib" not in mem.metrics() or torch.cuda.is_available()
