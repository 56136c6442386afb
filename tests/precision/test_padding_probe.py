"""The device probe that lets the quantizer kernels pad WGrad operands only where their bytes are the copy's."""

from __future__ import annotations

import logging

import torch

from jetrl_precision.kernels import padding_probe
from jetrl_precision.kernels.layout import pad_columns
from jetrl_precision.quantize import quantize_fp8


def _exact(x, pad_to):  # what a correct kernel gives: the reference, zero-padded
    return pad_columns(quantize_fp8(x.float(), (128, 1), nonfinite="propagate").t(), pad_to)


def _dirty_padding(x, pad_to):  # one nonzero byte where the zeros belong
    q = _exact(x, pad_to)
    if pad_to:
        q.data.view(torch.uint8)[0, -1] = 1
    return q


def test_probe_inputs_have_unaligned_token_counts_and_nonfinite_values():
    xs = padding_probe.probe_inputs("cpu")
    assert [x.shape[0] % 128 for x in xs] == [72, 16] and xs[1].shape[0] % 16 == 0
    assert all(x.dtype == torch.bfloat16 and torch.isnan(x).any() and torch.isinf(x).any() for x in xs)


def test_a_single_wrong_padding_byte_is_counted():
    xs = padding_probe.probe_inputs("cpu")
    assert padding_probe.mismatch({"ok": _exact, "dirty": _dirty_padding}, xs) == {"ok": 0, "dirty": len(xs)}


def test_verdict_is_computed_once_per_device_and_a_failure_is_logged(monkeypatch, caplog):
    monkeypatch.setattr(padding_probe, "_verdicts", {})
    builds = []

    def producers():
        builds.append(1)
        return {"quantizer": _exact, "requantizer": _dirty_padding}

    with caplog.at_level(logging.WARNING, logger="jetrl_precision.kernels.padding_probe"):
        assert not padding_probe.kernels_pad_ok(torch.device("cpu"), producers)
        assert not padding_probe.kernels_pad_ok(torch.device("cpu"), producers)
    assert builds == [1]
    (rec,) = caplog.records
    assert "requantizer differs in 2 bytes" in rec.getMessage() and "padded by a copy instead" in rec.getMessage()
    monkeypatch.setattr(padding_probe, "_verdicts", {})

    def broken():
        raise RuntimeError("nvrtc: error")

    assert not padding_probe.kernels_pad_ok(torch.device("cpu"), broken)
    assert "failed to run (RuntimeError: nvrtc: error)" in caplog.records[-1].getMessage()
    monkeypatch.setattr(padding_probe, "_verdicts", {})
    assert padding_probe.kernels_pad_ok(torch.device("cpu"), lambda: {"quantizer": _exact})


def test_a_refused_padding_is_named_in_the_precision_graph(monkeypatch):
    from torch import nn

    from jetrl_precision import build_precision_graph, convert_to_fp8, ops
    from jetrl_precision.kernels import cast_transpose

    model = convert_to_fp8(nn.Sequential(nn.Linear(256, 256)), "jet_fp8")
    monkeypatch.setattr(ops, "kernel_name", lambda device: "triton")  # as on a GPU with the Triton quantizers
    monkeypatch.setattr(cast_transpose, "usable", lambda device: True)
    monkeypatch.setattr(padding_probe, "_verdicts", {})
    monkeypatch.setattr(padding_probe, "_reasons", {})
    assert "wgrad_padding_fallback" not in build_precision_graph(model, "jet_fp8", "train_bwd").nodes["0"].attrs
    padding_probe.kernels_pad_ok(torch.device("cpu"), lambda: {"requantizer": _dirty_padding})
    g = build_precision_graph(model, "jet_fp8", "train_bwd")
    assert "requantizer differs in 2 bytes" in g.nodes["0"].attrs["wgrad_padding_fallback"]
