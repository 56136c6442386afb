"""The bitwise vLLM engine's RMSNorm ops (jetrl_precision.batch_invariant.engine_ops) equal the trainer's converted
transformers computation bit for bit (kind 1, exact), run for real on CPU by Triton's interpreter:
- `rms_norm` = `InvariantRMSNorm.from_norm(LlamaRMSNorm)`;
- `add_rms_norm` (vLLM's norm with a residual) = the decoder layer's `residual + hidden_states` in the model dtype,
  then `InvariantRMSNorm`; its residual output is that sum;
- a row's bits do not depend on the rows beside it (decode of one token against a prefill batch);
- the rotary kernel the `rotary` op runs on CUDA (`kernels.invariant_rotary`) = transformers' rotary, through the
  cos/sin table, for a query sliced out of a fused qkv row (strided) and a key, at positions up to 8k.

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


def test_rotary_kernel_is_transformers_through_the_table():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from jetrl_precision.kernels.invariant_rotary import rotary_bf16

    heads, kv, d = 9, 3, 64  # SmolLM2's attention
    cfg = LlamaConfig(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=256,
                      num_hidden_layers=1, vocab_size=128, max_position_embeddings=8192, rope_theta=100000.0)
    g = torch.Generator().manual_seed(4)
    pos = torch.cat([torch.arange(5), torch.randint(5, 8192, (10,), generator=g), torch.tensor([8191])])
    q = outlier_data((1, heads, pos.numel(), d), generator=g).to(torch.bfloat16)
    k = outlier_data((1, kv, pos.numel(), d), generator=g).to(torch.bfloat16)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, pos[None])
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    inv_freq, scaling = engine_ops.hf_rope_inv_freq(cfg)
    table = engine_ops.rope_table(inv_freq, scaling, cfg.max_position_embeddings, torch.bfloat16)
    q_v, k_v = q[0].transpose(0, 1).reshape(-1, heads * d), k[0].transpose(0, 1).reshape(-1, kv * d)
    qkv = torch.cat([q_v, k_v, k_v], dim=-1)  # vLLM slices query and key out of the fused projection
    q_out = rotary_bf16(pos, qkv[:, : heads * d], table, d)
    k_out = rotary_bf16(pos, qkv[:, heads * d : (heads + kv) * d], table, d)
    assert_same_bits(q_out, q_ref[0].transpose(0, 1).reshape(-1, heads * d), "rotary kernel query")
    assert_same_bits(k_out, k_ref[0].transpose(0, 1).reshape(-1, kv * d), "rotary kernel key")
    # one token alone (a decode step) gives its row of the batch
    assert_same_bits(rotary_bf16(pos[7:8], q_v[7:8], table, d), q_out[7:8], "rotary kernel, one token")
    with pytest.raises(ValueError, match="bf16"):
        rotary_bf16(pos, q_v.float(), table, d)
