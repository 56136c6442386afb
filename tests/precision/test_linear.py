"""Fp8Linear: accuracy vs BF16, exact agreement with an emulated float64 flow, Parameter identity,
the weight-quantization cache, saved-activation memory, NaN behaviour, and GEMM dispatch on CPU."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

from precision_testutil import gamma, matmul_bound, outlier_data, sqnr_db
from jetrl_precision import (
    BackendUnavailable,
    Fp8Converter,
    Fp8Linear,
    available_backends,
    convert_to_fp8,
    fp8_linears,
    get_recipe,
    mark_weights_updated,
    quantize_fp8,
    resolve_backend,
)
from jetrl_precision.gemm import gemm_nt

JET = get_recipe("jet_fp8")


def make_fp8(lin: nn.Linear) -> Fp8Linear:
    return Fp8Linear.from_linear(lin, JET.train_fprop, JET.train_backward, "emulated")


def make_linear(k: int, n: int, bias: bool = True, dtype: torch.dtype = torch.float32) -> nn.Linear:
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        # Weights with per-block magnitude variation and a few large entries, like trained LLM weights.
        lin.weight.copy_(outlier_data((n, k), sigma=0.5, spikes=4, spike_factor=20.0) * k**-0.5)
        if bias:
            lin.bias.copy_(torch.randn(n) * 0.1)
    return lin.to(dtype)


# ---- accuracy vs BF16 ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sqnr_vs_bf16_linear(dtype):
    k, n = 512, 384
    lin = make_linear(k, n)
    ref = copy.deepcopy(lin).to(torch.bfloat16)
    fp8 = make_fp8(lin.to(dtype))
    x = outlier_data((4, 64, k), spikes=8)
    gy = outlier_data((4, 64, n), spikes=8, sigma=1.0)
    x8 = x.to(dtype).detach().clone().requires_grad_()
    xb = x.to(torch.bfloat16).detach().clone().requires_grad_()
    y8, yb = fp8(x8), ref(xb)
    y8.backward(gy.to(dtype))
    yb.backward(gy.to(torch.bfloat16))
    assert y8.dtype == dtype and x8.grad.dtype == dtype and fp8.weight.grad.dtype == dtype
    s_y, s_dx, s_dw = sqnr_db(yb, y8), sqnr_db(xb.grad, x8.grad), sqnr_db(ref.weight.grad, fp8.weight.grad)
    assert s_y >= 25.0, f"output SQNR {s_y:.1f} dB"
    assert s_dx >= 20.0, f"dX SQNR {s_dx:.1f} dB"
    assert s_dw >= 20.0, f"dW SQNR {s_dw:.1f} dB"
    assert sqnr_db(ref.bias.grad, fp8.bias.grad) >= 40.0  # bias grad is a plain bf16 sum, not quantized


# ---- exact agreement with the quantized math in float64 -------------------------------------------
def emulated_f64(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, gy: torch.Tensor):
    """The Jet-RL flow written out: quantize with quantize_fp8, dequantize to float64, matmul in float64."""
    d = lambda qt: qt.data.double() * qt.expanded_scale().double()  # noqa: E731  (exact in float64)
    xq = quantize_fp8(x2, (1, 128))
    wq = quantize_fp8(w, (128, 128))
    y = d(xq) @ d(wq).t()
    if b is not None:
        y = y + b.double()
    dx = d(quantize_fp8(gy, (1, 128))) @ d(wq)
    x_tok = quantize_fp8(xq.dequantize(torch.float32), (128, 1))  # the saved FP8 activation, re-grouped along tokens
    dw = d(quantize_fp8(gy, (128, 1))).t() @ d(x_tok)
    db = gy.double().sum(0) if b is not None else None
    ops = {"y": (d(xq), d(wq).t()), "dx": (d(quantize_fp8(gy, (1, 128))), d(wq)), "dw": (d(quantize_fp8(gy, (128, 1))).t(), d(x_tok))}
    return y, dx, dw, db, ops


def fp32_bound(a: torch.Tensor, b: torch.Tensor, extra: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Worst-case fp32 error of a @ b (+ bias) in any summation order: K products and sums, plus
    the fp32 dequantization of each operand, the bias add and the output rounding (4 roundings)."""
    return matmul_bound(a, b, extra, roundings=4)


@pytest.mark.parametrize("k,n,bias", [(256, 384, True), (512, 256, False), (192, 320, True)], ids=["aligned", "nobias", "unaligned"])
def test_matches_float64_emulation_within_fp32_rounding(k, n, bias):
    m = 300  # tokens: not a multiple of 128 either
    lin = make_linear(k, n, bias=bias)
    fp8 = make_fp8(lin)
    x = outlier_data((3, 100, k), spikes=6).requires_grad_()
    gy = outlier_data((3, 100, n), spikes=6, sigma=1.0)
    y = fp8(x)
    y.backward(gy)
    x2, gy2 = x.detach().reshape(m, k), gy.reshape(m, n)
    y_ref, dx_ref, dw_ref, db_ref, ops = emulated_f64(x2, lin.weight.detach(), lin.bias.detach() if bias else None, gy2)

    bias_abs = lin.bias.detach().double().abs() if bias else 0.0
    checks = {
        "y": (y.detach().reshape(m, n), y_ref, fp32_bound(*ops["y"], bias_abs)),
        "dX": (x.grad.reshape(m, k), dx_ref, fp32_bound(*ops["dx"])),
        "dW": (fp8.weight.grad, dw_ref, fp32_bound(*ops["dw"])),
    }
    for name, (got, ref, bound) in checks.items():
        err = (got.double() - ref).abs()
        assert (err <= bound).all(), f"{name}: max excess {(err - bound).max().item():.3e}"
        # The bound is tight enough to catch a different quantization (it is not a loose tolerance).
        assert bound.max() < 1e-3 * ref.abs().max()
    if bias:
        db_bound = gamma(m + 2) * gy2.double().abs().sum(0)
        assert ((fp8.bias.grad.double() - db_ref).abs() <= db_bound).all()
    else:
        assert fp8.bias is None

    # Sanity: the same check rejects the unquantized gradient (so the test can fail).
    dw_exact = gy2.double().t() @ x2.double()
    assert not ((dw_exact - dw_ref).abs() <= checks["dW"][2]).all()


def test_gradients_leave_in_model_dtype_and_bf16_backward_matches_reference():
    lin = make_linear(256, 256, dtype=torch.bfloat16)
    fp8 = make_fp8(lin)
    x = outlier_data((2, 128, 256), dtype=torch.bfloat16).requires_grad_()
    y = fp8(x)
    y.float().square().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and fp8.weight.grad.dtype == torch.bfloat16 and fp8.bias.grad.dtype == torch.bfloat16
    assert torch.isfinite(x.grad).all() and torch.isfinite(fp8.weight.grad).all()


def test_rollout_side_has_fp8_forward_and_bf16_backward():
    """side='rollout' layers (the fp8_rollout engine copy) quantize the forward only."""
    lin = make_linear(256, 128)
    model = nn.Sequential(lin)
    convert_to_fp8(model, get_recipe("fp8_rollout"), side="rollout")
    layer = model[0]
    assert isinstance(layer, Fp8Linear) and layer.backward_spec is None
    x = outlier_data((64, 256))
    y = layer(x)
    y_ref, *_, ops = emulated_f64(x, lin.weight.detach(), lin.bias.detach(), outlier_data((64, 128)))
    # The reference is float64; the bound covers any fp32 summation order (not this machine's BLAS).
    bound = fp32_bound(*ops["y"], lin.bias.detach().double().abs())
    assert ((y.double() - y_ref).abs() <= bound).all(), f"max excess {((y.double() - y_ref).abs() - bound).max():.3e}"


# ---- module identity and the weight-quantization cache ------------------------------------------------
def test_owns_the_same_parameters():
    lin = make_linear(256, 128)
    w, b = lin.weight, lin.bias
    fp8 = make_fp8(lin)
    assert fp8.weight is w and fp8.bias is b
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), lin)
    params_before = [id(p) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_to_fp8(model, JET)
    assert isinstance(model[0], Fp8Linear) and isinstance(model[2], Fp8Linear)
    assert model[2].weight is w and model[2].bias is b
    assert [id(p) for p in model.parameters()] == params_before
    # The optimizer built before conversion still trains the converted model.
    model(outlier_data((8, 128))).square().mean().backward()
    w0 = w.detach().clone()
    opt.step()
    assert not torch.equal(w0, w.detach())
    assert set(fp8_linears(model)) == {"0", "2"}


def test_weight_cache_reuse_and_invalidation():
    lin = make_linear(256, 384)
    fp8 = make_fp8(lin)
    x = outlier_data((64, 256))
    fp8(x)
    wq1 = fp8.quantized_weight()
    fp8(x)
    assert fp8.quantized_weight() is wq1, "a second forward must reuse the cached FP8 weight"
    with torch.no_grad():  # a rollout-style forward sees the same object (same bytes)
        fp8(x)
    assert fp8.quantized_weight() is wq1
    ref = quantize_fp8(lin.weight.detach(), (128, 128))
    assert torch.equal(wq1.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(wq1.scale, ref.scale)
    # DGrad uses the exact transpose of the cached blocks.
    wt = fp8.quantized_weight_t()
    assert fp8.quantized_weight_t() is wt
    assert torch.equal(wt.data.view(torch.uint8), wq1.data.t().contiguous().view(torch.uint8))

    # An optimizer step bumps the version counter: the cache is recomputed.
    opt = torch.optim.SGD(fp8.parameters(), lr=0.5)
    fp8(x).square().mean().backward()
    opt.step()
    fp8(x)
    assert fp8._wq_t_cache is None, "the forward re-quantizing W must drop the stale W^T (not hold it to backward)"
    wq2 = fp8.quantized_weight()
    assert wq2 is not wq1
    ref2 = quantize_fp8(lin.weight.detach(), (128, 128))
    assert torch.equal(wq2.data.view(torch.uint8), ref2.data.view(torch.uint8)) and torch.equal(wq2.scale, ref2.scale)
    assert not torch.equal(wq2.data.view(torch.uint8), wq1.data.view(torch.uint8))
    assert fp8.quantized_weight_t() is not wt

    # A write through .data (how DeepSpeed copies optimizer results in) + mark_weights_updated().
    new_w = outlier_data(tuple(lin.weight.shape)) * 0.05
    lin.weight.data.copy_(new_w)
    mark_weights_updated()
    wq3 = fp8.quantized_weight()
    assert wq3 is not wq2
    ref3 = quantize_fp8(new_w, (128, 128))
    assert torch.equal(wq3.data.view(torch.uint8), ref3.data.view(torch.uint8)) and torch.equal(wq3.scale, ref3.scale)
    y = fp8(x)
    y_ref, *_, ops = emulated_f64(x, new_w, lin.bias.detach(), outlier_data((64, 384)))
    assert ((y.double() - y_ref).abs() <= fp32_bound(*ops["y"], lin.bias.detach().double().abs())).all()
    fp8.invalidate_cache()
    assert fp8.quantized_weight() is not wq3


# ---- saved-activation memory ---------------------------------------------------------------------------
def saved_activation_bytes(module: nn.Module, x: torch.Tensor) -> tuple[int, list[torch.dtype]]:
    """Bytes of the tensors autograd saves for backward, excluding the module's Parameters."""
    param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    total, dtypes = [0], []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in param_storages:
            total[0] += t.numel() * t.element_size()
            dtypes.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    y.float().sum().backward()  # the saved tensors really serve a backward
    return total[0], dtypes


def test_saved_activations_take_at_most_55_percent_of_bf16():
    k, n, m = 1024, 512, 512
    lin = make_linear(k, n, dtype=torch.bfloat16)
    ref = copy.deepcopy(lin)
    fp8 = make_fp8(lin)
    x = outlier_data((2, m // 2, k), dtype=torch.bfloat16)
    b_fp8, dt_fp8 = saved_activation_bytes(fp8, x.clone().requires_grad_())
    b_bf16, _ = saved_activation_bytes(ref, x.clone().requires_grad_())
    assert b_bf16 >= m * k * 2  # the bf16 input itself
    assert torch.float8_e4m3fn in dt_fp8, "the FP8 linear must save its activation in e4m3"
    ratio = b_fp8 / b_bf16
    assert ratio <= 0.55, f"FP8 saved {b_fp8} B vs BF16 {b_bf16} B ({ratio:.3f})"
    assert b_fp8 == m * k + m * (k // 128) * 4  # exactly e4m3 bytes + fp32 1x128 scales


# ---- NaN input ------------------------------------------------------------------------------------------
def test_nan_input_propagates_without_crash():
    lin = make_linear(256, 128)
    fp8 = make_fp8(lin)
    x = outlier_data((2, 64, 256))
    x[1, 10, 200] = float("nan")
    x.requires_grad_()
    y = fp8(x)
    assert torch.isnan(y[1, 10]).all(), "the token holding a NaN gives NaN outputs"
    mask = torch.ones(2, 64, dtype=torch.bool)
    mask[1, 10] = False
    assert torch.isfinite(y[mask]).all(), "other tokens are unaffected"
    y.sum().backward()  # no crash; the poisoned token reaches dW through WGrad
    assert torch.isnan(fp8.weight.grad).any()


# ---- GEMM dispatch on CPU -----------------------------------------------------------------------------------
def test_auto_resolves_to_emulated_on_cpu():
    assert resolve_backend("auto", "cpu") == "emulated"
    assert resolve_backend("emulated", "cpu") == "emulated"
    avail = available_backends("cpu")
    assert avail["emulated"] is None
    for name in ("torch", "triton", "deep_gemm", "triton_invariant"):
        assert isinstance(avail[name], str) and avail[name], f"{name} must say why it is unavailable on CPU"
    assert make_fp8(make_linear(128, 128)).resolved_backend == "emulated"


@pytest.mark.parametrize("name", ["torch", "triton", "deep_gemm", "triton_invariant"])
def test_gpu_backends_on_cpu_raise_clearly(name):
    with pytest.raises(BackendUnavailable, match=rf"'{name}' cannot run on cpu: .+auto"):
        resolve_backend(name, "cpu")


def test_deep_gemm_backend_hands_wgrad_and_fp32_to_cublaslt(monkeypatch):
    """The deep_gemm backend's routing (DeepGEMM itself needs a GPU): WGrad (1x128.1x128) and fp32-output
    fprop go to the torch backend where cuBLASLt works; without it, DeepGEMM's 1D1D kernel refuses M < 64."""
    from jetrl_precision.gemm import deep_gemm_backend as dgb
    from jetrl_precision.gemm import torch_backend

    calls = []

    def fake_torch_gemm(a, b, out_dtype):
        calls.append((a.block, b.block, out_dtype))
        return torch.zeros(a.shape[0], b.shape[0], dtype=out_dtype)

    assert dgb._cublaslt_ok(torch.device("cpu")) is False  # cuBLASLt blockwise is a GPU path
    monkeypatch.setattr(torch_backend, "torch_gemm_nt", fake_torch_gemm)
    x = quantize_fp8(outlier_data((8, 256)), (1, 128))
    w1 = quantize_fp8(outlier_data((128, 256)), (1, 128))
    w128 = quantize_fp8(outlier_data((128, 256)), (128, 128))
    monkeypatch.setattr(dgb, "_cublaslt_ok", lambda device: True)
    dgb.deep_gemm_gemm_nt(x, w1, torch.bfloat16)
    dgb.deep_gemm_gemm_nt(x, w128, torch.float32)
    assert calls == [((1, 128), (1, 128), torch.bfloat16), ((1, 128), (128, 128), torch.float32)]
    monkeypatch.setattr(dgb, "_cublaslt_ok", lambda device: False)
    with pytest.raises(ValueError, match="needs M >= 64, got 8"):
        dgb.deep_gemm_gemm_nt(x, w1, torch.bfloat16)


def test_backward_gemms_run_on_the_layers_backward_backend(monkeypatch):
    """`backward_gemm_backend` routes DGrad and WGrad (and DGrad's prepared weight) to their own backend while the
    forward keeps `gemm_backend`; the bitwise mode relies on it to keep only the forward batch-invariant."""
    import jetrl_precision.linear as linear_mod

    real_prepare = linear_mod.prepare_gemm
    calls = []

    class Recording:
        wgrad_k_multiple = 1  # a PreparedGemm attribute, not a call

        def __init__(self, name, device):
            self.name, self.real = name, real_prepare("emulated", device)

        def __getattr__(self, method):
            def call(*args, **kwargs):
                calls.append((self.name, method))
                return getattr(self.real, method)(*args, **kwargs)
            return call

    lin = make_linear(256, 128, bias=False)
    x = outlier_data((16, 256), generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    reference = make_fp8(copy.deepcopy(lin))
    reference(x).square().sum().backward()
    want = (x.grad.clone(), reference.weight.grad.clone())
    x.grad = None

    monkeypatch.setattr(linear_mod, "resolve_backend", lambda name, device: name)
    monkeypatch.setattr(linear_mod, "prepare_gemm", Recording)
    fp8 = make_fp8(lin)
    fp8.gemm_backend, fp8.backward_gemm_backend = "fwd_backend", "bwd_backend"
    fp8(x).square().sum().backward()
    assert {c for c in calls if c[0] == "fwd_backend"} <= {("fwd_backend", "nt_weight"), ("fwd_backend", "weight")}
    assert ("fwd_backend", "nt_weight") in calls
    assert {("bwd_backend", "nt_weight"), ("bwd_backend", "nt"), ("bwd_backend", "weight")} <= set(calls)
    assert torch.equal(x.grad, want[0]) and torch.equal(fp8.weight.grad, want[1])  # the same (emulated) arithmetic
    assert "backward_backend=bwd_backend" in repr(fp8)


def test_make_batch_invariant_frees_the_backward_gemms():
    from precision_testutil import tiny_causal_lm
    from openrlhf.models.invariant_attention import register_invariant_attention
    from jetrl_precision import convert_to_fp8, get_recipe
    from jetrl_precision.batch_invariant import make_batch_invariant

    model = tiny_causal_lm()
    model.set_attn_implementation(register_invariant_attention())
    model = convert_to_fp8(model, get_recipe("jet_fp8"), side="train")
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    fp8[0].backward_gemm_backend = "emulated"  # a layer that names its own keeps it
    make_batch_invariant(model)
    assert fp8[0].backward_gemm_backend == "emulated" and all(m.backward_gemm_backend == "auto" for m in fp8[1:])
    assert all(m.backend_for(torch.device("cpu")) == "emulated" for m in fp8)  # the forward: CPU's invariant GEMM


def test_unknown_backend():
    with pytest.raises(BackendUnavailable, match="unknown GEMM backend 'cutlass'"):
        resolve_backend("cutlass", "cpu")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_emulated_gemm_matches_float64(out_dtype):
    a = quantize_fp8(outlier_data((200, 384)), (1, 128))
    b = quantize_fp8(outlier_data((320, 384)), (128, 128))
    out = gemm_nt(a, b, out_dtype, "emulated")
    assert out.dtype == out_dtype and out.shape == (200, 320)
    a64 = a.data.double() * a.expanded_scale().double()
    b64 = b.data.double() * b.expanded_scale().double()
    ref = a64 @ b64.t()
    bound = fp32_bound(a64, b64.t())
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * (ref.abs() + bound)  # one bf16 rounding of the fp32 result
    assert ((out.double() - ref).abs() <= bound).all()
    with pytest.raises(ValueError, match="K mismatch"):
        gemm_nt(a, quantize_fp8(outlier_data((64, 256)), (128, 128)), torch.float32, "emulated")


def test_importing_vllms_deep_gemm_leaves_torch_attention_flags_alone(monkeypatch, tmp_path):
    """vLLM's import switches cuDNN SDPA off process-wide (vllm/platforms/cuda.py); the deep_gemm backend imports vLLM
    only for its copy of DeepGEMM, and must not leave a training process's attention on a slower kernel. A stand-in
    for the vendored package does what that import does."""
    import vllm.third_party

    from jetrl_precision.gemm import deep_gemm_backend as dgb

    pkg = tmp_path / "deep_gemm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import torch\ntorch.backends.cuda.enable_cudnn_sdp(False)\n\ndef fp8_gemm_nt(*a, **k):\n    pass\n")
    monkeypatch.setattr(vllm.third_party, "__path__", [*vllm.third_party.__path__, str(tmp_path)])
    monkeypatch.setattr(dgb, "_module", [])
    monkeypatch.setattr(dgb, "_import_error", [])
    monkeypatch.delitem(sys.modules, "vllm.third_party.deep_gemm", raising=False)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        mod = dgb.import_deep_gemm()
        assert mod is not None and mod.__name__ == "vllm.third_party.deep_gemm"
        assert torch.backends.cuda.cudnn_sdp_enabled() is before is True
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
        sys.modules.pop("vllm.third_party.deep_gemm", None)


def test_uncached_weights_give_the_same_bytes_and_keep_nothing():
    """cache_weights=False (--precision.requantize_weights): every forward and backward quantizes W itself, as under
    ZeRO-3; outputs and gradients are the cached layer's bit for bit, and no quantized weight outlives a call."""
    x = outlier_data((64, 256))
    lin = make_linear(256, 384)
    cached = make_fp8(copy.deepcopy(lin))
    fresh = Fp8Linear.from_linear(copy.deepcopy(lin), JET.train_fprop, JET.train_backward, "emulated", cache_weights=False)
    assert fresh.cache_weights is False and cached.cache_weights is True
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    for layer, xi in zip((cached, fresh), xs):
        for _ in range(2):  # two micro-steps: the cached layer reuses Q(W) and Q(W)^T on the second
            layer(xi).square().mean().backward()
    assert torch.equal(cached(x), fresh(x))
    assert torch.equal(xs[0].grad, xs[1].grad) and torch.equal(cached.weight.grad, fresh.weight.grad)
    assert torch.equal(cached.bias.grad, fresh.bias.grad)
    assert cached._wq_cache is not None and cached._wq_t_cache is not None
    assert fresh._wq_cache is None and fresh._wq_t_cache is None
    # What the weight sync sends: the same bytes, quantized on request.
    a, b = cached.quantized_weight(), fresh.quantized_weight()
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    assert fresh._wq_cache is None


def test_converter_passes_the_weight_cache_choice_to_every_layer():
    model = nn.Sequential(make_linear(256, 256), nn.ReLU(), make_linear(256, 128))
    Fp8Converter(JET, cache_weights=False).convert(model)
    assert [m.cache_weights for m in fp8_linears(model).values()] == [False, False]


@pytest.mark.parametrize("recipes", ["1x128.128x128", "1x128.1x128"])
def test_scaled_mm_v2_shortcut_passes_what_f_scaled_mm_passes(monkeypatch, recipes):
    """The torch backend's direct `torch._scaled_mm_v2` call (taken where the device probe finds its bits equal)
    must hand the op exactly the arguments `F.scaled_mm` builds on this torch: recorded from both, compared."""
    from jetrl_precision.gemm import torch_backend as tb

    types = tb.scaling_types()
    if types is None or not hasattr(torch, "_scaled_mm_v2"):
        pytest.skip(f"torch {torch.__version__} has no F.scaled_mm / _scaled_mm_v2")
    one, block = types
    rec_b = block if recipes == "1x128.128x128" else one
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm_v2", lambda *args: calls.append(args) or torch.zeros(1))
    a, b_t = torch.zeros(4, 128, dtype=torch.float8_e4m3fn), torch.zeros(128, 256, dtype=torch.float8_e4m3fn).t().t()
    sa, sb = torch.ones(4, 1), torch.ones(1, 2)
    torch.nn.functional.scaled_mm(a, b_t, sa, one, sb, rec_b, output_dtype=torch.bfloat16)
    tb._v2_call(one, rec_b)(a, b_t, sa, sb, torch.bfloat16)
    want, got = calls

    def norm(args):  # tensors by identity, everything else by value (F.scaled_mm passes contraction_dim as a tuple)
        return [tuple(v) if isinstance(v, (list, tuple)) else v for v in args]

    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(norm(got), norm(want))):
        if isinstance(w, tuple) and w and isinstance(w[0], torch.Tensor):
            assert len(g) == len(w) and all(x is y for x, y in zip(g, w)), f"argument {i}"
        elif isinstance(w, torch.Tensor):
            assert g is w, f"argument {i}"
        else:
            assert g == w, f"argument {i}: {g!r} != {w!r}"
