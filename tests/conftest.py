"""Shared fixtures for the tests: deterministic seeding, data with outliers, SQNR, tiny models.

The helpers live in tests/precision_testutil.py (import them from there, not from
`conftest`: tests/gpu/ has its own conftest, so that module name is ambiguous).
"""

from __future__ import annotations

import os
import sys

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
