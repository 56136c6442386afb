"""Shared test fixtures: deterministic seeding, data with outliers, SQNR.

Helpers are plain functions (importable as `from conftest import outlier_data, sqnr_db`)
and are also exposed as fixtures for tests that prefer injection.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

# Tests must not reach the model hub or spend threads the 2-core CI machine does not have.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same RNG state, whatever ran before it."""
    seed_everything(0)


@pytest.fixture
def make_outliers():
    return outlier_data


@pytest.fixture
def sqnr():
    return sqnr_db


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


@pytest.fixture
def tiny_lm():
    return tiny_causal_lm


@pytest.fixture
def single_thread():
    """Run torch on one intra-op thread for the test.

    On a 2-core machine shared with other processes, two spinning OpenMP threads can slow
    small-matmul training loops by 10x or more; one thread is as fast uncontended and stable.
    """
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
