"""`apply_liger_kernels` patches this model's modules only, keeps an FP8 MLP on the flow's SwiGLU, and names an
unsupported model. Liger imports Triton: without it (CPU installs) these skip; tests/gpu/test_liger_gpu.py runs the
kernels on the GPU."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None,
    reason="needs liger-kernel and triton",
)


@pytest.fixture
def modeling_llama():
    """transformers' Llama module, its rotary function given back afterwards (Liger patches it for the process)."""
    from transformers.models.llama import modeling_llama as m

    saved = m.apply_rotary_pos_emb
    yield m
    m.apply_rotary_pos_emb = saved


def _names(model):
    return {type(m).__name__: m._get_name() for m in model.modules()}


def test_bf16_model_gets_norm_rope_and_swiglu_and_the_module_keeps_its_classes(modeling_llama):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from precision_testutil import tiny_causal_lm

    from jetrl_precision import build_precision_graph
    from openrlhf.models.liger import apply_liger_kernels

    classes = (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)
    lm = tiny_causal_lm(hidden=128, intermediate=256, layers=2, vocab=64)
    assert apply_liger_kernels(lm) == ("rms_norm", "rope", "swiglu")
    names = _names(lm)
    assert names["LlamaRMSNorm"] == "LigerRMSNorm" and names["LlamaMLP"] == "LigerSwiGLUMLP"
    assert modeling_llama.apply_rotary_pos_emb is liger_rotary_pos_emb
    assert build_precision_graph(lm, "bf16", "train_fwd").meta["norm_impl"] == "LigerRMSNorm"  # what the log shows
    assert (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP) == classes  # a later model is transformers' own
    assert _names(tiny_causal_lm(hidden=128, intermediate=256, layers=1, vocab=64))["LlamaMLP"] == "LlamaMLP"


def test_fp8_mlp_keeps_the_flows_fused_swiglu(modeling_llama):
    from precision_testutil import tiny_causal_lm

    from jetrl_precision import convert_to_fp8, get_recipe
    from jetrl_precision.swiglu import SwiGLUMLP
    from openrlhf.models.liger import apply_liger_kernels

    lm = convert_to_fp8(tiny_causal_lm(hidden=128, intermediate=256, layers=2, vocab=64), get_recipe("jet_fp8"), side="train")
    assert apply_liger_kernels(lm) == ("rms_norm", "rope")
    mlp = lm.model.layers[0].mlp
    assert isinstance(mlp, SwiGLUMLP) and "forward" not in vars(mlp)
    assert lm.model.norm._get_name() == "LigerRMSNorm"
    # A reference model converted after the policy was patched is fused the same way.
    ref = convert_to_fp8(tiny_causal_lm(hidden=128, intermediate=256, layers=1, vocab=64), get_recipe("jet_fp8"), side="train")
    assert isinstance(ref.model.layers[0].mlp, SwiGLUMLP)


def test_a_model_liger_does_not_know_is_refused_by_name():
    from torch import nn

    from openrlhf.models.liger import apply_liger_kernels

    m = nn.Linear(4, 4)
    m.config = type("C", (), {"model_type": "not-a-model"})()
    with pytest.raises(ValueError, match="not-a-model"):
        apply_liger_kernels(m)
