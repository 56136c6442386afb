"""`--ds.use_liger_kernel` is checked before anything loads: one line for each reason it cannot run."""

from __future__ import annotations

import importlib.util

from openrlhf.config import parse_config
from openrlhf.models import liger
from openrlhf.trainer.preflight import preflight_errors

BASE = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "d.jsonl", "--ds.use_liger_kernel"]


def _liger_lines(argv, cuda):
    errors = preflight_errors(parse_config(BASE + argv, exit_on_error=False), cuda=cuda)
    return [e for e in errors if "--ds.use_liger_kernel" in e]


def test_without_a_gpu_liger_is_refused_in_one_line():
    (line,) = _liger_lines([], cuda=False)
    assert "no CUDA device" in line and "drop the flag" in line and "\n" not in line


def test_a_missing_package_names_the_pip_pin(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real("torch"))
    (line,) = _liger_lines([], cuda=True)
    assert f"pip install {liger.LIGER_PIN}" in line


def test_an_installed_liger_on_a_gpu_passes_preflight(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name, *a: real("torch"))
    assert _liger_lines([], cuda=True) == []


def test_bitwise_mode_refuses_liger():
    (line,) = _liger_lines(["--precision.bitwise", "--rollout.engine", "hf"], cuda=False)
    assert "--precision.bitwise" in line and "batch-invariant" in line
