"""What the GPU and the host did while a timed section ran: SM clock, board power and utilization (NVML, sampled
from a thread), and the process's CPU time against the wall time.

Two rollouts of the same engine over the same work can differ in speed by more than FP8 gains in them. Whether the
slower one ran at a lower clock (the power cap, heat) or waited on its host (CPU contention, Python) is the first
question; these figures answer it (the trainer's `perf/generate_*` metrics, the rollout benchmarks' passes):

    with Telemetry() as t:
        llm.generate(...)
    t.summary()  # {"wall_s", "host_cpu_s", "host_cpu_share", "sm_mhz_mean", "sm_mhz_min", "watts_mean", "gpu_util_mean",
                 #  "samples", "main_thread_cpus", "load_avg_1m"}

Without NVML (a CPU machine, no pynvml) the GPU fields are None and the host fields are still measured. The host
side also says which CPUs the calling thread ran on during the block (Linux: /proc; a thread that moves between
cores, or runs on a core another process keeps busy, launches its GPU work later) and the machine's load.
"""

from __future__ import annotations

import functools
import os
import statistics
import threading
import time
from pathlib import Path

__all__ = ["Telemetry", "device_handle", "nvml"]


@functools.cache
def nvml():
    """(the pynvml module, a handle for the current CUDA device), or None. vLLM ships its own copy of pynvml."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        try:
            import pynvml
        except ImportError:
            from vllm.third_party import pynvml
        pynvml.nvmlInit()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return pynvml, device_handle(pynvml, str(getattr(props, "uuid", "") or ""), torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - telemetry is context for a figure, never a reason to fail it
        return None


def device_handle(lib, uuid: str, index: int):
    """NVML's handle for the GPU torch calls `index`. NVML numbers the machine's GPUs, torch those CUDA_VISIBLE_DEVICES
    leaves (device 0 of a rank given GPU 3 is NVML's 3), so the GPU is found by its UUID, which both agree on."""
    if uuid:
        name = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        try:
            return lib.nvmlDeviceGetHandleByUUID(name)
        except Exception:  # noqa: BLE001 - older bindings take bytes
            return lib.nvmlDeviceGetHandleByUUID(name.encode())
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible) and visible[index].isdigit():
        return lib.nvmlDeviceGetHandleByIndex(int(visible[index]))
    return lib.nvmlDeviceGetHandleByIndex(index)


class Telemetry:
    """A context manager sampling NVML every `period_s` in a daemon thread while the block runs. Entering it again
    adds to the same figures (the trainer's generate phase may take several calls)."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.clocks: list[int] = []
        self.watts: list[float] = []
        self.util: list[int] = []
        self.cpus: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.wall_s = self.host_cpu_s = self.child_cpu_s = 0.0
        self.load_avg = None

    def _sample(self, nv, stat_path: str | None) -> None:
        while not self._stop.is_set():
            if nv is not None:
                lib, handle = nv
                try:
                    self.clocks.append(lib.nvmlDeviceGetClockInfo(handle, lib.NVML_CLOCK_SM))
                    self.watts.append(lib.nvmlDeviceGetPowerUsage(handle) / 1000)
                    self.util.append(lib.nvmlDeviceGetUtilizationRates(handle).gpu)
                except Exception:  # noqa: BLE001 - a failed read leaves a gap, not a failed benchmark
                    pass
            cpu = _last_cpu(stat_path)
            if cpu is not None:
                self.cpus.add(cpu)
            self._stop.wait(self.period_s)

    def __enter__(self) -> "Telemetry":
        nv = nvml()
        stat = f"/proc/self/task/{threading.get_native_id()}/stat"
        stat = stat if os.path.exists(stat) else None
        if nv is not None or stat is not None:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, args=(nv, stat), daemon=True)
            self._thread.start()
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        self._children0 = _children_cpu()
        return self

    def __exit__(self, *exc) -> bool:
        self.wall_s += time.perf_counter() - self._t0
        self.host_cpu_s += time.process_time() - self._c0
        after = _children_cpu()
        self.child_cpu_s += sum(after[pid] - self._children0[pid] for pid in after.keys() & self._children0.keys())
        self.load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return False

    def summary(self) -> dict:
        def mean(v):
            return round(statistics.fmean(v), 1) if v else None

        return {"wall_s": round(self.wall_s, 3), "host_cpu_s": round(self.host_cpu_s, 3),
                # the process's CPU seconds per wall second: near 1 (or above, with threads) means the host was busy
                "host_cpu_share": round(self.host_cpu_s / self.wall_s, 3) if self.wall_s > 0 else None,
                # the same for the child processes alive throughout (vLLM's engine core, when it runs in its own)
                "child_cpu_share": round(self.child_cpu_s / self.wall_s, 3) if self.wall_s > 0 else None,
                "sm_mhz_mean": mean(self.clocks), "sm_mhz_min": min(self.clocks) if self.clocks else None,
                "watts_mean": mean(self.watts), "gpu_util_mean": mean(self.util), "samples": len(self.clocks),
                "main_thread_cpus": sorted(self.cpus), "load_avg_1m": None if self.load_avg is None else round(self.load_avg, 2)}


    def metrics(self, prefix: str) -> dict[str, float]:
        """The figures as numeric metrics (`<prefix>host_cpu_share`, `sm_mhz`, `gpu_watts`, `gpu_util`), those measured."""
        s = self.summary()
        named = {"host_cpu_share": s["host_cpu_share"], "sm_mhz": s["sm_mhz_mean"], "gpu_watts": s["watts_mean"],
                 "gpu_util": s["gpu_util_mean"]}
        return {prefix + k: float(v) for k, v in named.items() if v is not None}


def _children_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each live child process of this one, by pid; empty without /proc."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, float] = {}
    for path in Path("/proc/self/task").glob("*/children"):
        try:
            pids = [int(v) for v in path.read_text().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            out[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    return out


def _last_cpu(stat_path: str | None) -> int | None:
    """The CPU a thread last ran on: field 39 of its /proc stat (after the parenthesized command name)."""
    if stat_path is None:
        return None
    try:
        with open(stat_path) as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None
