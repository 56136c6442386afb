"""openrlhf/utils/telemetry.py: what a timed section's GPU and host did, with NVML read from a thread."""

from __future__ import annotations

import os
import time

from openrlhf.utils import telemetry


class _FakeNvml:
    """NVML as pynvml exposes it, reading a clock that drops halfway through and a fixed power and load."""

    NVML_CLOCK_SM = 0

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def nvmlDeviceGetClockInfo(self, handle, which):
        return 1980 if time.perf_counter() - self.t0 < 0.15 else 1500

    def nvmlDeviceGetPowerUsage(self, handle):
        return 690_000  # milliwatts

    def nvmlDeviceGetUtilizationRates(self, handle):
        return type("Util", (), {"gpu": 100})()


def test_samples_the_gpu_while_the_block_runs_and_the_hosts_cpu_time(monkeypatch):
    monkeypatch.setattr(telemetry, "nvml", lambda: (_FakeNvml(), "handle"))
    with telemetry.Telemetry(period_s=0.01) as t:
        # The host stays busy for at least 0.3 s and until ten samples are in, the last after the clock drop: a
        # loaded CI machine may starve the sampler thread of the GIL, so a fixed span can hold fewer samples.
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 30 and not (
                time.perf_counter() - t0 >= 0.3 and len(t.clocks) >= 10 and t.clocks[-1] == 1500):
            pass
    s = t.summary()
    assert s["samples"] >= 10 and s["sm_mhz_min"] == 1500 and 1500 < s["sm_mhz_mean"] < 1980
    assert s["watts_mean"] == 690.0 and s["gpu_util_mean"] == 100.0
    assert s["wall_s"] >= 0.3 and s["host_cpu_share"] > 0.2  # a loaded machine may share the core
    # the busy thread was seen on at least one of this machine's CPUs (Linux /proc), and the load is known
    assert s["main_thread_cpus"] and set(s["main_thread_cpus"]) <= set(range(os.cpu_count()))
    assert s["load_avg_1m"] >= 0


def test_without_nvml_only_the_host_is_measured(monkeypatch):
    monkeypatch.setattr(telemetry, "nvml", lambda: None)
    with telemetry.Telemetry() as t:
        time.sleep(0.1)  # the host idle: its CPU share is near zero
    s = t.summary()
    assert s["sm_mhz_mean"] is None and s["watts_mean"] is None and s["samples"] == 0
    assert s["wall_s"] >= 0.1 and s["host_cpu_share"] < 0.2


def test_entered_twice_adds_up_and_gives_metrics(monkeypatch):
    """The trainer's generate phase may call the engine several times (dynamic filtering): one set of figures."""
    monkeypatch.setattr(telemetry, "nvml", lambda: (_FakeNvml(), "handle"))
    t = telemetry.Telemetry(period_s=0.01)
    for _ in range(2):
        with t:
            time.sleep(0.05)
    s = t.summary()
    assert s["wall_s"] >= 0.1 and s["samples"] >= 4
    m = t.metrics("perf/generate_")
    assert set(m) == {"perf/generate_host_cpu_share", "perf/generate_sm_mhz", "perf/generate_gpu_watts", "perf/generate_gpu_util"}
    assert m["perf/generate_sm_mhz"] == 1980.0 and m["perf/generate_gpu_watts"] == 690.0
    monkeypatch.setattr(telemetry, "nvml", lambda: None)
    with telemetry.Telemetry() as host_only:
        pass
    assert set(host_only.metrics("p/")) <= {"p/host_cpu_share"}  # no GPU figures without NVML


def test_the_gpu_is_found_by_uuid_not_by_torchs_index(monkeypatch):
    """torch's device 0 of a process given GPU 3 is NVML's GPU 3: a handle by torch's index would read another GPU."""

    class Lib:
        def nvmlDeviceGetHandleByUUID(self, name):
            return ("uuid", name)

        def nvmlDeviceGetHandleByIndex(self, i):
            return ("index", i)

    lib = Lib()
    assert telemetry.device_handle(lib, "8f0c2a1e-0000-1111-2222-333344445555", 0) == ("uuid", "GPU-8f0c2a1e-0000-1111-2222-333344445555")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert telemetry.device_handle(lib, "", 1) == ("index", 5)  # no UUID from torch: the visible list maps it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    assert telemetry.device_handle(lib, "", 0) == ("index", 0)
