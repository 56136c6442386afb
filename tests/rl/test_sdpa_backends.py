"""The trainer's attention keeps torch's cuDNN SDPA backend when an in-process vLLM switched it off.

vLLM's CUDA platform module calls `torch.backends.cuda.enable_cudnn_sdp(False)` at import (vllm/platforms/cuda.py);
that module does not import without CUDA, so these tests switch the flag off the same way and check that the
policy's and the critic's forwards turn it back on, once, with a warning.
"""

from __future__ import annotations

import logging

import pytest
import torch

from precision_testutil import tiny_causal_lm

from openrlhf.models import sdpa_backends
from openrlhf.models.actor import Actor, Critic


@pytest.fixture
def cudnn_off():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)  # what importing vllm.platforms.cuda does
    sdpa_backends._said.clear()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def _tiny_lm():
    return tiny_causal_lm(hidden=64, intermediate=128, layers=1, vocab=96)


def _batch():
    seq = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(seq)
    mask[0, :3] = 0
    return seq, mask


def test_policy_forward_turns_cudnn_attention_back_on_and_says_so_once(cudnn_off, caplog):
    actor = Actor(_tiny_lm())
    seq, mask = _batch()
    with caplog.at_level(logging.WARNING, logger=sdpa_backends.__name__):
        logp = actor(seq, mask, 4)
        assert torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)  # switched off again: turned on again, without a second warning
        actor(seq, mask, 4)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    warnings = [r for r in caplog.records if "cuDNN attention was switched off" in r.getMessage()]
    assert len(warnings) == 1
    assert logp.shape == (2, 4) and torch.isfinite(logp).all()


def test_critic_forward_turns_it_back_on(cudnn_off):
    lm = _tiny_lm()
    critic = Critic(lm.model, 64)
    seq, mask = _batch()
    critic(seq, mask, 4)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_nothing_changes_when_it_is_on():
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default
    assert sdpa_backends.restore_cudnn_sdpa() is False
