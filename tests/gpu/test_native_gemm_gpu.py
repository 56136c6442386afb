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

from gpu_testutil import (
    assert_same_as_scaled_mm,
    blockwise_operands,
    f_scaled_mm,
    require_blockwise_scaled_mm,
    requires_cuda_reason,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

if torch.cuda.is_available():
    from jetrl_precision.gemm import cublaslt, cublaslt_native, torch_backend

SHAPES = [  # (M, N, K)
    (4, 4096, 4096), (60, 4096, 4096), (64, 14336, 4096), (64, 4096, 14336), (200, 4096, 4096), (4096, 4096, 4096),
    (4352, 6144, 4096), (8192, 14336, 4096), (8192, 4096, 14336), (16, 576, 1536), (4, 128, 128),
]
WGRAD_SHAPES = [(4096, 4096, 8192), (1024, 4096, 2048), (4096, 14336, 4352), (576, 1536, 512)]  # (N, K, tokens)


@pytest.fixture(autouse=True)
def _asked(monkeypatch):
    monkeypatch.setenv(cublaslt_native.ENV_SWITCH, "1")
    monkeypatch.delenv("JETRL_CUBLASLT_PLAN", raising=False)


def _refuse(*args):
    raise AssertionError("the extension handed back an input it takes")


def _gemm(block_b, fallback=_refuse):
    gemm = cublaslt_native.blockwise_gemm("cuda", "1x128", block_b, fallback)
    assert gemm is not None, f"the extension must pass its first-use check here: {cublaslt_native._reasons}"
    return gemm


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_forward_and_dgrad_shapes_equal_f_scaled_mm(out_dtype):
    require_blockwise_scaled_mm()
    gemm, ref = _gemm("128x128"), f_scaled_mm("128x128")
    for i, (m, n, k) in enumerate(SHAPES):
        args = blockwise_operands(m, n, k, "128x128", i)
        assert_same_as_scaled_mm(gemm(*args, out_dtype), ref(*args, out_dtype), f"M={m} N={n} K={k}")
        assert_same_as_scaled_mm(gemm(*args, out_dtype), ref(*args, out_dtype), f"M={m} N={n} K={k}, planned")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_wgrad_shapes_equal_f_scaled_mm(out_dtype):
    require_blockwise_scaled_mm()
    gemm, ref = _gemm("1x128"), f_scaled_mm("1x128")
    for i, (n, k, tokens) in enumerate(WGRAD_SHAPES):
        args = blockwise_operands(n, k, tokens, "1x128", 100 + i)
        assert_same_as_scaled_mm(gemm(*args, out_dtype), ref(*args, out_dtype), f"WGrad N={n} K={k} tokens={tokens}")


def test_prepared_entry_points_are_the_extensions():
    require_blockwise_scaled_mm()
    assert isinstance(torch_backend.prepared_scaled_mm("cuda"), cublaslt_native.NativeBlockwiseGemm)
    assert isinstance(torch_backend.prepared_scaled_mm_1x128("cuda"), cublaslt_native.NativeBlockwiseGemm)
    assert cublaslt.call_status("cuda") == "native_plan"


def test_what_the_extension_hands_back_runs_torchs_call():
    # fp16 output is not one it takes, nor a capturing stream: the fallback (torch's call) must run, with its bits
    require_blockwise_scaled_mm()
    calls = []

    def fallback(*args):
        calls.append(args[-1])
        return f_scaled_mm("128x128")(*args)

    gemm = _gemm("128x128", fallback)
    args = blockwise_operands(64, 4096, 4096, "128x128", 3)
    assert_same_as_scaled_mm(gemm(*args, torch.float16), f_scaled_mm("128x128")(*args, torch.float16), "fp16 output")
    assert calls == [torch.float16]
    static = [t.clone() for t in args]
    gemm(*static, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = gemm(*static, torch.bfloat16)
    assert calls == [torch.float16, torch.bfloat16]  # captured through torch's call
    fresh = blockwise_operands(64, 4096, 4096, "128x128", 4)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_as_scaled_mm(out, f_scaled_mm("128x128")(*fresh, torch.bfloat16), "replayed capture")


def test_side_stream_and_another_thread():
    require_blockwise_scaled_mm()
    gemm, ref = _gemm("128x128"), f_scaled_mm("128x128")
    args = blockwise_operands(256, 4096, 4096, "128x128", 5)
    want = ref(*args, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = gemm(*args, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(side)
    assert_same_as_scaled_mm(got, want, "side stream")
    box = {}

    def run():
        box["y"] = gemm(*args, torch.bfloat16)
        torch.cuda.synchronize()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert_same_as_scaled_mm(box["y"], want, "another thread")


def test_fp8_linear_training_step_is_bit_identical_with_the_extension(monkeypatch):
    # y, dX and dW of one layer: the torch backend with the extension's GEMMs against torch's calls
    require_blockwise_scaled_mm()
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
        assert_same_as_scaled_mm(got, want, what)
