"""`--ds.use_liger_kernel` on the GPU: Liger's RMSNorm / rotary (and BF16 SwiGLU) kernels in the policy's forward
give the transformers forward's log-probs and gradients, and an FP8 MLP keeps the flow's fused SwiGLU."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from gpu_testutil import requires_cuda_reason, sqnr_db

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason),
    pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("transformers") is None,
                       reason="needs liger-kernel and transformers"),
]


@pytest.fixture
def restore_rope():
    """Liger patches transformers' module-level rotary function: give it back so later tests run transformers' own."""
    from transformers.models.llama import modeling_llama

    saved = modeling_llama.apply_rotary_pos_emb
    yield
    modeling_llama.apply_rotary_pos_emb = saved


def _lm():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1 and a few outlier channels, so the norm kernels have work to do
        for name, p in lm.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
        lm.model.layers[0].input_layernorm.weight[:4] *= 12
    return lm.to("cuda", torch.bfloat16)


def _run(lm, seq, mask, n_act):
    from openrlhf.models.actor import Actor

    lm.zero_grad(set_to_none=True)
    logp = Actor(lm)(seq, mask, n_act)
    (logp * torch.linspace(-1, 1, logp.numel(), device="cuda").view_as(logp)).sum().backward()
    return logp.detach().float(), {n: p.grad.float() for n, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recipe", ["bf16", "jet_fp8"])
def test_liger_forward_and_grads_match_transformers(recipe, restore_rope):
    from jetrl_precision import convert_to_fp8, get_recipe
    from jetrl_precision.swiglu import SwiGLUMLP
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.llama import modeling_llama

    from openrlhf.models.liger import apply_liger_kernels

    base = _lm()
    r = get_recipe(recipe).replace(gemm_backend="torch") if recipe != "bf16" else get_recipe(recipe)
    g = torch.Generator(device="cuda").manual_seed(3)
    seq = torch.randint(3, 1024, (4, 160), generator=g, device="cuda")
    mask = torch.ones_like(seq)
    mask[0, :40], mask[1, :7] = 0, 0  # left-padded prompts, as rollouts are
    bf16_logp, bf16_grads = _run(copy.deepcopy(base), seq, mask, 96)  # transformers, BF16: the reference
    plain_logp, plain_grads = _run(convert_to_fp8(copy.deepcopy(base), r, side="train"), seq, mask, 96)

    fused = convert_to_fp8(copy.deepcopy(base), r, side="train")
    kernels = apply_liger_kernels(fused)
    assert modeling_llama.apply_rotary_pos_emb is liger_rotary_pos_emb
    mlp = fused.model.layers[0].mlp
    if recipe == "bf16":
        assert kernels == ("rms_norm", "rope", "swiglu") and mlp._get_name() == "LigerSwiGLUMLP"
    else:  # the FP8 MLP keeps the flow's SwiGLU, which also quantizes the product for down_proj
        assert kernels == ("rms_norm", "rope") and isinstance(mlp, SwiGLUMLP) and "forward" not in mlp.__dict__
    assert fused.model.layers[1].post_attention_layernorm._get_name() == "LigerRMSNorm"
    logp, grads = _run(fused, seq, mask, 96)

    # Liger rounds where transformers does (float32 norm, cast, then the weight) but sums in another order: against
    # BF16 transformers, the Liger model is as accurate as the same recipe without Liger (FP8's own error dominates).
    assert grads.keys() == bf16_grads.keys() == plain_grads.keys()
    assert (logp - plain_logp).abs().mean() < 0.02, (logp - plain_logp).abs().mean()
    if recipe == "bf16":
        assert sqnr_db(logp, bf16_logp) > 30
        worst = min((sqnr_db(grads[n], bf16_grads[n]), n) for n in grads)
        assert worst[0] > 20, worst
    else:
        assert sqnr_db(logp, bf16_logp) > sqnr_db(plain_logp, bf16_logp) - 1.5
        for n in grads:
            with_liger, without = sqnr_db(grads[n], bf16_grads[n]), sqnr_db(plain_grads[n], bf16_grads[n])
            assert with_liger > without - 1.5, (n, with_liger, without)
