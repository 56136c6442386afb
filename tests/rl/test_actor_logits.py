"""The policy scores response tokens with the lm_head run on the response positions only (`logits_to_keep`)."""

from __future__ import annotations

import torch
from torch import nn

from precision_testutil import tiny_causal_lm

from openrlhf.models.actor import Actor, position_ids_from_mask
from openrlhf.models.utils import log_probs_from_logits


def _lm():
    return tiny_causal_lm(hidden=64, intermediate=128, layers=2, vocab=96)


def test_lm_head_runs_on_the_response_positions_and_gives_the_full_logits_log_probs():
    lm = _lm()
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(3, 96, (3, 20), generator=g)
    mask = torch.ones_like(seq)
    mask[0, :5], mask[1, :2] = 0, 0  # left-padded prompts
    n_act = 7
    rows = []
    hook = lm.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    logp = Actor(lm)(seq, mask, n_act, temperature=0.7)
    hook.remove()
    assert rows == [n_act + 1], rows  # not all 20 positions
    with torch.no_grad():
        full = lm(input_ids=seq, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False).logits
    ref = log_probs_from_logits(full[:, -n_act - 1 : -1], seq[:, -n_act:], temperature=0.7)
    # The same rows through the lm_head: equal up to the GEMM's summation order for another row count.
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)
    logp.sum().backward()
    assert lm.lm_head.weight.grad is not None and torch.isfinite(lm.lm_head.weight.grad).all()


class _NoKeep(nn.Module):
    """A causal LM whose forward has no logits_to_keep: the Actor computes every position's logits, as before."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache)


def test_models_without_logits_to_keep_still_work():
    lm = _lm()
    seq = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(seq)
    a, b = Actor(_NoKeep(lm)), Actor(lm)
    assert not a._logits_to_keep and b._logits_to_keep
    torch.testing.assert_close(a(seq, mask, 5), b(seq, mask, 5), rtol=0, atol=1e-5)
