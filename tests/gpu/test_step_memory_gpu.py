"""memory/* metrics on a GPU: each phase reports its own allocator peak; device use is sampled."""

from __future__ import annotations

import torch

from openrlhf.utils.memory import GiB, StepMemory


def test_gpu_phase_peaks_are_per_phase():
    mem = StepMemory(lambda t: t)
    mem.begin()
    big = torch.empty(int(2 * GiB), dtype=torch.uint8, device="cuda")
    del big
    mem.end_phase("rollout")
    small = torch.empty(int(0.25 * GiB), dtype=torch.uint8, device="cuda")
    del small
    mem.end_phase("train")
    mem.sample_device("train_engine_asleep")
    m = mem.metrics()
    assert m["memory/rollout_peak_allocated_gib"] >= 2.0 and m["memory/train_peak_allocated_gib"] < 1.0
    assert m["memory/peak_allocated_gib"] == m["memory/rollout_peak_allocated_gib"]
    assert m["memory/train_engine_asleep_device_used_gib"] > 0


def test_gpu_alloc_retries_are_counted_per_step():
    # A cached 3 GiB block cannot serve 3.5 GiB; under a 5 GiB cap the allocator must free its cache and retry.
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_allocated() + 5 * GiB) / total))
    try:
        mem = StepMemory(lambda t: t)
        mem.begin()
        a = torch.empty(int(3 * GiB), dtype=torch.uint8, device="cuda")
        del a
        b = torch.empty(int(3.5 * GiB), dtype=torch.uint8, device="cuda")
        del b
        assert mem.metrics()["memory/alloc_retries"] >= 1
        mem.begin()
        assert mem.metrics()["memory/alloc_retries"] == 0
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_gpu_watch_device_sees_a_transient_peak_the_samples_after_it_miss():
    import time

    mem = StepMemory(lambda t: t)
    mem.begin()
    torch.cuda.empty_cache()
    before = torch.cuda.mem_get_info()
    with mem.watch_device("train"):
        big = torch.empty(int(3 * GiB), dtype=torch.uint8, device="cuda")
        big.fill_(1)
        torch.cuda.synchronize()
        time.sleep(0.2)  # ten sampling intervals
        del big
        torch.cuda.empty_cache()
    mem.sample_device("after")
    m = mem.metrics()
    held_before = (before[1] - before[0]) / GiB
    assert m["memory/train_peak_device_used_gib"] >= held_before + 2.9
    assert m["memory/after_device_used_gib"] < m["memory/train_peak_device_used_gib"] - 2.5
