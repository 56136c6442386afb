"""The actor update's micro-step on a GPU: no host synchronization from the project's code.

A synchronizing call (a host read of a device tensor, a copy from pageable memory) drains the GPU's queue; the
update's micro-steps must make none between optimizer steps (tests/rl/test_update_host_reads.py counts the reads on
CPU). Here torch's sync debug mode names each synchronizing call and the Python line that made it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from gpu_testutil import requires_cuda_reason

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

_ROOT = Path(__file__).resolve().parents[2]
_OURS = tuple(str(_ROOT / d) for d in ("openrlhf", "jetrl_precision"))


def _sync_sites(fn) -> list[tuple[str, int]]:
    """(file, line) of every synchronizing call `fn` makes, as torch's sync debug mode reports them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [(w.filename, w.lineno) for w in caught if "synchronizing" in str(w.message)]


def _experience(device="cpu"):
    from openrlhf.trainer.ppo_utils.experience_maker import Experience

    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, 1000, (4, 96), generator=g)
    attn = torch.ones_like(seq)
    attn[:2, :7] = 0
    am = torch.ones(4, 64, dtype=torch.bool)
    am[1, 50:] = False
    lp = -torch.rand(4, 64, generator=g)
    return Experience(seq, attn, am, lp, old_logprobs=lp + 0.01, advantages=torch.randn(4, 64, generator=g))


def test_a_non_blocking_micro_batch_copy_does_not_synchronize():
    exp = _experience()
    torch.cuda.synchronize()
    assert _sync_sites(lambda: exp.to(torch.device("cuda"))), "the check is blind: a pageable copy must synchronize"
    moved = []
    assert _sync_sites(lambda: moved.append(exp.to(torch.device("cuda"), non_blocking=True))) == []
    torch.cuda.synchronize()
    assert all(torch.equal(getattr(moved[0], k).cpu(), getattr(exp, k)) for k in ("sequences", "action_mask", "advantages"))


@pytest.mark.parametrize("recipe", ["bf16", "jet_fp8"])
def test_an_actor_micro_step_makes_no_sync_of_ours(recipe):
    import transformers

    from jetrl_precision import Fp8Converter, get_recipe
    from openrlhf.models.actor import Actor
    from openrlhf.models.loss import PolicyLoss, aggregate_loss

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        lm = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    if recipe != "bf16":
        Fp8Converter(get_recipe(recipe), side="train").convert(lm)
    actor = Actor(lm)
    actor.gradient_checkpointing_enable()
    loss_fn = PolicyLoss(0.2, 0.2)
    mb = _experience().to(torch.device("cuda"), non_blocking=True)

    def micro_step():
        logp = actor(mb.sequences, mb.attention_mask, mb.num_actions)
        out = loss_fn(logp, mb.old_logprobs, mb.advantages, mb.action_mask)
        loss = aggregate_loss(out.token_loss, mb.action_mask, 256.0, 1.0)
        loss.backward()

    micro_step()  # the first call builds plans and runs one-time device probes (those may read back)
    torch.cuda.synchronize()
    sites = _sync_sites(micro_step)
    ours = [s for s in sites if s[0].startswith(_OURS)]
    assert ours == [], ours
    # Others' syncs (transformers' mask checks, for one) are reported, not failed on: they are not ours to remove.
    print(f"{recipe}: synchronizing calls outside the project: {sorted(set(sites))}")
