"""The bitwise vLLM engine's RMSNorm ops (jetrl_precision.batch_invariant.engine_ops) equal the trainer's converted
transformers computation bit for bit (kind 1, exact), run for real on CPU by Triton's interpreter:
- `rms_norm` = `InvariantRMSNorm.from_norm(LlamaRMSNorm)`;
- `add_rms_norm` (vLLM's norm with a residual) = the decoder layer's `residual + hidden_states` in the model dtype,
  then `InvariantRMSNorm`; its residual output is that sum;
- a row's bits do not depend on the rows beside it (decode of one token against a prefill batch).

Skipped where Triton is not installed (the CI venv has none) and where CUDA is present (the GPU test covers the
ops there). Like test_invariant_kernels.py it turns TRITON_INTERPRET=1 on for its process; run it on its own:
    python -m pytest -q tests/precision/test_bitwise_engine_norm_interpret.py
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_vllm_bitwise_gpu.py runs these ops natively", allow_module_level=True)
if importlib.util.find_spec("triton") is not None and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton was imported without TRITON_INTERPRET=1; run this file in its own process", allow_module_level=True)

from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from precision_testutil import assert_same_bits, outlier_data  # noqa: E402
from jetrl_precision.batch_invariant import InvariantRMSNorm, engine_ops  # noqa: E402
from jetrl_precision.kernels import invariant_norm  # noqa: E402

OPS = getattr(torch.ops, engine_ops.OPS)
HIDDEN = 576  # SmolLM2's: not a multiple of the kernel's 1024-wide chunk


def _norm(g: torch.Generator) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(HIDDEN, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.25 * torch.randn(HIDDEN, generator=g))
    return norm.to(torch.bfloat16)


def test_rms_norm_is_the_trainers():
    g = torch.Generator().manual_seed(0)
    norm = _norm(g)
    x = outlier_data((9, HIDDEN), generator=g).to(torch.bfloat16)
    trainer = InvariantRMSNorm.from_norm(norm)
    assert_same_bits(OPS.rms_norm(x, norm.weight, norm.variance_epsilon), trainer(x[None])[0], "rms_norm")


def test_add_rms_norm_is_the_decoder_layers_add_then_the_trainers_norm():
    g = torch.Generator().manual_seed(1)
    norm = _norm(g)
    hidden = outlier_data((9, HIDDEN), generator=g).to(torch.bfloat16)  # the layer's output
    residual = outlier_data((9, HIDDEN), generator=g, spike_factor=50.0).to(torch.bfloat16)  # the stream
    y, r = OPS.add_rms_norm(hidden, residual, norm.weight, norm.variance_epsilon)
    stream = residual + hidden  # LlamaDecoderLayer: hidden_states = residual + hidden_states
    assert_same_bits(r, stream, "residual out")
    assert_same_bits(y, InvariantRMSNorm.from_norm(norm)(stream[None])[0], "normed")
    # the kernel's own fused add rounds the same way (one fp32 add, one rounding to bf16)
    yk, rk = invariant_norm.fused_add_rms_norm(hidden, residual, norm.weight, norm.variance_epsilon)
    assert_same_bits(rk, r, "kernel's fused residual")
    assert_same_bits(yk, y, "kernel's fused norm")


def test_a_row_is_the_same_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(2)
    norm = _norm(g)
    hidden = outlier_data((33, HIDDEN), generator=g).to(torch.bfloat16)
    residual = outlier_data((33, HIDDEN), generator=g).to(torch.bfloat16)
    y, r = OPS.add_rms_norm(hidden, residual, norm.weight, norm.variance_epsilon)
    y1, r1 = OPS.add_rms_norm(hidden[17:18], residual[17:18], norm.weight, norm.variance_epsilon)
    assert_same_bits(y1, y[17:18], "decode row against the batch")
    assert_same_bits(r1, r[17:18], "decode residual against the batch")
