"""The training step's GEMMs from the C++ extension (gemm.cublaslt_native, opt-in: JETRL_NATIVE_GEMM=1) give
F.scaled_mm's exact bits on this GPU, wherever the torch backend would call them.

Decode, prefill and training shapes, both recipes (the forward's and DGrad's 1x128 x 128x128, WGrad's 1x128 x 1x128),
bf16 and fp32 outputs; on a side stream and on a thread that is not the main one (autograd's backward threads);
inputs the extension hands back (graph capture, fp16 output) run torch's call; the prepared entry points are the
extension's; and an Fp8Linear training step (forward, DGrad, WGrad) is bit-identical with and without it.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gpu_testutil import requires_cuda_reason

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

if torch.cuda.is_available():
    from jetrl_precision.gemm import cublaslt, cublaslt_native, torch_backend
    from jetrl_precision.kernels.layout import mn_major, row_major_padded_t
    from jetrl_precision.quantize import quantize_fp8

SHAPES = [  # (M, N, K)
    (4, 4096, 4096), (60, 4096, 4096), (64, 14336, 4096), (64, 4096, 14336), (200, 4096, 4096), (4096, 4096, 4096),
    (4352, 6144, 4096), (8192, 14336, 4096), (8192, 4096, 14336), (16, 576, 1536), (4, 128, 128),
]
WGRAD_SHAPES = [(4096, 4096, 8192), (1024, 4096, 2048), (4096, 14336, 4352), (576, 1536, 512)]  # (N, K, tokens)


@pytest.fixture(autouse=True)
def _asked(monkeypatch):
    monkeypatch.setenv(cublaslt_native.ENV_SWITCH, "1")
    monkeypatch.delenv("JETRL_CUBLASLT_PLAN", raising=False)


def _sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("blockwise scaled_mm is sm90-only here")
    if torch_backend.unavailable_reason(torch.device("cuda")) is not None:
        pytest.skip(torch_backend.unavailable_reason(torch.device("cuda")))


def _operands(m, n, k, block_b, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.exp(2 * torch.randn(m, 1, device="cuda", generator=g))
    x[:, ::97] *= 300.0  # outlier columns
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    aq = quantize_fp8(x, (1, 128))
    wq = quantize_fp8(w, (128, 128) if block_b == "128x128" else (1, 128))
    sb = row_major_padded_t(wq.scale) if block_b == "128x128" else mn_major(wq.scale)
    return aq.data, wq.data.t(), mn_major(aq.scale), sb


def _reference(block_b):
    one, block = torch_backend.scaling_types()
    rec_b = block if block_b == "128x128" else one
    return lambda a, b_t, sa, sb, od: torch.nn.functional.scaled_mm(a, b_t, sa, one, sb, rec_b, output_dtype=od)


def _refuse(*args):
    raise AssertionError("the extension handed back an input it takes")


def _gemm(block_b, fallback=_refuse):
    gemm = cublaslt_native.blockwise_gemm("cuda", "1x128", block_b, fallback)
    assert gemm is not None, f"the extension must pass its first-use check here: {cublaslt_native._reasons}"
    return gemm


def _assert_same(got, ref, what):
    bad = int((got != ref).sum())
    assert got.dtype == ref.dtype and got.shape == ref.shape and bad == 0, f"{what}: {bad} of {ref.numel()} outputs differ from F.scaled_mm"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_forward_and_dgrad_shapes_equal_f_scaled_mm(out_dtype):
    _sm90()
    gemm, ref = _gemm("128x128"), _reference("128x128")
    for i, (m, n, k) in enumerate(SHAPES):
        args = _operands(m, n, k, "128x128", i)
        _assert_same(gemm(*args, out_dtype), ref(*args, out_dtype), f"M={m} N={n} K={k}")
        _assert_same(gemm(*args, out_dtype), ref(*args, out_dtype), f"M={m} N={n} K={k}, planned")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_wgrad_shapes_equal_f_scaled_mm(out_dtype):
    _sm90()
    gemm, ref = _gemm("1x128"), _reference("1x128")
    for i, (n, k, tokens) in enumerate(WGRAD_SHAPES):
        args = _operands(n, k, tokens, "1x128", 100 + i)
        _assert_same(gemm(*args, out_dtype), ref(*args, out_dtype), f"WGrad N={n} K={k} tokens={tokens}")


def test_prepared_entry_points_are_the_extensions():
    _sm90()
    assert isinstance(torch_backend.prepared_scaled_mm("cuda"), cublaslt_native.NativeBlockwiseGemm)
    assert isinstance(torch_backend.prepared_scaled_mm_1x128("cuda"), cublaslt_native.NativeBlockwiseGemm)
    assert cublaslt.call_status("cuda") == "native_plan"


def test_what_the_extension_hands_back_runs_torchs_call():
    # fp16 output is not one it takes, nor a capturing stream: the fallback (torch's call) must run, with its bits
    _sm90()
    calls = []

    def fallback(*args):
        calls.append(args[-1])
        return _reference("128x128")(*args)

    gemm = _gemm("128x128", fallback)
    args = _operands(64, 4096, 4096, "128x128", 3)
    _assert_same(gemm(*args, torch.float16), _reference("128x128")(*args, torch.float16), "fp16 output")
    assert calls == [torch.float16]
    static = [t.clone() for t in args]
    gemm(*static, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = gemm(*static, torch.bfloat16)
    assert calls == [torch.float16, torch.bfloat16]  # captured through torch's call
    fresh = _operands(64, 4096, 4096, "128x128", 4)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(out, _reference("128x128")(*fresh, torch.bfloat16), "replayed capture")


def test_side_stream_and_another_thread():
    _sm90()
    gemm, ref = _gemm("128x128"), _reference("128x128")
    args = _operands(256, 4096, 4096, "128x128", 5)
    want = ref(*args, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = gemm(*args, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(side)
    _assert_same(got, want, "side stream")
    box = {}

    def run():
        box["y"] = gemm(*args, torch.bfloat16)
        torch.cuda.synchronize()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    _assert_same(box["y"], want, "another thread")


def test_fp8_linear_training_step_is_bit_identical_with_the_extension(monkeypatch):
    # y, dX and dW of one layer: the torch backend with the extension's GEMMs against torch's calls
    _sm90()
    from torch import nn

    from jetrl_precision import Fp8Linear, get_recipe

    r = get_recipe("jet_fp8")
    torch.manual_seed(0)
    lin = nn.Linear(4096, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    x = (torch.randn(4352, 4096, device="cuda") * torch.exp(torch.randn(4352, 1, device="cuda"))).to(torch.bfloat16)
    dy = (torch.randn(4352, 1024, device="cuda") * 1e-3).to(torch.bfloat16)

    def step():
        layer = Fp8Linear.from_linear(lin, r.train_fprop, r.train_backward, gemm_backend="torch")
        xg = x.clone().requires_grad_(True)
        lin.weight.grad = None
        y = layer(xg)
        y.backward(dy)
        return y.detach(), xg.grad, lin.weight.grad.clone(), layer._plan(x.device).gemm.mm

    y1, dx1, dw1, mm1 = step()
    assert isinstance(mm1, cublaslt_native.NativeBlockwiseGemm)
    monkeypatch.setenv(cublaslt_native.ENV_SWITCH, "0")
    y0, dx0, dw0, mm0 = step()
    assert not isinstance(mm0, cublaslt_native.NativeBlockwiseGemm)
    for got, want, what in ((y1, y0, "y"), (dx1, dx0, "dX"), (dw1, dw0, "dW")):
        _assert_same(got, want, what)
