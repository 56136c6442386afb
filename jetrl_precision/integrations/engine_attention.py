"""An engine step's attention through the batch-invariant paged kernel, from vLLM's metadata; imports no vLLM.

vLLM's Triton backend keeps one tensor per layer, logically [num_blocks, Hkv, page, 2 * D] (any physical stride
order): each (block, head, slot) holds the key in [:D] and the value in [D:]. It writes a step's new keys and values
into it before attention runs, so the cache already holds every key a query may see. One step's batch is any mix of
decodes (1 query), chunked prefills and whole prompts; the metadata describes it as
- query_start_loc [R + 1] int32: request r's queries are rows query_start_loc[r]:query_start_loc[r + 1], the last
  tokens of its context; requests added as CUDA-graph padding repeat the last value (no queries);
- seq_lens [R]: request r's context length (keys), new tokens included;
- block_table [R, max_blocks]: the physical block of each page of request r.
Every request, whatever its kind, goes through `paged_attention`, so a token's row has the same bits whichever step
computes it (the kernel's contract, see `jetrl_precision.kernels.invariant_attention`).

`vllm_bitwise_attention` wraps this in a vLLM attention backend; the function is separate so it can be tested
wherever Triton runs (its CPU interpreter included), with or without vLLM.
"""

from __future__ import annotations

import torch

__all__ = ["split_kv_cache", "engine_paged_attention"]


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views [num_blocks, page, Hkv, D] of the keys and values in vLLM's Triton-layout cache [num_blocks, Hkv, page, 2D]."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(
            f"bitwise attention: a KV cache [num_blocks, kv_heads, page, 2 * head_size={2 * head_size}] needed, got "
            f"{tuple(kv_cache.shape)} (the Triton backend's layout; a quantized or per-head-scaled cache is not supported)"
        )
    kv = kv_cache.transpose(1, 2)
    return kv[..., :head_size], kv[..., head_size:]


def engine_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    num_actual_tokens: int,
    scale: float,
    output: torch.Tensor,
) -> torch.Tensor:
    """Fill output[:num_actual_tokens] ([T, H, D]) with causal attention of query[:num_actual_tokens] ([T, H, D])
    against the cache. Rows past the last request's queries (CUDA-graph padding) are left as they are.

    Nothing here reads a device value on the host (a captured CUDA graph replays it as is); the launch grid is
    (ceil(max_query_len / 16), R, H), so a graph is valid for every batch with the same R and max_query_len."""
    from ..kernels.invariant_attention import paged_attention  # Triton: imported where attention runs

    head_size = query.shape[-1]
    k_cache, v_cache = split_kv_cache(kv_cache, head_size)
    n = num_actual_tokens
    paged_attention(
        query[:n], k_cache, v_cache, query_start_loc, seq_lens, block_table, max_query_len, scale, out=output[:n]
    )
    return output
