"""Shared helpers for the CPU jetrl_precision tests: seeding, data with outliers, SQNR, tiny models.

Import them as `from precision_testutil import ...` (a unique module name: `conftest` is
ambiguous once tests/gpu/ has its own). tests/conftest.py exposes them as fixtures too.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int = 0) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def outlier_data(
    shape: tuple[int, ...],
    *,
    group: int = 128,
    spikes: int = 4,
    spike_factor: float = 1000.0,
    sigma: float = 1.5,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Gaussian data whose magnitude varies like real LLM activations.

    Every run of `group` consecutive elements along the last dim gets a log-normal factor
    (exp(N(0, sigma))), so groups differ by orders of magnitude, and `spikes` random
    elements are multiplied by `spike_factor` (the outlier channels that make per-tensor
    scaling fail). Never all zeros.
    """
    g = generator
    x = torch.randn(*shape, generator=g)
    last = shape[-1]
    n_groups = -(-last // group)
    factors = torch.exp(sigma * torch.randn(*shape[:-1], n_groups, generator=g))
    x = x * factors.repeat_interleave(group, dim=-1)[..., :last]
    if spikes:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (spikes,), generator=g)
        flat[idx] *= spike_factor
    return x.to(dtype)


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `test` against `ref`, in dB (computed in float64)."""
    ref64, test64 = ref.detach().double(), test.detach().double()
    noise = (ref64 - test64).pow(2).sum()
    signal = ref64.pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10.0 * torch.log10(signal / noise))


# ---- tiny transformers models, built from configs (no model hub) ---------------------------------
def tiny_causal_lm(
    arch: str = "llama",
    *,
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = 2,
    vocab: int = 512,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A randomly initialised LlamaForCausalLM / Qwen2ForCausalLM small enough for CPU tests."""
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    cfg = cfg_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return model_cls(cfg).to(dtype)
