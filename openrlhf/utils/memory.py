"""Memory of one training step, phase by phase, for the `memory/*` metrics.

On a GPU, torch's allocator peak is read and reset at the end of each phase (rollout, experience,
train, sync), so each phase reports its own peak; the device-wide use (`cudaMemGetInfo`: what the
allocator reserved plus what lives outside it, such as a sleeping vLLM engine's pool, NCCL buffers and
CUDA graphs) is sampled at chosen points, e.g. with the rollout engine awake and asleep. Everywhere the
host process's resident memory is reported too. `memory/alloc_retries` counts the allocator's retries in the
step: each one frees every cached block and synchronizes the device, the silent cost of running near capacity.
Every value is the maximum over ranks.

The allocator's peak counts every block it handed out, including a sleeping vLLM engine's: sleep mode releases
their pages but torch still counts the blocks, so with a colocated engine that peak can exceed the GPU. What the
GPU really held at its fullest during a phase comes from `watch_device(phase)`: a thread samples the device-wide
use every 20 ms (`memory/<phase>_peak_device_used_gib`; a peak shorter than that can be missed).
"""

from __future__ import annotations

import contextlib
import resource
import threading
from typing import Callable, Iterator

import torch

__all__ = ["StepMemory"]

GiB = float(1 << 30)


def _host_rss_bytes() -> float:
    try:
        import psutil

        return float(psutil.Process().memory_info().rss)
    except ImportError:  # psutil comes with DeepSpeed; without it, read Linux's statm
        with open("/proc/self/statm") as f:
            return float(f.read().split()[1]) * resource.getpagesize()


def _device_used_reader(device: int) -> Callable[[], float]:
    """A function giving the bytes in use on the device by any process: NVML where torch can reach it (no CUDA call
    from the sampling thread), else the CUDA runtime's free/total."""
    try:
        torch.cuda.device_memory_used(device)
        return lambda: float(torch.cuda.device_memory_used(device))
    except Exception:  # noqa: BLE001 - no NVML binding (pynvml) here
        def runtime_view() -> float:
            free, total = torch.cuda.mem_get_info(device)
            return float(total - free)

        return runtime_view


class StepMemory:
    """Collects `memory/<phase>_peak_allocated_gib`, `memory/<point>_device_used_gib`,
    `memory/<phase>_peak_device_used_gib` and host RSS for one step.

    `reduce_max(tensor)` returns the element-wise maximum over ranks (the strategy's all_reduce)."""

    def __init__(self, reduce_max: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.reduce_max = reduce_max
        self.cuda = torch.cuda.is_available()
        self.values: dict[str, float] = {}
        self._retries_at_begin = 0

    def _alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))

    def begin(self) -> None:
        self.values = {}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self._retries_at_begin = self._alloc_retries()

    def end_phase(self, phase: str) -> None:
        """The allocator's peak since the previous phase ended (or `begin`)."""
        if self.cuda:
            self.values[f"memory/{phase}_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
            torch.cuda.reset_peak_memory_stats()

    @contextlib.contextmanager
    def watch_device(self, phase: str, interval_s: float = 0.02, reader: Callable[[], float] | None = None) -> Iterator[None]:
        """The largest device-wide use sampled while the block runs, as `memory/<phase>_peak_device_used_gib`.

        `reader` gives the bytes in use (default: the current GPU's, and nothing is watched without one)."""
        if reader is None and not self.cuda:
            yield
            return
        used = reader or _device_used_reader(torch.cuda.current_device())
        peak = [used()]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(interval_s):
                peak[0] = max(peak[0], used())

        thread = threading.Thread(target=sample, name=f"memory-watch-{phase}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            peak[0] = max(peak[0], used())
            self.values[f"memory/{phase}_peak_device_used_gib"] = peak[0] / GiB

    def sample_device(self, point: str) -> None:
        """Device memory in use right now, by anything in any process (what nvidia-smi shows)."""
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            self.values[f"memory/{point}_device_used_gib"] = (total - free) / GiB

    def metrics(self) -> dict[str, float]:
        out = dict(self.values)
        peaks = [v for k, v in out.items() if k.endswith("_peak_allocated_gib")]
        if peaks:
            out["memory/peak_allocated_gib"] = max(peaks)
        if self.cuda:
            out["memory/alloc_retries"] = float(self._alloc_retries() - self._retries_at_begin)
        rss = _host_rss_bytes() / GiB
        out["memory/host_rss_gib"] = rss
        # ru_maxrss is KiB on Linux, and the kernel updates that high-water mark lazily: never below the current RSS.
        out["memory/host_peak_rss_gib"] = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB, rss)
        keys = sorted(out)
        reduced = self.reduce_max(torch.tensor([out[k] for k in keys], dtype=torch.float64))
        return {k: float(v) for k, v in zip(keys, reduced.tolist())}
