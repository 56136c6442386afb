"""RMSNorms fused with their consumers' FP8 quantization (`jetrl_precision.rmsnorm`): which norms are swapped, and that
on CPU (no kernel: transformers' formula) nothing changes, values and gradients bit for bit.

The kernels are Triton/CUDA: tests/precision/test_kernels_interpreted.py runs the backward kernel in Triton's
interpreter against a float64 reference, tests/gpu/test_rmsnorm_gpu.py both kernels on a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from precision_testutil import outlier_data, tiny_causal_lm
from torch import nn

from jetrl_precision import convert_to_fp8, default_module_filter, get_recipe
from jetrl_precision.rmsnorm import FusedRMSNorm, _FusedRMSNormFunction, formula_grads, fuse_rmsnorm, rms_norm_formula

# Bit-for-bit comparisons of two models: one intra-op thread, since a loaded machine (CI's two pytest workers) can
# change how many threads a CPU matmul splits its sums over, and with it the last bits (seen about once in four runs).
pytestmark = pytest.mark.usefixtures("single_thread")


def _fwd_bwd(model: nn.Module, ids: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_converted_model_fuses_the_layer_norms_and_keeps_its_values(arch):
    base = tiny_causal_lm(arch, dtype=torch.bfloat16, seed=4)
    plain, fused = copy.deepcopy(base), copy.deepcopy(base)
    convert_to_fp8(plain, "jet_fp8", fuse_rmsnorm=False)
    convert_to_fp8(fused, "jet_fp8")
    norms = {n: m for n, m in fused.named_modules() if isinstance(m, FusedRMSNorm)}
    # Two per layer (attention and MLP inputs); the final norm feeds the BF16 lm_head and stays.
    assert sorted(norms) == [f"model.layers.{i}.{a}" for i in range(2) for a in ("input_layernorm", "post_attention_layernorm")]
    assert type(fused.model.norm).__name__ == type(plain.model.norm).__name__
    assert {m.source_class for m in norms.values()} == {f"{'Llama' if arch == 'llama' else 'Qwen2'}RMSNorm"}
    assert next(iter(norms.values())).spec == get_recipe("jet_fp8").train_fprop.input
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert fused.model.layers[0].input_layernorm.weight is fused.model.layers[0].input_layernorm.weight
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(2))
    y0, g0 = _fwd_bwd(plain, ids)
    y1, g1 = _fwd_bwd(fused, ids)
    assert torch.equal(y0, y1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)


def test_swap_adopts_the_weight_parameter_and_epsilon():
    model = tiny_causal_lm("llama", seed=1)
    old = model.model.layers[1].post_attention_layernorm
    convert_to_fp8(model, "jet_fp8")
    new = model.model.layers[1].post_attention_layernorm
    assert isinstance(new, FusedRMSNorm) and new.weight is old.weight and new.variance_epsilon == old.variance_epsilon


def test_norms_whose_consumers_are_not_all_fp8_stay():
    """A norm whose projections are not all 1x128 FP8 (one kept in BF16 here) is left alone: its output must be
    read in high precision anyway, so quantizing it in the norm would be wasted."""
    recipe = get_recipe("jet_fp8")
    default = default_module_filter(recipe)
    model = tiny_causal_lm("llama", seed=2)
    convert_to_fp8(model, recipe, lambda m, fqn: default(m, fqn) and not fqn.endswith("layers.0.self_attn.v_proj"))
    fused = sorted(n for n, m in model.named_modules() if isinstance(m, FusedRMSNorm))
    assert "model.layers.0.input_layernorm" not in fused and len(fused) == 3
    assert convert_to_fp8(tiny_causal_lm("llama"), "bf16") is not None  # no FP8 layers: nothing to fuse
    assert fuse_rmsnorm(tiny_causal_lm("llama")) == 0


def test_other_norm_classes_join_by_name():
    class MyNorm(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))
            self.eps = 1e-6

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(256, 256, bias=False) for _ in range(3))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.self_attn = MyNorm(256), Attn()

    model = convert_to_fp8(nn.Sequential(Layer()), "jet_fp8")
    assert not isinstance(model[0].input_layernorm, FusedRMSNorm)  # an unknown class is not assumed to be Llama's formula
    assert fuse_rmsnorm(model, classes=[MyNorm]) == 1
    assert model[0].input_layernorm.variance_epsilon == 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_autograd_function_without_a_kernel_gives_the_formula_and_its_gradients(dtype):
    """Where no implementation has the kernel (CPU) the function computes transformers' formula and differentiates
    it: the same bits as autograd through the formula."""
    x = outlier_data((3, 7, 256), generator=torch.Generator().manual_seed(5)).to(dtype)
    w = (1 + 0.2 * torch.randn(256, generator=torch.Generator().manual_seed(6))).to(dtype)
    dy = torch.randn(3, 7, 256, generator=torch.Generator().manual_seed(7)).to(dtype)
    spec = get_recipe("jet_fp8").train_fprop.input
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    ya = _FusedRMSNormFunction.apply(xa, wa, 1e-5, spec)
    ya.backward(dy)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    yb = rms_norm_formula(xb, wb, 1e-5)
    yb.backward(dy)
    assert ya.shape == x.shape and torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad)


def test_cpu_precision_graph_names_no_fused_norm():
    # The fused kernel runs only where the Triton implementation does; on CPU the graph must not claim it.
    from jetrl_precision import build_precision_graph

    g = build_precision_graph(convert_to_fp8(tiny_causal_lm("llama", layers=1), "jet_fp8"), "jet_fp8", "train_fwd")
    q, norm = g.nodes["model.layers.0.self_attn.q_proj"], g.nodes["model.layers.0.input_layernorm"]
    assert "input_producer" not in q.attrs and "fused_quantization" not in norm.attrs
    assert g.edges_into(q.name)["input"].attrs.kernel == "reference"


class _FakeKernels:
    """kernels.fused's two norm kernels done in torch (the formula, the reference quantizer, autograd's gradients),
    with one flaw switched on at a time: what the device probe must catch."""

    def __init__(self, flaw: str = ""):
        self.flaw = flaw

    def rmsnorm_quantize(self, x, w, eps, pow2=False, return_hp=False):
        from jetrl_precision.quantize import quantize_fp8

        y = rms_norm_formula(x, w, eps)
        if self.flaw == "output":
            y = y * 1.01
        qt = quantize_fp8(y, (1, 128), pow2_scale=pow2, nonfinite="propagate")
        if self.flaw == "bytes":
            qt.data.view(torch.uint8)[3, 5] ^= 1
        return qt, y

    def rmsnorm_backward(self, dy, x, w, eps):
        if self.flaw == "raises":
            raise RuntimeError("PTX compile failed\nmore lines")
        gx, gw = formula_grads(x, w, eps, dy, (True, True))
        return (gx * 1.1 if self.flaw == "backward" else gx), gw


@pytest.mark.parametrize("flaw, why", [("", ""), ("output", "from transformers' formula"),
                                       ("bytes", "not the reference quantizer's"), ("backward", "backward's dx")])
def test_the_device_probe_catches_each_broken_contract(flaw, why):
    from jetrl_precision.kernels import rmsnorm_probe

    got = rmsnorm_probe.problems(_FakeKernels(flaw), *rmsnorm_probe.probe_values("cpu", torch.bfloat16))
    assert (got == "") if not flaw else (why in got), got


def test_a_failing_probe_turns_the_kernels_off_with_one_warning(monkeypatch, caplog):
    from jetrl_precision.kernels import rmsnorm_probe

    monkeypatch.setattr(rmsnorm_probe, "_verdicts", {})
    monkeypatch.setattr(rmsnorm_probe, "_reasons", {})
    with caplog.at_level("WARNING"):
        assert not rmsnorm_probe.fused_norm_ok(torch.device("cpu"), torch.bfloat16, _FakeKernels("raises"))
        assert not rmsnorm_probe.fused_norm_ok(torch.device("cpu"), torch.bfloat16, _FakeKernels("raises"))
        assert rmsnorm_probe.fused_norm_ok(torch.device("cpu"), torch.float32, _FakeKernels())
    warned = [r.getMessage() for r in caplog.records if "fused RMSNorm kernel" in r.getMessage()]
    assert len(warned) == 1 and "failed to run (RuntimeError: PTX compile failed)" in warned[0], warned


def test_bitwise_mode_takes_the_fused_norms_for_its_invariant_ones():
    """make_batch_invariant (kernels="triton") replaces every norm class in NORM_CLASSES by InvariantRMSNorm: the fused
    norms are among them, and the replacement adopts their weight and epsilon."""
    from jetrl_precision.batch_invariant.norm import NORM_CLASSES, InvariantRMSNorm

    model = convert_to_fp8(tiny_causal_lm("llama", layers=1), "jet_fp8")
    norm = model.model.layers[0].input_layernorm
    assert isinstance(norm, FusedRMSNorm) and type(norm).__name__ in NORM_CLASSES
    inv = InvariantRMSNorm.from_norm(norm)
    assert inv.weight is norm.weight and inv.variance_epsilon == norm.variance_epsilon
