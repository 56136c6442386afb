"""The trainer's elementwise and norm ops as opaque custom ops, for an engine that must compute them bit for bit.

A vLLM engine in bitwise mode (`integrations.vllm_bitwise`) routes its RMSNorm, rotary, SiLU*mul and high-precision
linears through these ops. Each computes exactly what the trainer's converted transformers model computes:
- `rms_norm` / `add_rms_norm`: `InvariantRMSNorm`'s Triton kernel; `add_rms_norm` runs its fused form, whose add is
  rounded to the model dtype before the norm, as transformers' unfused `residual + hidden_states` is;
- `rotary`: transformers' `LlamaRotaryEmbedding.forward` (fp32 `position * inv_freq`, cos/sin scaled then rounded to
  the model dtype) and `apply_rotary_pos_emb` (`q * cos + rotate_half(q) * sin`, each product and the sum rounded as
  eager torch rounds them), on vLLM's [tokens, heads * head_dim] layout (neox style, the whole head rotated). The
  cos/sin come from a table of every position built once with those same ops (`rope_table`); on CUDA in bf16 one
  Triton kernel (`kernels.invariant_rotary`) then rotates query and key, elsewhere eager torch does;
- `silu_and_mul`: transformers' `act_fn(gate) * up` (silu rounded to the model dtype, then the product);
- `linear`: `kernels.invariant_gemm.linear_invariant`, `InvariantLinear`'s Triton GEMM.
They are `torch.library.custom_op`s so that torch.compile (vLLM's default mode) sees one node each and cannot fuse
them into other kernels or change where they round. `hf_rope_inv_freq` gives the inverse frequencies transformers
computes for a config, on CPU as `from_pretrained` does.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "hf_rope_inv_freq",
    "rope_table",
    "rotary_reference",
    "silu_and_mul_reference",
    "add_rms_norm_reference",
    "OPS",
]

OPS = "jetrl_bitwise"  # the torch.library namespace of these ops


def hf_rope_inv_freq(hf_config: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq fp32 on CPU, attention_scaling) exactly as transformers' Llama rotary module computes them for
    `hf_config` (any rope type transformers knows: default, llama3, ...). Built on CPU whatever the default device,
    because the trainer's model computes its buffer on CPU in `from_pretrained`."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("cpu"):
        rope = LlamaRotaryEmbedding(config=hf_config)
    return rope.inv_freq.detach().to(torch.float32).clone(), float(rope.attention_scaling)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    # transformers: freqs = position_ids[..., None].float() * inv_freq; emb = cat(freqs, freqs); cos = emb.cos() * s
    freqs = positions.reshape(-1)[:, None].float() * inv_freq.to(device=positions.device, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> torch.Tensor:
    t = x.shape[0]
    h = x.reshape(t, -1, head_size)
    half = head_size // 2
    rot = torch.cat((-h[..., half:], h[..., :half]), dim=-1)  # transformers' rotate_half
    out = (h * cos[:, None, :]) + (rot * sin[:, None, :])
    return out.reshape(x.shape)


def rope_table(inv_freq: torch.Tensor, scaling: float, max_positions: int, dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
    """[max_positions, 2 * head_dim]: cos | sin of every position, each element computed as transformers computes it
    for that position (elementwise ops: a row's bits do not depend on which other positions are computed with it)."""
    positions = torch.arange(max_positions, device=device if device is not None else inv_freq.device)
    cos, sin = _cos_sin(positions, inv_freq, scaling, dtype)
    return torch.cat((cos, sin), dim=-1).contiguous()


def _rotary_from_table(positions: torch.Tensor, x: torch.Tensor, table: torch.Tensor, head_size: int) -> torch.Tensor:
    if table.dtype != x.dtype:  # transformers rounds cos/sin to the activations' dtype before multiplying
        raise ValueError(f"bitwise rotary: the cos/sin table is {table.dtype}, the query/key {x.dtype}; build it in the model dtype")
    if x.is_cuda and x.dtype == torch.bfloat16 and (head_size // 2) & (head_size // 2 - 1) == 0:  # the kernel's case
        from ..kernels.invariant_rotary import rotary_bf16

        return rotary_bf16(positions, x, table, head_size)
    rows = table.index_select(0, positions)
    return _rotate(x, rows[:, :head_size], rows[:, head_size:], head_size).contiguous()


def rotary_reference(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, inv_freq: torch.Tensor, scaling: float, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary on [tokens, heads * head_dim] query/key; positions [tokens]. New tensors (no in-place)."""
    cos, sin = _cos_sin(positions, inv_freq, scaling, query.dtype)
    return _rotate(query, cos, sin, head_size), _rotate(key, cos, sin, head_size)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """transformers' `act_fn(gate) * up` for vLLM's fused [..., 2 * d] gate_up output (gate first)."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    if not x.is_cuda:  # contiguous halves: the CPU kernels then see the same flat loop as the trainer's gate/up
        gate, up = gate.contiguous(), up.contiguous()
    return torch.nn.functional.silu(gate) * up


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(InvariantRMSNorm(residual + x), residual + x): the decoder layer's add in the model dtype, then the norm."""
    from ..kernels.invariant_norm import rms_norm

    r = residual + x
    return rms_norm(r, weight, eps), r


def _register() -> None:
    if hasattr(torch.ops, OPS) and hasattr(getattr(torch.ops, OPS), "rotary"):
        return

    @torch.library.custom_op(f"{OPS}::rms_norm", mutates_args=(), schema="(Tensor x, Tensor weight, float eps) -> Tensor")
    def _rms_norm(x, weight, eps):
        from ..kernels.invariant_norm import rms_norm

        return rms_norm(x, weight, eps).contiguous()

    @_rms_norm.register_fake
    def _(x, weight, eps):
        return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)

    @torch.library.custom_op(
        f"{OPS}::add_rms_norm", mutates_args=(), schema="(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)"
    )
    def _add_rms_norm(x, residual, weight, eps):
        from ..kernels.invariant_norm import fused_add_rms_norm

        # one kernel: its add rounds as the decoder layer's eager `residual + x` does (add_rms_norm_reference)
        y, r = fused_add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)
        return y.contiguous(), r.contiguous()

    @_add_rms_norm.register_fake
    def _(x, residual, weight, eps):
        return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device), x.new_empty(x.shape)

    @torch.library.custom_op(
        f"{OPS}::rotary", mutates_args=(),
        schema="(Tensor positions, Tensor query, Tensor key, Tensor table, int head_size) -> (Tensor, Tensor)",
    )
    def _rotary(positions, query, key, table, head_size):
        return _rotary_from_table(positions, query, table, head_size), _rotary_from_table(positions, key, table, head_size)

    @_rotary.register_fake
    def _(positions, query, key, table, head_size):
        return query.new_empty(query.shape), key.new_empty(key.shape)

    @torch.library.custom_op(f"{OPS}::silu_and_mul", mutates_args=(), schema="(Tensor x) -> Tensor")
    def _silu_and_mul(x):
        return silu_and_mul_reference(x).contiguous()

    @_silu_and_mul.register_fake
    def _(x):
        return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)

    @torch.library.custom_op(f"{OPS}::linear", mutates_args=(), schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
    def _linear(x, weight, bias):
        from ..kernels.invariant_gemm import linear_invariant

        return linear_invariant(x, weight, bias).contiguous()

    @_linear.register_fake
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])


_register()
