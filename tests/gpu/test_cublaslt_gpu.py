"""cuBLASLt GEMM plans (gemm.cublaslt, opt-in: JETRL_CUBLASLT_PLAN=1) give F.scaled_mm's exact bits on this GPU,
wherever the project would call them.

Decode, prefill and training shapes (split-K-prone small M with long K included), both recipes (the forward and
DGrad's 1x128 x 128x128, WGrad's 1x128 x 1x128), bf16 and fp32 outputs; under CUDA graph capture and replay, on a
side stream, on a thread that is not the main one (autograd's backward threads); and the prepared entry points
(`torch_backend.prepared_scaled_mm`) are the plans.
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
    from jetrl_precision.gemm import cublaslt, torch_backend


@pytest.fixture(autouse=True)
def _asked(monkeypatch):
    monkeypatch.setenv("JETRL_CUBLASLT_PLAN", "1")


SHAPES = [  # (M, N, K)
    (4, 4096, 4096), (8, 1024, 4096), (60, 4096, 4096), (64, 14336, 4096), (64, 4096, 14336), (128, 6144, 4096),
    (200, 4096, 4096), (1000, 1024, 4096), (4096, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336),
    (16, 576, 1536), (4, 128, 128),
]
WGRAD_SHAPES = [(4096, 4096, 8192), (1024, 4096, 2048), (4096, 14336, 1024), (576, 1536, 512)]  # (N, K, tokens)


def _gemm(block_b):
    gemm = cublaslt.blockwise_gemm("cuda", "1x128", block_b)
    assert gemm is not None, f"the plans must pass their first-use check here: {cublaslt._reasons}"
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


@pytest.mark.parametrize("block_b,mnk", [("1x128", (4096, 4096, 8192)), ("128x128", (8192, 4096, 4096))], ids=["wgrad", "fprop"])
def test_every_offered_algorithm_computes_the_product_and_the_first_is_torchs(block_b, mnk):
    # benchmarks/cublaslt_algos_gpu.py times them: each must be the GEMM (against a float64 product of the dequantized
    # operands), and the heuristic's first, asked for among many, must still be the one torch runs
    require_blockwise_scaled_mm()
    m, n, k = mnk
    args = blockwise_operands(m, n, k, block_b, 7)
    a, b_t, sa, sb = args
    gemm = cublaslt.LtBlockwiseGemm(torch.device("cuda"), "1x128", block_b)
    offered = gemm.offer_algorithms(*args, torch.bfloat16, count=8)
    assert offered and [o["index"] for o in offered] == list(range(len(offered)))
    a64 = a.double() * sa.double().repeat_interleave(128, dim=1)[:, :k]
    if block_b == "1x128":
        b64 = b_t.t().double() * sb.double().repeat_interleave(128, dim=1)[:, :k]
    else:
        blocks = sb.double().t()[:, : -(-k // 128)]  # row_major_padded_t's (KB padded, NB) view, back to (NB, KB)
        b64 = b_t.t().double() * blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    want = a64 @ b64.t()
    for o in offered:
        gemm.use_algorithm(m, n, k, torch.bfloat16, o["index"])
        got = gemm(*args, torch.bfloat16)
        rel = float((got.double() - want).norm() / want.norm())
        assert rel < 1e-2, f"algorithm {o['index']}: relative error {rel:.2e} against the float64 product"
        if o["index"] == 0:
            assert_same_as_scaled_mm(got, f_scaled_mm(block_b)(*args, torch.bfloat16), "the heuristic's first of many")


def test_prepared_entry_points_are_the_plans():
    require_blockwise_scaled_mm()
    assert torch_backend.prepared_scaled_mm("cuda") is _gemm("128x128")
    assert torch_backend.prepared_scaled_mm_1x128("cuda") is _gemm("1x128")
    assert cublaslt.call_status("cuda") == "cublaslt_plan"


def test_captured_graph_replays_the_same_bits():
    require_blockwise_scaled_mm()
    gemm, ref = _gemm("128x128"), f_scaled_mm("128x128")
    static = [t.clone() for t in blockwise_operands(64, 4096, 4096, "128x128", 7)]
    gemm(*static, torch.bfloat16)  # plan made outside the capture, as a warm-up does
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = gemm(*static, torch.bfloat16)
    for seed in (8, 9):
        fresh = blockwise_operands(64, 4096, 4096, "128x128", seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_as_scaled_mm(out, ref(*fresh, torch.bfloat16), f"graph replay {seed}")


def test_side_stream_and_worker_thread():
    require_blockwise_scaled_mm()
    gemm, ref = _gemm("128x128"), f_scaled_mm("128x128")
    args = blockwise_operands(256, 4096, 4096, "128x128", 11)
    want = ref(*args, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = gemm(*args, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(side)
    assert_same_as_scaled_mm(got, want, "side stream")
    assert len(gemm._workspaces) >= 2  # one workspace per stream
    results = []
    t = threading.Thread(target=lambda: results.append(gemm(*args, torch.bfloat16)))
    t.start()
    t.join()
    torch.cuda.synchronize()
    assert_same_as_scaled_mm(results[0], want, "worker thread")
