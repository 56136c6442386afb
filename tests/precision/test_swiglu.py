"""Fused SwiGLU MLPs (`jetrl_precision.swiglu`): same values and gradients bit for bit, fewer saved tensors.

On CPU the forward is the plain expression (the fused kernel is Triton/CUDA; tests/gpu/test_swiglu_gpu.py checks
it), so these tests pin down the module swap, the autograd function's backward and the saved-tensor saving.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from precision_testutil import outlier_data, tiny_causal_lm
from torch import nn

from jetrl_precision import build_precision_graph, convert_to_fp8
from jetrl_precision.swiglu import SwiGLUMLP, fuse_swiglu, set_dy_quantization, silu_mul

# Bit-for-bit comparisons of two models: one intra-op thread, since a loaded machine (CI's two pytest workers) can
# change how many threads a CPU matmul splits its sums over, and with it the last bits (seen about once in four runs).
pytestmark = pytest.mark.usefixtures("single_thread")


def _fwd_bwd(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits.float().pow(2).mean()).backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _saved_bytes(fn) -> int:
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("recipe", ["jet_fp8", None])
def test_fused_model_matches_the_original_bit_for_bit(arch, recipe):
    base = tiny_causal_lm(arch, dtype=torch.bfloat16, seed=3)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    plain, fused = copy.deepcopy(base), copy.deepcopy(base)
    if recipe is None:
        assert fuse_swiglu(fused) == 2
    else:
        convert_to_fp8(plain, recipe, fuse_swiglu=False)
        convert_to_fp8(fused, recipe)
    mlps = [m for m in fused.modules() if isinstance(m, SwiGLUMLP)]
    assert len(mlps) == 2 and not any(isinstance(m, SwiGLUMLP) for m in plain.modules())
    assert list(fused.state_dict()) == list(plain.state_dict())  # parameter names unchanged
    assert mlps[0].source_class == f"{'Llama' if arch == 'llama' else 'Qwen2'}MLP"
    y0, g0 = _fwd_bwd(plain, ids)
    y1, g1 = _fwd_bwd(fused, ids)
    assert torch.equal(y0, y1)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert torch.equal(g0[name], g1[name]), f"gradient of {name} differs"


def test_module_swap_keeps_the_parameter_objects():
    model = tiny_causal_lm("llama", layers=1)
    mlp = model.model.layers[0].mlp
    params = {id(p) for p in mlp.parameters()}
    fuse_swiglu(model)
    new = model.model.layers[0].mlp
    assert isinstance(new, SwiGLUMLP) and {id(p) for p in new.parameters()} == params


def test_silu_mul_gradients_equal_autograd_and_save_less():
    g = outlier_data((96, 384), dtype=torch.bfloat16, generator=torch.Generator().manual_seed(4)).requires_grad_()
    u = outlier_data((96, 384), dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5)).requires_grad_()
    dh = outlier_data((96, 384), dtype=torch.bfloat16, generator=torch.Generator().manual_seed(6))
    ref = F.silu(g) * u
    got = silu_mul(g, u)
    assert torch.equal(ref, got)
    ref_grads = torch.autograd.grad(ref, (g, u), dh)
    got_grads = torch.autograd.grad(got, (g, u), dh)
    for r, t in zip(ref_grads, got_grads):
        assert torch.equal(r, t)
    # Only the gate's gradient wanted: the up path is skipped, the gate path unchanged.
    (dg_only,) = torch.autograd.grad(silu_mul(g, u.detach()), (g,), dh)
    assert torch.equal(dg_only, ref_grads[0])
    # Autograd keeps gate, silu(gate) and up for the unfused expression; the fused one keeps gate and up.
    one = g.numel() * g.element_size()
    assert _saved_bytes(lambda: F.silu(g) * u) == 3 * one
    assert _saved_bytes(lambda: silu_mul(g, u)) == 2 * one


def test_silu_mul_rejects_mismatched_operands():
    with pytest.raises(ValueError, match="one shape and dtype"):
        silu_mul(torch.zeros(4, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="one shape and dtype"):
        silu_mul(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16))


class _GeluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn = nn.GELU()


class _MyMLP(_GeluMLP):
    def __init__(self) -> None:
        super().__init__()
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_only_known_or_named_silu_mlps_are_fused(caplog):
    model = nn.ModuleDict({"a": _MyMLP(), "b": _GeluMLP()})
    assert fuse_swiglu(model) == 0  # _MyMLP is not a known class until it is named
    with caplog.at_level(logging.INFO, logger="jetrl_precision.swiglu"):
        assert fuse_swiglu(model, classes=[_MyMLP, "_GeluMLP"]) == 1
    assert isinstance(model["a"], SwiGLUMLP) and isinstance(model["b"], _GeluMLP)
    assert "GELU, not SiLU" in caplog.text
    x = torch.randn(3, 8)
    ref = _MyMLP()
    ref.load_state_dict(model["a"].state_dict())
    assert torch.equal(model["a"](x), ref(x))


def test_cpu_precision_graph_names_no_fused_producer():
    # The fused kernel runs only where the Triton implementation does; on CPU the graph must not claim it.
    model = convert_to_fp8(tiny_causal_lm("llama", layers=1), "jet_fp8")
    g = build_precision_graph(model, "jet_fp8", "train_fwd")
    node = g.nodes["model.layers.0.mlp.down_proj"]
    assert "input_producer" not in node.attrs
    assert g.edges_into(node.name)["input"].attrs.kernel == "reference"


def test_dy_quantization_is_claimed_only_for_a_stacked_fp8_gate_up():
    # The backward writes the stacked gate/up GEMM's FP8 dY only where that GEMM exists and quantizes dY 1x128; on
    # CPU the kernel does not run, so the graph keeps the reference quantizer on that edge.
    model = convert_to_fp8(tiny_causal_lm("llama", layers=1), "jet_fp8")
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, SwiGLUMLP) and mlp.fused_dy_quantization
    assert "fused_dy_quantization=True" in repr(mlp)
    g = build_precision_graph(model, "jet_fp8", "train_bwd")
    assert g.edges_into("model.layers.0.mlp.gate_proj")["dgrad.grad_output"].attrs.kernel == "reference"
    mlp.quantize_dy = False
    assert not mlp.fused_dy_quantization
    mlp.quantize_dy = True
    assert set_dy_quantization(model, False) == 1 and not mlp.fused_dy_quantization  # the one-call form
    assert set_dy_quantization(model, True) == 1 and mlp.fused_dy_quantization
    mlp.gate_proj._group.dissolve("test")
    assert not mlp.fused_dy_quantization
    separate = convert_to_fp8(tiny_causal_lm("llama", layers=1), "jet_fp8", fuse_projections=False)
    assert not separate.model.layers[0].mlp.fused_dy_quantization
    rollout = convert_to_fp8(tiny_causal_lm("llama", layers=1), "fp8_rollout")
    assert not any(getattr(m, "fused_dy_quantization", False) for m in rollout.modules())
