"""Where one training step's time goes, phase by phase: torch.profiler around the trainer's phases of one step.

`--profile.step N` profiles step N's experience (old log-probs, reference, critic), update and weight-sync phases.
Each phase writes `<dir>/step<N>_rank<r>_<phase>.json`: its wall time, the device time of every kernel (on CPU, the
ops' own time), and how long the device sat idle. `--profile.trace` also writes a Chrome trace per phase
(tens of MB per profiled second). The rollout engine's generation is not profiled here: vLLM has its own profiler.

On a GPU only device activity is recorded unless a trace is asked for: the host-side op events of a large update
(millions of them) took torch.profiler minutes to turn into tables, longer than the step itself.

    profiler = StepProfiler(ProfileSettings(step=2, out_dir="ckpt/profile"), rank=0)
    profiler.begin_step(2)
    with profiler.phase("update"):
        ...
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["ProfileSettings", "StepProfiler", "kernel_times", "profiler_activities"]

logger = logging.getLogger(__name__)

TOP_KERNELS = 300  # kernels kept per phase file, by device time; the rest are summed into "(other kernels)"


def _device_times_raw(prof) -> dict[str, float] | None:
    """Device us per kernel name read from the profiler's raw events, or None where torch does not expose them.

    `key_averages()` builds a Python object per event first: about 40 s for the ~700K kernels of one 16-layer
    update, against about a second here."""
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:
        return None
    from torch.autograd import DeviceType

    out: dict[str, float] = {}
    for ev in events:
        if ev.device_type() == DeviceType.CUDA:
            name = ev.name()
            out[name] = out.get(name, 0.0) + ev.duration_ns() / 1e3
    return out


def kernel_times(prof, cuda: bool) -> dict[str, float]:
    """Device us per kernel name in a finished torch.profiler run; on CPU, the ops' own time."""
    if cuda and (raw := _device_times_raw(prof)) is not None:
        return raw
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if cuda:
            us = getattr(ev, "device_time_total", None)
            us = getattr(ev, "cuda_time_total", 0.0) if us is None else us
            keep = us and "CUDA" in str(getattr(ev, "device_type", ""))
        else:
            us, keep = ev.self_cpu_time_total, ev.self_cpu_time_total > 0
        if keep:
            out[ev.key] = out.get(ev.key, 0.0) + float(us)
    return out


def profiler_activities(cuda: bool, trace: bool) -> list:
    """What torch.profiler records: the device's kernels on a GPU (plus host ops for a trace), host ops on CPU."""
    from torch.profiler import ProfilerActivity

    if not cuda:
        return [ProfilerActivity.CPU]
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if trace else [ProfilerActivity.CUDA]


@dataclass(frozen=True)
class ProfileSettings:
    step: int = 0  # 0: off
    out_dir: str = "profile"
    trace: bool = False


class StepProfiler:
    """Profiles the named phases of one step; a no-op context in every other step."""

    def __init__(self, settings: ProfileSettings, rank: int = 0) -> None:
        self.settings, self.rank = settings, rank
        self._active = False

    def begin_step(self, step: int) -> None:
        """`step` is the 1-based number of the step about to run."""
        self._active = self.settings.step > 0 and step == self.settings.step
        if self._active:
            Path(self.settings.out_dir).mkdir(parents=True, exist_ok=True)
            if self.rank == 0:
                logger.info("profiling step %d's trainer phases into %s", step, self.settings.out_dir)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self._active:
            yield
            return
        from torch.profiler import profile

        cuda = torch.cuda.is_available()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        with profile(activities=profiler_activities(cuda, self.settings.trace)) as prof:
            t0 = time.perf_counter()
            yield
            sync()
            wall = time.perf_counter() - t0
        self._write(name, prof, wall, cuda)

    def _write(self, name: str, prof, wall_s: float, cuda: bool) -> None:
        t0 = time.perf_counter()
        per_kernel = sorted(kernel_times(prof, cuda).items(), key=lambda kv: -kv[1])
        device_us = sum(us for _, us in per_kernel)
        kept = dict(per_kernel[:TOP_KERNELS])
        rest = sum(us for _, us in per_kernel[TOP_KERNELS:])
        if rest:
            kept["(other kernels)"] = rest
        stem = Path(self.settings.out_dir) / f"step{self.settings.step}_rank{self.rank}_{name}"
        out = {"step": self.settings.step, "rank": self.rank, "phase": name, "device": torch.cuda.get_device_name() if cuda else "cpu",
               "wall_s": wall_s, "kernel_s": device_us / 1e6, "idle_s": max(0.0, wall_s - device_us / 1e6),
               "kernels_us": {k: round(v, 1) for k, v in kept.items()}}
        stem.with_suffix(".json").write_text(json.dumps(out, indent=1))
        if self.settings.trace:
            prof.export_chrome_trace(str(stem) + ".trace.json")
        if self.rank == 0:
            logger.info("profile of step %d, %s: %.2f s wall, %.2f s in kernels -> %s (%.1f s to write)", self.settings.step,
                        name, wall_s, device_us / 1e6, stem.with_suffix(".json"), time.perf_counter() - t0)
