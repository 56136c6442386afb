"""The device probe that lets SwiGLU MLPs use the fused backward only where its bytes are autograd's."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from jetrl_precision.kernels import swiglu_probe


def _autograds(dh, gate, up):
    return torch.ops.aten.silu_backward(dh * up, gate), dh * F.silu(gate)


def _one_ulp_off(dh, gate, up):
    dgate, dup = _autograds(dh, gate, up)
    dgate = dgate.clone()
    dgate.view(torch.int16)[3, 7] += 1  # the last bit of one element
    return dgate, dup


def test_probe_values_cover_silus_tails_and_zero():
    dh, gate, up = swiglu_probe.probe_values("cpu", torch.bfloat16)
    assert gate.dtype == torch.bfloat16 and gate.shape == dh.shape == up.shape
    assert gate.max() >= 99 and gate.min() <= -99 and gate.abs().min() < 1e-6
    assert torch.isfinite(gate).all() and (gate != 0).all()


def test_a_single_differing_bit_is_counted():
    vals = swiglu_probe.probe_values("cpu", torch.bfloat16)
    assert swiglu_probe.mismatch(_autograds, *vals) == 0
    assert swiglu_probe.mismatch(_one_ulp_off, *vals) == 1


def test_verdict_is_computed_once_per_device_and_dtype_and_a_mismatch_is_logged(monkeypatch, caplog):
    monkeypatch.setattr(swiglu_probe, "_verdicts", {})
    runs = []

    def counted(*a):
        runs.append(1)
        return _one_ulp_off(*a)

    with caplog.at_level(logging.WARNING, logger="jetrl_precision.kernels.swiglu_probe"):
        assert not swiglu_probe.fused_backward_ok(counted, torch.device("cpu"), torch.bfloat16)
        assert not swiglu_probe.fused_backward_ok(counted, torch.device("cpu"), torch.bfloat16)
    assert len(runs) == 1
    (rec,) = caplog.records
    assert "differs from autograd's kernels in 1 probe values" in rec.getMessage()
    assert swiglu_probe.fused_backward_ok(_autograds, torch.device("cpu"), torch.float32)


def test_a_kernel_that_cannot_run_is_reported_not_raised(monkeypatch, caplog):
    monkeypatch.setattr(swiglu_probe, "_verdicts", {})

    def broken(*a):
        raise RuntimeError("PTX assembly failed\nmore lines")

    with caplog.at_level(logging.WARNING, logger="jetrl_precision.kernels.swiglu_probe"):
        assert not swiglu_probe.fused_backward_ok(broken, torch.device("cpu"), torch.bfloat16)
    assert "failed to run (RuntimeError: PTX assembly failed)" in caplog.records[0].getMessage()


def test_cuda_with_and_without_its_index_is_one_probe_key(monkeypatch):
    """A model on 'cuda:0' and a caller naming 'cuda' share one verdict: the probe does not run again."""
    from jetrl_precision.kernels import _probe

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _probe.device_key("cuda") == _probe.device_key(torch.device("cuda", 0)) == "cuda:0"
    assert _probe.device_key("cuda:1") == "cuda:1" and _probe.device_key("cpu") == "cpu"
