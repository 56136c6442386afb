"""The e4m3 KV cache's decode attention in vLLM: the split-KV kernel for decode batches, vLLM's Triton kernel for
the rest.

A recipe with `kv_cache e4m3` runs vLLM's Triton attention backend (`vllm_plugin.KV_CACHE_ATTENTION_BACKEND`, the one
that reads an FP8 cache with the query in BF16). Its kernel gives one program a sequence's whole context per KV
head, which streams a large decode batch's halved KV bytes well below the card's bandwidth. `install_kv_decode`
(called by `JetKVCacheMethod` once the layer is loaded, before vLLM compiles or captures anything) makes the layer's
attention run `kernels.decode_attention` whenever a step is decodes only (`max_query_len == 1`, a host value, so a
captured decode graph holds the new kernel and a prefill step the old one), and vLLM's own kernel otherwise. The cache,
its writes and the metadata stay vLLM's; both kernels compute attention on the same dequantized keys and values,
which is the function the trainer mirrors (`jetrl_precision.kv_cache`).

JETRL_KV_DECODE=0 keeps vLLM's kernel (for A/B runs); a layer with ALiBi, a sliding window, soft-capping, sinks or a GQA
group over 16 query heads keeps it too (the kernel serves none of them); either is logged once.
"""

from __future__ import annotations

import logging
import os

import torch
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

__all__ = ["KVDecodeAttentionImpl", "install_kv_decode", "kv_decode_enabled"]

logger = logging.getLogger(__name__)
_logged: set[str] = set()
_QUERY_DTYPES = (torch.bfloat16, torch.float16)  # what the kernel reads the cache in; an fp32 model keeps vLLM's
_MAX_GROUP = 16  # kernels.decode_attention.MAX_GROUP (not imported here: that module needs Triton, a vLLM-CPU host may lack it)


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.warning(msg, *args)


def kv_decode_enabled() -> bool:
    return os.environ.get("JETRL_KV_DECODE", "1").strip() != "0"


class KVDecodeAttentionImpl(TritonAttentionImpl):
    """vLLM's Triton attention with decode-only steps through `decode_attention` (no state of its own: a layer's impl
    becomes one in place, `install_kv_decode`)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
        if (attn_metadata is None or attn_metadata.max_query_len != 1 or output_scale is not None or output_block_scale is not None
                or query.dtype not in _QUERY_DTYPES):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        # Triton: imported where attention runs; the unchecked launch, since the layer's shapes were checked at install
        from ..kernels.decode_attention import launch_decode_attention

        n = attn_metadata.num_actual_tokens
        k_cache, v_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)  # [blocks, page, Hkv, D] views
        if k_cache.dtype != self.fp8_dtype:
            k_cache, v_cache = k_cache.view(self.fp8_dtype), v_cache.view(self.fp8_dtype)
        launch_decode_attention(query[:n], k_cache, v_cache, attn_metadata.query_start_loc, attn_metadata.seq_lens,
                                attn_metadata.block_table, self.scale, output[:n])
        return output


def _unsupported(impl: TritonAttentionImpl) -> list[str]:
    return [name for name, on in (
        ("ALiBi", impl.alibi_slopes is not None or getattr(impl, "use_alibi_sqrt", False)),
        ("a sliding window", tuple(impl.sliding_window) != (-1, -1)),
        ("logit soft-capping", bool(impl.logits_soft_cap)),
        ("attention sinks", getattr(impl, "sinks", None) is not None),
        ("per-token-head KV scales", bool(getattr(impl, "_is_per_token_head_quant", False))),
        ("chunked local attention", getattr(impl, "chunk_lookback", -1) > -1),
        ("non-decoder attention", getattr(impl, "attn_type", "decoder") != "decoder"),  # a str enum
        (f"a GQA group over {_MAX_GROUP} query heads", impl.num_heads // impl.num_kv_heads > _MAX_GROUP),
    ) if on]


def install_kv_decode(layer: torch.nn.Module) -> bool:
    """Give an attention layer on vLLM's Triton backend the split-KV decode kernel; whether it now has it."""
    impl = getattr(layer, "impl", None)
    if type(impl) is KVDecodeAttentionImpl:
        return True
    if type(impl) is not TritonAttentionImpl:
        _log_once(f"impl:{type(impl).__name__}", "jetrl_fp8 kv_cache e4m3: attention runs %s, not vLLM's Triton backend; "
                  "its decode keeps that kernel", type(impl).__name__)
        return False
    if not kv_decode_enabled():
        _log_once("off", "jetrl_fp8 kv_cache e4m3: JETRL_KV_DECODE=0, decode attention stays vLLM's Triton kernel")
        return False
    missing = _unsupported(impl)
    if missing:
        _log_once("unsupported", "jetrl_fp8 kv_cache e4m3: the split-KV decode kernel has no %s; decode attention stays "
                  "vLLM's Triton kernel", ", ".join(missing))
        return False
    impl.__class__ = KVDecodeAttentionImpl  # the same object and state, one method overridden
    return True
