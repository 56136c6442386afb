"""Parameter counts of a Llama-style config (hidden, MLP, heads, vocabulary) at a given depth, for the benchmark
drivers that size their runs: the projections (what FP8 stores in e4m3) apart from the rest (embeddings, lm_head,
norms, which stay in bf16)."""

from __future__ import annotations

__all__ = ["llama_params"]


def llama_params(cfg: dict, layers: int) -> tuple[int, int]:
    """(projection parameters, the other parameters) of `cfg` with `layers` decoder layers."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    projections = layers * (2 * h * h + 2 * h * kv + 3 * h * i)
    rest = layers * 2 * h + v * h * (1 if cfg.get("tie_word_embeddings") else 2) + h
    return projections, rest
