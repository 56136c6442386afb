"""The stack sampler behind the eager decode profile's host table: it must charge time to the function that spends it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _spin(seconds: float) -> int:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def _idle(seconds: float) -> None:
    time.sleep(seconds)


def _work() -> None:
    _spin(0.3)
    _idle(0.1)


def test_time_goes_to_the_function_that_spends_it_and_the_switch_interval_is_restored():
    from host_sampler import StackSampler

    before = sys.getswitchinterval()
    with StackSampler(interval_s=0.001) as s:
        _work()
    assert sys.getswitchinterval() == before
    cum = {k.rsplit(":", 1)[-1]: v for k, v in s.cum_us().items() if "test_host_sampler" in k}
    # _work holds both; _spin three times _idle's time (each is sampled while on the stack, the GIL held or not)
    assert cum["_work"] == pytest.approx(0.4e6, rel=0.25)
    assert cum["_spin"] == pytest.approx(0.3e6, rel=0.25) and cum["_idle"] == pytest.approx(0.1e6, rel=0.4)
    selfs = s.self_us()
    assert max(selfs, key=selfs.get).split(":")[1] == "_spin"  # the innermost frame carries its line number
    assert s.samples > 100 and s.seconds == pytest.approx(0.4, rel=0.25)


class _Outer:
    def forward(self) -> None:
        _Inner().forward()


class _Inner:
    def forward(self) -> None:
        _spin(0.2)


def test_functions_sharing_a_name_are_told_apart_and_never_counted_past_the_wall_time():
    from host_sampler import StackSampler

    with StackSampler(interval_s=0.001) as s:
        _Outer().forward()
    cum = {k.rsplit(":", 1)[-1]: v for k, v in s.cum_us().items() if "test_host_sampler" in k}
    assert cum["_Outer.forward"] == pytest.approx(0.2e6, rel=0.25) and cum["_Inner.forward"] == pytest.approx(0.2e6, rel=0.25)
    # every key, however many of its code objects were on one sample's stack, within the sampled time
    assert max(s.cum_us().values()) <= s.seconds * 1e6 * 1.001


def test_per_step_subtracts_the_shared_work_and_drops_noise():
    from host_sampler import per_step

    long = {"prefill": 1000.0, "decode": 3200.0, "noise": 10.0}
    short = {"prefill": 1000.0, "decode": 0.0, "noise": 12.0}
    assert per_step(long, short, steps=32) == [("decode", 100.0)]
    with pytest.raises(ValueError, match="steps must be > 0"):
        per_step(long, short, steps=0)


def test_keys_name_the_package_path_not_the_install_location():
    from host_sampler import frame_key

    assert frame_key("/opt/venv/lib/python3.12/site-packages/vllm/v1/worker/gpu_model_runner.py", "execute_model", 7) == \
        "vllm/v1/worker/gpu_model_runner.py:execute_model:7"
    assert frame_key("/work/main/jetrl_precision/integrations/engine_linear.py", "__call__") == \
        "jetrl_precision/integrations/engine_linear.py:__call__"
    assert frame_key("/tmp/x.py", "f") == "/tmp/x.py:f"
