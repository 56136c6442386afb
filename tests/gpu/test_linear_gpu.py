"""The FP8 linear layer on the GPU: every backend, gradients by SQNR (CPU-test thresholds), saved bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu_testutil import outlier_data, rel_err, requires_cuda_reason, sqnr_db
from jetrl_precision import Fp8Linear, convert_to_fp8, get_recipe, mark_weights_updated
from jetrl_precision.gemm import available_backends

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

Y_DB, GRAD_DB = 25.0, 20.0


def _layers(n, k, backend, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        ref.weight.copy_(outlier_data(n, k, dtype=torch.float32, seed=seed) * 0.02)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(ref.weight)
    r = get_recipe("jet_fp8")
    return ref, Fp8Linear.from_linear(lin, r.train_fprop, r.train_backward, gemm_backend=backend)


def _run(layer, x, dy):
    x = x.detach().clone().requires_grad_(True)
    layer.weight.grad = None
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad.detach(), layer.weight.grad.detach()


@pytest.mark.parametrize("backend", ["torch", "triton", "deep_gemm", "emulated"])
@pytest.mark.parametrize("shape", [(1000, 1024, 512), (2048, 4096, 4096), (96, 384, 640)], ids=str)
def test_fp8_linear_sqnr(backend, shape):
    reason = available_backends("cuda")[backend]
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    m, n, k = shape
    ref, layer = _layers(n, k, backend)
    x = outlier_data(m, k, dtype=torch.float32, seed=1)
    dy = outlier_data(m, n, dtype=torch.float32, seed=2) * 1e-3
    y_r, dx_r, dw_r = _run(ref, x, dy)
    y, dx, dw = _run(layer, x.bfloat16(), dy.bfloat16())
    assert layer.resolved_backend == backend
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    assert sqnr_db(y, y_r) >= Y_DB, f"y SQNR {sqnr_db(y, y_r):.1f} dB"
    assert sqnr_db(dx, dx_r) >= GRAD_DB, f"dX SQNR {sqnr_db(dx, dx_r):.1f} dB"
    assert sqnr_db(dw, dw_r) >= GRAD_DB, f"dW SQNR {sqnr_db(dw, dw_r):.1f} dB"


def test_hardware_backends_match_emulated_flow():
    """Same quantized operands everywhere, so backends differ only by output rounding."""
    names = [b for b in ("torch", "triton", "deep_gemm") if available_backends("cuda")[b] is None]
    if not names:
        pytest.skip("no hardware backend here")
    m, n, k = 1000, 1536, 1024
    x = outlier_data(m, k, seed=3)
    dy = outlier_data(m, n, seed=4) * 1e-3
    _, emu = _layers(n, k, "emulated", seed=5)
    y_e, dx_e, dw_e = _run(emu, x, dy)
    for name in names:
        _, layer = _layers(n, k, name, seed=5)
        y, dx, dw = _run(layer, x, dy)
        for got, want, what in ((y, y_e, "y"), (dx, dx_e, "dX"), (dw, dw_e, "dW")):
            assert rel_err(got, want) <= 4e-3, f"{name} {what} vs emulated: {rel_err(got, want):.2e}"


def test_weight_cache_and_saved_bytes():
    ref, layer = _layers(2048, 4096, "auto")
    x = outlier_data(4096, 4096, seed=6).requires_grad_(True)
    saved = []

    def pack(t):
        if not isinstance(t, nn.Parameter):
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    # FP8 saves x8 (1 B/elem) + fp32 scales (4 B per 128 elems): 1.03 B/elem, vs 2 B/elem in bf16.
    assert sum(saved) == 4096 * 4096 + 4 * 4096 * 32
    wq = layer.quantized_weight()
    assert layer.quantized_weight() is wq  # cached while the weight is unchanged
    y.float().sum().backward()
    with torch.no_grad():
        layer.weight.mul_(1.01)
    assert layer.quantized_weight() is not wq  # the in-place update bumped the version
    mark_weights_updated()


def test_convert_small_mlp_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.SiLU(), nn.Linear(1024, 512)).cuda().bfloat16()
    convert_to_fp8(model, "jet_fp8")
    assert all(isinstance(model[i], Fp8Linear) for i in (0, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = outlier_data(384, 512, seed=7)
    target = outlier_data(384, 512, seed=8)
    losses = []
    for _ in range(30):
        loss = (model(x).float() - target.float()).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mark_weights_updated()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
