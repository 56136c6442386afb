"""The fused SwiGLU MLP on the GPU: bit-for-bit the unfused jet_fp8 MLP, one quantization fewer, less saved."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpu_testutil import fwd_bwd, outlier_data, requires_cuda_reason
from jetrl_precision import build_precision_graph, convert_to_fp8, get_recipe
from jetrl_precision.swiglu import SwiGLUMLP, fuse_swiglu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

if torch.cuda.is_available():  # the kernel modules import Triton, which CPU installs do not have
    from jetrl_precision.kernels import fused, quant, swiglu_probe


class _MLP(nn.Module):
    """transformers' LlamaMLP with mlp_bias=True, without the dependency (the device has no transformers)."""

    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = (nn.Linear(h, i) for _ in range(2))
        self.down_proj, self.act_fn = nn.Linear(i, h), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _pair(backend: str, h: int = 512, i: int = 1408):
    torch.manual_seed(0)
    base = nn.Sequential(_MLP(h, i)).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(outlier_data(p.shape[0], p[0].numel(), dtype=torch.float32, seed=p.numel() % 97).view(p.shape) * 0.03)
    recipe = get_recipe("jet_fp8").replace(gemm_backend=backend)
    plain = convert_to_fp8(copy.deepcopy(base), recipe, fuse_swiglu=False)
    fused_model = convert_to_fp8(copy.deepcopy(base), recipe)
    assert fuse_swiglu(fused_model, classes=[_MLP]) == 1
    assert isinstance(fused_model[0], SwiGLUMLP) and fused_model[0].fused_quantization
    return plain, fused_model


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_fused_mlp_is_bitwise_the_unfused_one(backend, monkeypatch):
    plain, fused_model = _pair(backend)
    x = outlier_data(300, 512, seed=1).view(3, 100, 512)  # 300 tokens: a partial 128-row block
    dy = outlier_data(300, 512, seed=2).view(3, 100, 512)
    y0, dx0, g0 = fwd_bwd(plain, x, dy)
    # On the H200 the fused backward's bytes are autograd's (the probe passes), so the MLP takes it: the kernel that
    # also quantizes dY, since gate and up run as one stacked GEMM.
    assert swiglu_probe.fused_backward_ok(fused.silu_mul_backward, torch.device("cuda"), torch.bfloat16)
    assert fused_model[0].fused_dy_quantization
    calls = []
    real = fused.silu_mul_backward_quantize
    fwd_bwd(fused_model, x, dy)  # the first backward runs the kernel's device probe too
    monkeypatch.setattr(fused, "silu_mul_backward_quantize", lambda *a: calls.append(a[1].shape) or real(*a))
    y1, dx1, g1 = fwd_bwd(fused_model, x, dy)
    assert calls == [(300, 1408)]  # the fused backward ran (the device probe passed), on every token at once
    assert torch.equal(y0, y1)
    assert torch.equal(dx0, dx1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), f"gradient of {name} differs"


def test_down_proj_takes_the_fused_quantization(monkeypatch):
    plain, fused_model = _pair("auto")
    x = outlier_data(256, 512, seed=3)
    with torch.no_grad():  # the stacked gate/up's one-time check (grouped.py) quantizes extra rows on a first call
        plain(x), fused_model(x)
    calls = {"1x128": 0, "silu_mul": 0}

    def counting(fn, key):
        def wrapped(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(quant, "quantize_1x128", counting(quant.quantize_1x128, "1x128"))
    monkeypatch.setattr(fused, "silu_mul_quantize", counting(fused.silu_mul_quantize, "silu_mul"))
    with torch.no_grad():
        plain(x)
        assert calls == {"1x128": 2, "silu_mul": 0}  # x once (gate and up share it), then h
        fused_model(x)
        assert calls == {"1x128": 3, "silu_mul": 1}  # x once; h and Q(h) come from the SwiGLU kernel


def test_fused_mlp_saves_less_for_backward():
    plain, fused_model = _pair("auto")
    x = outlier_data(512, 512, seed=4).requires_grad_()

    def saved(model) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x)
        return sum(seen.values())

    # The unfused MLP also keeps silu(gate): one bf16 [tokens, intermediate] tensor more.
    assert saved(plain) - saved(fused_model) == 512 * 1408 * 2


def test_precision_graph_names_the_fused_producer():
    _, fused_model = _pair("auto")
    g = build_precision_graph(fused_model, "jet_fp8", "train_fwd")
    node = g.nodes["0.down_proj"]
    assert node.attrs["input_producer"] == "silu_mul_quantize"
    assert g.edges_into("0.down_proj")["input"].attrs.kernel == "triton:silu_mul_quantize"
    assert g.edges_into("0.gate_proj")["input"].attrs.kernel == "triton"


@pytest.mark.parametrize("halves", [True, False], ids=["halves-of-one-buffer", "separate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_backward_is_autograds_bytes(dtype, halves):
    """silu_mul_backward: the bytes of aten's silu_backward(dh * up, gate) and dh * silu(gate), with outliers and
    large |gate|. For gate and up as the two halves of one stacked gate_up output (strided views), dgate and dup are
    the halves of one new buffer (the stacked GEMM's dY, read without a copy); for separate tensors, each its own."""
    m, i = 1000, 1408
    gu = outlier_data(m, 2 * i, dtype=torch.float32, seed=5).to(dtype)
    gu[:, :8] = torch.tensor([30.0, -30.0, 88.0, -88.0, 1e-3, -1e-3, 0.5, -0.5], device="cuda").to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    if not halves:
        gate, up = gate.contiguous(), up.contiguous()
    dh = outlier_data(m, i, dtype=torch.float32, seed=6).to(dtype)
    dgate, dup = fused.silu_mul_backward(dh, gate, up)
    ref_dgate = torch.ops.aten.silu_backward(dh * up, gate)
    ref_dup = dh * torch.nn.functional.silu(gate)
    if halves:
        assert dgate.stride() == dup.stride() == (2 * i, 1)
        assert dup.data_ptr() == dgate.data_ptr() + i * dgate.element_size(), "dup is not the right half of dgate's buffer"
    else:
        assert dgate.is_contiguous() and dup.is_contiguous()
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    diff_g = (dgate.view(bits) != ref_dgate.view(bits)).sum().item()
    diff_u = (dup.view(bits) != ref_dup.view(bits)).sum().item()
    assert (diff_g, diff_u) == (0, 0), f"{diff_g} dgate and {diff_u} dup elements differ from autograd's kernels"


@pytest.mark.parametrize("pow2", [False, True])
def test_quantizing_backward_writes_the_reference_quantizers_bytes_of_its_dy(pow2):
    """silu_mul_backward_quantize: dY = [dgate, dup] byte-equal to silu_mul_backward's halves, and Q(dY, 1x128) the
    reference quantizer's bytes of that dY (data and scales), with outliers and a partial last row block."""
    from jetrl_precision.quantize import quantize_fp8

    m, i = 1000, 1408
    gu = outlier_data(m, 2 * i, dtype=torch.float32, seed=7).bfloat16()
    gu[:, :8] = torch.tensor([30.0, -30.0, 88.0, -88.0, 1e-3, -1e-3, 0.5, -0.5], device="cuda").bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    dh = outlier_data(m, i, seed=8)
    d, qt = fused.silu_mul_backward_quantize(dh, gate, up, pow2)
    dgate, dup = fused.silu_mul_backward(dh, gate, up)
    assert torch.equal(d.view(torch.int16), torch.cat([dgate, dup], 1).view(torch.int16))
    ref = quantize_fp8(d, (1, 128), pow2_scale=pow2)
    assert torch.equal(qt.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(qt.scale, ref.scale)
    with pytest.raises(ValueError, match="multiple of 128"):
        fused.silu_mul_backward_quantize(dh[:, :100], gate[:, :100], up[:, :100])


def test_stacked_gate_up_dgrad_takes_the_backwards_quantization(monkeypatch):
    """With gate/up as one stacked GEMM, its DGrad's 1x128 dY comes from the SwiGLU backward: one 1x128 quantizer
    call fewer per backward than with `quantize_dy` off, and the same gradients byte for byte."""
    _, on = _pair("auto")
    off = copy.deepcopy(on)
    off[0].quantize_dy = False
    assert on[0].fused_dy_quantization and not off[0].fused_dy_quantization
    g = build_precision_graph(on, "jet_fp8", "train_bwd")
    assert g.edges_into("0.gate_proj")["dgrad.grad_output"].attrs.kernel == "triton:silu_mul_backward_quantize"
    x, dy = outlier_data(384, 512, seed=9), outlier_data(384, 512, seed=10)
    for model in (on, off):  # first calls: the stacked GEMM's one-time check and the kernels' probes
        fwd_bwd(model, x, dy)
    counts = []
    real = quant.quantize_1x128

    def counting(*a, **k):
        counts[-1] += 1
        return real(*a, **k)

    monkeypatch.setattr(quant, "quantize_1x128", counting)
    results = []
    for model in (on, off):
        counts.append(0)
        results.append(fwd_bwd(model, x, dy))
    assert counts[1] - counts[0] == 1, counts
    (y0, dx0, g0), (y1, dx1, g1) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), f"gradient of {name} differs"
