"""RMSNorms fused with their consumers' FP8 quantization (`jetrl_precision.rmsnorm`) on the GPU: the norm's output
within an ulp of transformers' formula, its quantization handed to the projections (one quantizer launch fewer
per norm), the same bits from the training forward and a no-grad one, and the backward kernel against float64."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision import convert_to_fp8, get_recipe
from jetrl_precision.rmsnorm import FusedRMSNorm, rms_norm_formula

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

if torch.cuda.is_available():  # the kernel modules import Triton, which CPU installs do not have
    from jetrl_precision.kernels import fused, quant


class LlamaRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, without the dependency (the device has no transformers)."""

    def __init__(self, h: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):
        return rms_norm_formula(x, self.weight, self.variance_epsilon)


class _Attn(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(h, h, bias=False) for _ in range(4))

    def forward(self, x):  # not attention: the three consumers of one normed input are what this test needs
        return self.o_proj(self.q_proj(x) * torch.sigmoid(self.k_proj(x)) + self.v_proj(x))


class _MLP(nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False), nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, h: int = 512, i: int = 1408) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = LlamaRMSNorm(h), _Attn(h)
        self.post_attention_layernorm, self.mlp = LlamaRMSNorm(h), _MLP(h, i)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def _pair():
    torch.manual_seed(0)
    base = nn.Sequential(_Layer(), _Layer()).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if p.dim() == 2:
                p.copy_(outlier_data(p.shape[0], p.shape[1], dtype=torch.float32, seed=p.numel() % 89) * 0.03)
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    plain = convert_to_fp8(copy.deepcopy(base), "jet_fp8", fuse_rmsnorm=False)
    fused_model = convert_to_fp8(copy.deepcopy(base), "jet_fp8")
    assert sum(isinstance(m, FusedRMSNorm) for m in fused_model.modules()) == 4
    return plain, fused_model


def _ulps(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (a.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-30)


def test_fused_norm_is_the_formula_within_an_ulp_and_feeds_its_quantization(monkeypatch):
    plain, fused_model = _pair()
    x = outlier_data(300, 512, seed=1).view(3, 100, 512)  # 300 tokens: a partial 128-row block
    norm = fused_model[0].input_layernorm
    y = norm(x)
    y_ref = rms_norm_formula(x, norm.weight, norm.variance_epsilon)
    assert _ulps(y, y_ref).max().item() <= 2 ** -6 * 1.01 and (y != y_ref).float().mean().item() < 0.02
    with torch.no_grad():  # first use runs the device probes (norm, padding, requantizer), which quantize too
        plain(x), fused_model(x)
    calls = []
    real = quant.quantize_1x128
    monkeypatch.setattr(quant, "quantize_1x128", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        out_plain = plain(x)
        n_plain = len(calls)
        calls.clear()
        out_fused = fused_model(x)
        n_fused = len(calls)
    # Each fused norm's consumers find Q(y) in the share cache: one activation quantizer launch fewer per norm.
    assert n_plain - n_fused == 4, (n_plain, n_fused)
    err = (out_fused.float() - out_plain.float()).norm() / out_plain.float().norm()
    assert err.item() < 2e-2  # a few 1-ulp differences in y, carried through FP8 quantization


def test_training_forward_and_no_grad_forward_give_the_same_bits():
    """The policy's training forward and its old-logprob / reference passes run the same kernels."""
    _, fused_model = _pair()
    x = outlier_data(256, 512, seed=2).view(2, 128, 512)
    with torch.no_grad():
        a = fused_model(x)
    b = fused_model(x.clone().requires_grad_())
    assert torch.equal(a, b.detach())
    norm = fused_model[0].input_layernorm  # another batch size: the norm's rows do not depend on it
    with torch.no_grad():
        assert torch.equal(norm(x[:1]), norm(x)[:1])


def test_fused_model_gradients_follow_the_unfused_ones():
    plain, fused_model = _pair()
    x = outlier_data(512, 512, seed=3).view(4, 128, 512)
    dy = outlier_data(512, 512, seed=4).view(4, 128, 512)
    grads = []
    for model in (plain, fused_model):
        model.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        model(xg).backward(dy)
        grads.append({"x": xg.grad, **{n: p.grad for n, p in model.named_parameters()}})
    for name, g0 in grads[0].items():
        g1 = grads[1][name]
        sqnr = 10 * torch.log10(g0.float().pow(2).sum() / (g1.float() - g0.float()).pow(2).sum().clamp_min(1e-30))
        assert sqnr.item() > 25, f"{name}: {sqnr.item():.1f} dB"


@pytest.mark.parametrize("shape", [(300, 576), (8192, 4096)])
def test_backward_kernel_against_float64(shape):
    x = outlier_data(*shape, seed=5)
    w = (1 + 0.2 * torch.randn(shape[1], device="cuda")).to(torch.bfloat16)
    dy = outlier_data(*shape, seed=6)
    dx, dw = fused.rmsnorm_backward(dy, x, w, 1e-5)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    (wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5))).backward(dy.double())
    xh, wh = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm_formula(xh, wh, 1e-5).backward(dy)

    def rel(a, ref):
        return ((a.double() - ref).abs().max() / ref.abs().max()).item()

    assert rel(dx, xd.grad) <= 2 ** -6 and rel(dx, xd.grad) <= 3 * rel(xh.grad, xd.grad) + 2 ** -9
    assert rel(dw, wd.grad) <= 2 ** -6 and rel(dw, wd.grad) <= 3 * rel(wh.grad, wd.grad) + 2 ** -9


def test_precision_graph_names_the_norm_kernel_as_the_projections_input_producer():
    from jetrl_precision import build_precision_graph
    from jetrl_precision.graph import canonical_name

    plain, fused_model = _pair()
    g = build_precision_graph(fused_model, "jet_fp8", "train_fwd")
    for proj in ("0.self_attn.q_proj", "0.self_attn.v_proj", "1.mlp.gate_proj", "1.mlp.up_proj"):
        node = g.nodes[canonical_name(proj)]
        assert node.attrs["input_producer"] == "rmsnorm_quantize", proj
        assert g.edges_into(node.name)["input"].attrs.kernel == "triton:rmsnorm_quantize"
    assert g.nodes[canonical_name("1.post_attention_layernorm")].attrs["fused_quantization"] == "rmsnorm_quantize"
    assert "input_producer" not in g.nodes[canonical_name("0.mlp.down_proj")].attrs  # fed by SiLU*up, not by a norm
    gp = build_precision_graph(plain, "jet_fp8", "train_fwd")
    assert "input_producer" not in gp.nodes[canonical_name("0.self_attn.q_proj")].attrs
