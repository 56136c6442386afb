"""The CUDA requantizer's selection logic on a machine without CUDA: clear refusals, no warning, no crash.

Its bytes are checked on the GPU (tests/gpu/test_cast_transpose.py); the module itself imports without Triton.
"""

from __future__ import annotations

import logging

import pytest
import torch

from jetrl_precision.kernels import cast_transpose
from jetrl_precision.quantize import quantize_fp8


def test_cpu_is_reported_unusable_without_a_warning(caplog):
    assert cast_transpose.status(torch.device("cpu")) == (False, "not a CUDA device")
    with caplog.at_level(logging.WARNING):
        assert cast_transpose.usable(torch.device("cpu")) is False
    assert not caplog.records  # the warning is for CUDA devices that miss the fast path, not for CPU runs


def test_bad_inputs_name_the_requirement():
    g = torch.Generator().manual_seed(0)
    q = quantize_fp8(torch.randn(64, 256, generator=g), (1, 128))
    assert not cast_transpose.supported_shape(q)
    with pytest.raises(ValueError, match="needs a 1x128 CUDA input"):
        cast_transpose.requantize_1x128_to_128x1_t(q)
    w = quantize_fp8(torch.randn(128, 256, generator=g), (128, 128))
    assert not cast_transpose.supported_shape(w)


def test_cpu_precision_graph_claims_no_gpu_requantizer():
    """Only layers whose WGrad input a GPU kernel re-quantizes get a requantizer record; a CPU model gets none."""
    from torch import nn

    from jetrl_precision import build_precision_graph, convert_to_fp8

    model = convert_to_fp8(nn.Sequential(nn.Linear(256, 256)), "jet_fp8")
    g = build_precision_graph(model, "jet_fp8", "train_bwd")
    assert g.edges_into("0")["wgrad.input"].attrs.kernel == "reference"
    assert "requantizer_fallback" not in g.nodes["0"].attrs
