"""The eager engine's activation workspace (engine_linear._act_workspace): decode-sized batches quantize into buffers
shared by every layer of one K on one stream. Layers of one K called in turn, at changing M, and on a side stream
give the bits of the allocate-per-call path; a captured CUDA graph keeps allocating (no workspace is made while a
stream captures) and replays the same bits."""

from __future__ import annotations

import pytest
import torch

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision.quantize import quantize_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)


def _layers(n_layers=3, n=1024, k=4096):
    from jetrl_precision import get_recipe
    from jetrl_precision.integrations.engine_linear import EngineLinear

    spec = get_recipe("jet_fp8").rollout.input
    out = []
    for i in range(n_layers):
        g = torch.Generator(device="cuda").manual_seed(100 + i)
        wq = quantize_fp8(torch.randn(n, k, device="cuda", generator=g) * 0.02, (128, 128))
        out.append(EngineLinear(wq.data, wq.scale, [(n, n // 128, 128)], 128, spec, "torch"))
    return out


def _bits(t):
    return t.view(torch.int16)


def _chain(layers, x):
    # each layer's input is the previous output widened back to K: every call reuses the workspace of one K
    outs = []
    for lin in layers:
        y = lin(x)
        outs.append(y)
        x = torch.cat([y] * (x.shape[1] // y.shape[1]), dim=1)
    return outs


def test_workspace_path_equals_fresh_buffers(monkeypatch):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the prepared cuBLASLt path is sm90-only")
    from jetrl_precision.integrations import engine_linear

    layers = _layers()
    if not layers[0]._fast:
        pytest.skip("no prepared path here")
    for m in (1, 3, 64, 200, 512, 600):
        x = outlier_data(m, 4096, seed=m)
        with_ws = _chain(layers, x)
        monkeypatch.setattr(engine_linear, "_USE_WS", False)
        fresh = _chain(layers, x)
        monkeypatch.setattr(engine_linear, "_USE_WS", True)
        for i, (a, b) in enumerate(zip(with_ws, fresh)):
            assert torch.equal(_bits(a), _bits(b)), f"M={m} layer {i}"
    assert any(key[2] == 4096 for key in engine_linear._ACT_WS)


def test_workspace_under_graph_capture_and_side_stream():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the prepared cuBLASLt path is sm90-only")
    layers = _layers()
    if not layers[0]._fast:
        pytest.skip("no prepared path here")
    from jetrl_precision.integrations import engine_linear

    static = outlier_data(64, 4096, seed=1).clone()
    _chain(layers, static)  # warm-up outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    before = set(engine_linear._ACT_WS)
    with torch.cuda.graph(graph, stream=stream):
        outs = _chain(layers, static)
    assert set(engine_linear._ACT_WS) == before  # nothing made for the capture stream
    for seed in (2, 3):
        fresh = outlier_data(64, 4096, seed=seed)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        want = _chain(layers, fresh)
        for a, b in zip(outs, want):
            assert torch.equal(_bits(a), _bits(b)), f"replay {seed}"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    x = outlier_data(16, 4096, seed=4)
    with torch.cuda.stream(side):
        got = _chain(layers, x)
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(got, _chain(layers, x)):
        assert torch.equal(_bits(a), _bits(b)), "side stream"
