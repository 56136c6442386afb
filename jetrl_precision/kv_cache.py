"""The KV cache's format, the same on both sides: keys (after RoPE) and values rounded to e4m3 where the engine
stores them in FP8.

vLLM's FP8 KV cache (`kv_cache_dtype="fp8_e4m3"`, no calibrated scales: per-tensor scale 1.0) stores each key and
value rounded to e4m3, and an attention kernel that dequantizes reads those values back exactly (every e4m3 value is
a bf16 value). The engine's attention then computes ordinary attention on rounded keys and values, which the trainer
reproduces by rounding them where its attention reads them: `mirror_kv_cache` wraps the model's attention
implementation (transformers' `AttentionInterface`) to do so. The rollout stays a subgraph of the training forward,
with the KV cache as one more edge quantized identically on both sides, and a decode step reads half the KV bytes.

The rounding is the engine's cache write on the device the tensors are on: vLLM's CUDA write (a Triton store of
k / 1.0) rounds to nearest even and saturates at +-448; vLLM-CPU's truncates toward zero. The precision graph
labels each side with its rounding (`kv_cache_label`), so a pairing that disagrees is a violation, not a silent drift.
Gradients pass the rounding unchanged (straight-through), as they pass the FP8 linears' input quantization.
Attention kernels that also quantize the query or the probabilities to FP8 (FlashAttention-3's and vLLM's Triton
path on CUDA by default) compute a function the trainer cannot mirror; the engine keeps the query in high precision
(`integrations.vllm_quant.JetKVCacheMethod`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import torch
from torch import nn

from .formats import E4M3_MAX, E4M3_MIN_NORMAL, FP8_DTYPE

__all__ = [
    "KV_CACHE_FORMATS",
    "KV_AUTO",
    "KV_E4M3",
    "ROUNDING",
    "cache_rounding",
    "e4m3_label",
    "round_kv_e4m3",
    "mirror_kv_cache",
    "unmirror_kv_cache",
    "kv_cache_label",
    "kv_attention_name",
    "kv_value_stats",
]

logger = logging.getLogger(__name__)

# The recipe's `kv_cache` values: "auto" keeps the cache in the activations' dtype, "e4m3" rounds it to e4m3.
KV_CACHE_FORMATS = ("auto", "e4m3")
# The precision graph's labels (meta "kv_cache"): what a side's attention reads. Scale 1.0 is vLLM's default for an
# FP8 cache without calibrated scales, and the only one both sides can agree on without moving scales between them.
KV_AUTO = "auto"
KV_E4M3 = "e4m3/scale=1"
_SUFFIX = "+jetrl_kv_e4m3"
# How vLLM's cache write rounds, by device type (measured: tests/rl/test_kv_cache_vllm.py on vLLM-CPU, the GPU test on CUDA).
ROUNDING = {"cuda": "nearest-even", "cpu": "toward-zero"}


def cache_rounding(device: torch.device | str) -> str:
    return ROUNDING["cuda" if torch.device(device).type == "cuda" else "cpu"]


def e4m3_label(rounding: str) -> str:
    """The graph label of an e4m3 cache at scale 1 written with `rounding`."""
    return f"{KV_E4M3}/{rounding}"


def _round_nearest_even(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def _round_toward_zero(x: torch.Tensor) -> torch.Tensor:
    q = _round_nearest_even(x)
    # Where nearest-even rounded away from zero, the next code toward zero: e4m3's codes order magnitudes (sign apart).
    away = q.to(x.dtype).abs() > x.abs()
    return torch.where(away, q.view(torch.uint8) - 1, q.view(torch.uint8)).view(FP8_DTYPE)


class _RoundE4M3(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        rnd = _round_nearest_even if x.is_cuda else _round_toward_zero
        return rnd(x).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def round_kv_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 as vLLM's cache write on x's device does (`cache_rounding`), saturating at +-448, returned
    in x's dtype; identity gradient."""
    return _RoundE4M3.apply(x)


def kv_attention_name(base: str) -> str:
    """The attention implementation that runs `base` on rounded keys and values (registered on first use).

    The base's name stays in it, so transformers' checks by substring (flash attention's) still see it."""
    if base.endswith(_SUFFIX):
        return base
    return _register(base + _SUFFIX, base, _rounding_attention(base))


def _base_attention(base: str, module: nn.Module) -> Callable[..., Any]:
    from transformers import AttentionInterface

    fn = AttentionInterface._global_mapping.get(base)
    # "eager" is no entry of the interface: each model file has its own function
    return fn if fn is not None else sys.modules[type(module).__module__].eager_attention_forward


def _rounding_attention(base: str) -> Callable[..., Any]:
    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
        fn = _base_attention(base, module)
        return fn(module, query, round_kv_e4m3(key), round_kv_e4m3(value), attention_mask, **kwargs)

    attention.__name__ = f"kv_e4m3_{base}"
    return attention


def _register(name: str, base: str, fn: Callable[..., Any]) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, fn)
        mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(base)
        if mask is not None:  # a base without a mask function builds its own layout (the invariant kernels)
            AttentionMaskInterface.register(name, mask)
    return name


def _transformers_models(model: nn.Module) -> list[nn.Module]:
    """The outermost transformers models in `model` (itself, or those a wrapper such as a critic holds)."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if hasattr(m, "set_attn_implementation") and hasattr(getattr(m, "config", None), "_attn_implementation"):
            if not any(name.startswith(f"{outer}.") or outer == "" for outer, _ in found):
                found.append((name, m))
    if not found:
        raise TypeError(
            f"the KV cache mirror wraps a transformers model's attention; {type(model).__name__} holds none "
            "(pass the PreTrainedModel, or a module that holds one)"
        )
    return [m for _, m in found]


def mirror_kv_cache(model: nn.Module) -> nn.Module:
    """Make the model's attention read e4m3-rounded keys and values, as an engine with an FP8 KV cache does; in
    place, returns the model. Idempotent; `unmirror_kv_cache` undoes it."""
    for m in _transformers_models(model):
        base = m.config._attn_implementation or "eager"
        name = kv_attention_name(base)
        if name != base:
            m.set_attn_implementation(name)
            logger.info("KV cache mirrored in e4m3 (scale 1): %s attention reads rounded keys and values", base)
    return model


def unmirror_kv_cache(model: nn.Module) -> nn.Module:
    """Undo `mirror_kv_cache`: the model's attention reads its keys and values as computed."""
    for m in _transformers_models(model):
        name = m.config._attn_implementation or "eager"
        if name.endswith(_SUFFIX):
            m.set_attn_implementation(name[: -len(_SUFFIX)])
    return model


def kv_cache_label(model: nn.Module, device: torch.device | str | None = None) -> str:
    """What the model's attention reads, for the precision graph: `e4m3_label(...)` with the rounding of `device`
    (default: where the parameters are) when mirrored, else `KV_AUTO` (also for a module holding no transformers
    model, whose attention, if any, nothing here changes)."""
    attns = {getattr(m.config, "_attn_implementation", None) or "" for m in model.modules()
             if hasattr(getattr(m, "config", None), "_attn_implementation")}
    mirrored = {a.endswith(_SUFFIX) for a in attns}
    if mirrored == {True, False}:
        return f"mixed ({', '.join(sorted(attns))})"
    if mirrored != {True}:
        return KV_AUTO
    if device is None:
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    return e4m3_label(cache_rounding(device))


_stats: list[dict[str, int]] = []  # the collector `kv_value_stats` is filling (its wrapper counts into the last)


def _counting_attention(base: str) -> Callable[..., Any]:
    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
        if _stats:
            c = _stats[-1]
            for t in (key, value):
                a = t.detach().abs()
                c["values"] += a.numel()
                c["below_normal"] += int(((a > 0) & (a < E4M3_MIN_NORMAL)).sum())
                c["saturated"] += int((a > E4M3_MAX).sum())
        return _base_attention(base, module)(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"kv_stats_{base}"
    return attention


def kv_value_stats(model: nn.Module, run: Callable[[], Any]) -> dict[str, float]:
    """How well e4m3 at scale 1 holds the keys and values `model`'s attention reads during `run()` (no grad): the
    share below e4m3's smallest normal (relative error above 1/16, up to all of it) and the share past 448
    (saturated). The two numbers that say whether the FP8 KV cache suits a model; the model is left as it was."""
    models = _transformers_models(model)
    before = [m.config._attn_implementation or "eager" for m in models]
    counts = {"values": 0, "below_normal": 0, "saturated": 0}
    _stats.append(counts)
    try:
        for m, base in zip(models, before):
            m.set_attn_implementation(_register(f"{base}+jetrl_kv_stats", base, _counting_attention(base)))
        with torch.no_grad():
            run()
    finally:
        _stats.pop()
        for m, base in zip(models, before):
            m.set_attn_implementation(base)
    n = max(counts["values"], 1)
    return {"values": counts["values"], "below_normal_frac": counts["below_normal"] / n, "saturated_frac": counts["saturated"] / n}
