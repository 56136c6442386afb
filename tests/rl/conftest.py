"""Fixtures shared by the framework tests."""

from __future__ import annotations

import pytest

from _rl_helpers import make_task


@pytest.fixture(scope="session")
def task(tmp_path_factory):
    """(model folder, prompt file): a warm-started tiny Llama and its arithmetic prompts, built once per
    session for every end-to-end test (the runs only read them)."""
    return make_task(tmp_path_factory.mktemp("task"))
