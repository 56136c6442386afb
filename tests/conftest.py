"""Shared fixtures for the tests: deterministic seeding, data with outliers, SQNR, tiny models.

The helpers live in tests/precision_testutil.py (import them from there, not from
`conftest`: tests/gpu/ has its own conftest, so that module name is ambiguous).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from pathlib import Path

import pytest
import torch

from precision_testutil import outlier_data, seed_everything, sqnr_db, tiny_causal_lm

# Tests must not reach the model hub or spend threads the 2-core CI machine does not have.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# DeepSpeed JIT-builds its CPU ops into torch's extensions cache, keyed by name only: two virtualenvs on one
# machine would rebuild each other's copy (and wait on each other's build lock). One cache per interpreter.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


_ray_turn = {"depth": 0, "file": None}


@contextlib.contextmanager
def _one_ray_at_a_time(base: Path):
    """Tests that start Ray take turns across pytest-xdist workers (a lock file beside their temp folders):
    two Ray clusters with their actors side by side outgrew the 24 GiB CI machine (Ray's memory monitor killed
    workers). Re-entrant within a process, so a module's Ray instance and its tests share one turn."""
    if _ray_turn["depth"] == 0:
        f = open(base / "one_ray_at_a_time.lock", "w")
        fcntl.flock(f, fcntl.LOCK_EX)
        _ray_turn["file"] = f
    _ray_turn["depth"] += 1
    try:
        yield
    finally:
        _ray_turn["depth"] -= 1
        if _ray_turn["depth"] == 0:
            _ray_turn["file"].close()  # releases the lock
            _ray_turn["file"] = None


RAY_FIXTURES = frozenset({"ray_turn", "ray_turn_for_module"})


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    """Order the work for two xdist workers (`make test` runs `--dist loadgroup --no-loadscope-reorder`): the tests
    that start Ray form one group, which one worker runs from the start (taking turns on the lock above, they are a
    serial path of about a third of the suite, and a worker that draws one while the other holds the turn sits idle);
    the slow and integration tests come next, the quick ones last to fill the gaps."""
    def rank(item):
        if RAY_FIXTURES & set(item.fixturenames):
            return 0
        return 1 if item.get_closest_marker("slow") or item.get_closest_marker("integration") else 2

    for item in items:
        if rank(item) == 0:
            item.add_marker(pytest.mark.xdist_group("ray"))
    items.sort(key=rank)  # stable: each rank keeps the collection order


@pytest.fixture
def ray_turn(tmp_path_factory):
    with _one_ray_at_a_time(tmp_path_factory.getbasetemp().parent):
        yield


@pytest.fixture(scope="module")
def ray_turn_for_module(tmp_path_factory):
    with _one_ray_at_a_time(tmp_path_factory.getbasetemp().parent):
        yield


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same RNG state, whatever ran before it."""
    seed_everything(0)


@pytest.fixture
def make_outliers():
    return outlier_data


@pytest.fixture
def sqnr():
    return sqnr_db


@pytest.fixture
def tiny_lm():
    return tiny_causal_lm


@pytest.fixture
def single_thread():
    """Run torch on one intra-op thread for the test.

    On a 2-core machine shared with other processes, two spinning OpenMP threads can slow
    small-matmul training loops by 10x or more; one thread is as fast uncontended and stable.
    """
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def pytest_sessionfinish(session, exitstatus):
    """Tests that train in-process leave DeepSpeed's default process group open; closing it before the interpreter
    shuts down keeps a passing session from ending in a gloo abort (what `exit_after_run` does for entry points)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
