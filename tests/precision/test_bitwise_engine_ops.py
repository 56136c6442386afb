"""The bitwise vLLM engine's elementwise ops (jetrl_precision.batch_invariant.engine_ops) equal transformers' Llama
computation bit for bit (kind 1, exact), on eager CPU tensors: rotary (default and llama3 rope, positions up to 8k,
vLLM's [tokens, heads * head_dim] layout against transformers' [batch, heads, seq, head_dim]) and SiLU*mul (vLLM's
fused gate_up against transformers' separate gate and up). The RMSNorm op runs a Triton kernel:
test_bitwise_engine_norm_interpret.py checks it under Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from precision_testutil import assert_same_bits, outlier_data
from jetrl_precision.batch_invariant import engine_ops

OPS = getattr(torch.ops, engine_ops.OPS)

ROPES = {
    "default": dict(rope_theta=10000.0),
    "llama3": dict(
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
    ),
}


def _config(rope: str, heads: int = 8, kv_heads: int = 2, head_dim: int = 64) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=256,
        num_hidden_layers=1, vocab_size=128, max_position_embeddings=8192, **ROPES[rope],
    )


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rotary_is_transformers_bit_for_bit(rope):
    cfg = _config(rope)
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(1)
    b, s = 2, 48
    # positions spread to 8k: a prefill chunk at the start, and decode-like positions far out
    pos = torch.cat([torch.arange(16), torch.randint(16, 8192, (s - 17,), generator=g), torch.tensor([8191])])
    position_ids = torch.stack([pos, pos.flip(0)])
    q = outlier_data((b, heads, s, d), generator=g).to(torch.bfloat16)
    k = outlier_data((b, kv, s, d), generator=g).to(torch.bfloat16)

    hf_rope = LlamaRotaryEmbedding(cfg)
    cos, sin = hf_rope(q, position_ids)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)

    inv_freq, scaling = engine_ops.hf_rope_inv_freq(cfg)
    assert_same_bits(inv_freq, hf_rope.inv_freq.float(), f"{rope} inv_freq")
    if rope == "llama3":  # the scaled frequencies differ from the default ones: the rope type was honoured
        assert not torch.equal(inv_freq, engine_ops.hf_rope_inv_freq(_config("default"))[0])
    # vLLM's layout: tokens in order (batch-major), heads * head_dim per token
    q_v = q.transpose(1, 2).reshape(b * s, heads * d)
    k_v = k.transpose(1, 2).reshape(b * s, kv * d)
    table = engine_ops.rope_table(inv_freq, scaling, cfg.max_position_embeddings, torch.bfloat16)
    q_out, k_out = OPS.rotary(position_ids.reshape(-1), q_v, k_v, table, d)
    assert_same_bits(q_out, q_ref.transpose(1, 2).reshape(b * s, heads * d), f"{rope} query")
    assert_same_bits(k_out, k_ref.transpose(1, 2).reshape(b * s, kv * d), f"{rope} key")
    # a non-contiguous query (vLLM slices it out of the fused qkv output) gives the same bits
    qkv = torch.cat([q_v, k_v, k_v], dim=-1)
    q_out2, _ = OPS.rotary(position_ids.reshape(-1), qkv[:, : heads * d], qkv[:, heads * d : (heads + kv) * d], table, d)
    assert_same_bits(q_out2, q_out, f"{rope} query sliced from qkv")


def test_silu_and_mul_is_transformers_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    b, s, inter = 3, 17, 1536
    gate = outlier_data((b, s, inter), generator=g).to(torch.bfloat16)
    up = outlier_data((b, s, inter), generator=g).to(torch.bfloat16)
    ref = ACT2FN["silu"](gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    fused = torch.cat([gate, up], dim=-1).reshape(b * s, 2 * inter)  # vLLM's gate_up_proj output
    out = OPS.silu_and_mul(fused)
    assert_same_bits(out, ref.reshape(b * s, inter), "silu_and_mul")


def test_ops_compile_as_single_opaque_nodes():
    """Under torch.compile the ops stay one node each: Inductor cannot fuse or re-round them (same bits as eager)."""
    g = torch.Generator().manual_seed(3)
    x = outlier_data((5, 2 * 96), generator=g).to(torch.bfloat16)
    cfg = _config("default", heads=2, kv_heads=1, head_dim=32)
    inv_freq, scaling = engine_ops.hf_rope_inv_freq(cfg)
    pos = torch.tensor([0, 1, 7, 300, 4000])
    table = engine_ops.rope_table(inv_freq, scaling, 8192, torch.bfloat16)
    q, k = outlier_data((5, 64), generator=g).to(torch.bfloat16), outlier_data((5, 32), generator=g).to(torch.bfloat16)

    def f(x, pos, q, k):
        y = OPS.silu_and_mul(x) * 2
        return y, *OPS.rotary(pos, q, k, table, 32)

    eager = f(x, pos, q, k)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(x, pos, q, k)
    for a, c, what in zip(eager, compiled, ("silu_and_mul", "rotary q", "rotary k")):
        assert_same_bits(c, a, what)
