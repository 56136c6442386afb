"""The CUDA requantizer (1x128 -> 128x1, transposed; NVRTC-compiled) reproduces the reference's bytes exactly.

Non-finite inputs and division-edge quotients are covered with every other kernel in test_triton_quant.py.
"""

from __future__ import annotations

import pytest
import torch

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision.quantize import quantize_fp8, requantize_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

if torch.cuda.is_available():
    from jetrl_precision.kernels import cast_transpose, quant

SHAPES = [(16, 128), (128, 128), (144, 100), (1008, 1000), (4096, 14336), (272, 4100)]


def _same(got, ref, what):
    assert got.block == ref.block and got.data.shape == ref.data.shape and got.scale.shape == ref.scale.shape, what
    bad = (got.data.view(torch.uint8) != ref.data.view(torch.uint8)).sum().item()
    assert bad == 0, f"{what}: {bad} of {got.data.numel()} fp8 bytes differ from the reference"
    assert torch.equal(got.scale, ref.scale), f"{what}: scales differ"


def test_compiles_on_this_gpu():
    """Where torch ships NVRTC and the GPU is sm89+, the fast path must be there (a silent fallback is a defect)."""
    ok, why = cast_transpose.status(torch.device("cuda"))
    if torch.cuda.get_device_capability() >= (8, 9):
        assert ok, f"CUDA requantizer unavailable: {why}"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_bytes_match_reference(shape, pow2):
    x = outlier_data(*shape, seed=21)
    for q1, src in ((quant.quantize_1x128(x), "MN-major scales"), (quantize_fp8(x, (1, 128)), "row-major scales")):
        ref = requantize_fp8(q1, (128, 1), pow2_scale=pow2).t()
        got = cast_transpose.requantize_1x128_to_128x1_t(q1, pow2)
        _same(got, ref, f"{shape} pow2={pow2} {src}")
        assert got.scale.stride() == (1, shape[1])  # MN-major, as the WGrad GEMM reads it


def test_strided_rows_and_unsupported_layouts():
    x = outlier_data(256, 1024, seed=22)
    q = quant.quantize_1x128(x)
    view = type(q)(q.data[:, :512], q.scale[:, :4], (1, 128))  # row stride 1024, not 512
    _same(cast_transpose.requantize_1x128_to_128x1_t(view), requantize_fp8(view, (128, 1)).t(), "column slice")
    odd = quant.quantize_1x128(outlier_data(250, 1024, seed=23))  # M % 16 != 0
    assert not cast_transpose.supported_shape(odd)
    with pytest.raises(ValueError, match="M % 16 == 0"):
        cast_transpose.requantize_1x128_to_128x1_t(odd)
    narrow = quant.quantize_1x128(outlier_data(256, 1002, seed=26))  # K % 4 != 0
    assert not cast_transpose.supported_shape(narrow)
    _same(quant.requantize_1x128_to_128x1(narrow, transposed=True), requantize_fp8(narrow, (128, 1)).t(), "K=1002 (Triton)")
    # The public entry point picks the kernel by shape; both give the reference's bytes.
    _same(quant.requantize_1x128_to_128x1(odd, transposed=True), requantize_fp8(odd, (128, 1)).t(), "M=250 (Triton)")
    _same(quant.requantize_1x128_to_128x1(q, transposed=True), requantize_fp8(q, (128, 1)).t(), "M=256 (CUDA)")


def test_cuda_graph_capture():
    x = outlier_data(512, 2048, seed=24)
    q1 = quant.quantize_1x128(x)
    cast_transpose.requantize_1x128_to_128x1_t(q1)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cast_transpose.requantize_1x128_to_128x1_t(q1)
    q1.data.copy_(quant.quantize_1x128(x * 3).data)
    q1.scale.copy_(quant.quantize_1x128(x * 3).scale)
    g.replay()
    torch.cuda.synchronize()
    _same(out, requantize_fp8(q1, (128, 1)).t(), "graph replay")


def test_precision_graph_names_the_requantizer():
    from torch import nn

    from jetrl_precision import build_precision_graph, convert_to_fp8

    model = convert_to_fp8(nn.Sequential(nn.Linear(256, 256)).to("cuda", torch.bfloat16), "jet_fp8")
    g = build_precision_graph(model, "jet_fp8", "train_bwd")
    edges = g.edges_into("0")
    assert edges["wgrad.input"].attrs.kernel == cast_transpose.GRAPH_KERNEL
    assert edges["wgrad.grad_output"].attrs.kernel == "triton"


def test_unavailable_compiler_falls_back_to_triton_loudly(monkeypatch, caplog):
    """No NVRTC: one warning naming the reason, the graph records it, and the Triton kernel gives the same bytes."""
    from torch import nn

    from jetrl_precision import build_precision_graph, convert_to_fp8

    def no_nvrtc(*a, **k):
        raise RuntimeError("libnvrtc.so: cannot open shared object file")

    monkeypatch.setattr(torch.cuda, "_compile_kernel", no_nvrtc)
    monkeypatch.setattr(cast_transpose, "_kernels", {})
    monkeypatch.setattr(cast_transpose, "_failed", {})
    monkeypatch.setattr(cast_transpose, "_usable", {})
    x = outlier_data(512, 1024, seed=25)
    q1 = quant.quantize_1x128(x)
    with caplog.at_level("WARNING"):
        got = quant.requantize_1x128_to_128x1(q1, transposed=True)
        quant.requantize_1x128_to_128x1(q1, transposed=True)
    _same(got, requantize_fp8(q1, (128, 1)).t(), "Triton fallback")
    with pytest.raises(RuntimeError, match="cannot open shared object"):  # asked for by name: an error, no fallback
        quant.requantize_1x128_to_128x1(q1, transposed=True, kernel="cuda")
    warnings = [r.getMessage() for r in caplog.records if "CUDA requantizer" in r.getMessage()]
    assert len(warnings) == 1 and "cannot open shared object" in warnings[0], warnings
    model = convert_to_fp8(nn.Sequential(nn.Linear(256, 256)).to("cuda", torch.bfloat16), "jet_fp8")
    g = build_precision_graph(model, "jet_fp8", "train_bwd")
    assert g.edges_into("0")["wgrad.input"].attrs.kernel == "triton"
    assert "cannot open shared object" in g.nodes["0"].attrs["requantizer_fallback"]


def test_launch_from_a_fresh_thread():
    """A new thread has no current CUDA context (as autograd's backward threads start); the launch must still work."""
    import threading

    x = outlier_data(512, 1024, seed=27)
    q1 = quant.quantize_1x128(x)
    cast_transpose.requantize_1x128_to_128x1_t(q1)  # compiled in this thread
    out: dict = {}

    def worker():
        try:
            out["q"] = cast_transpose.requantize_1x128_to_128x1_t(q1)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            out["error"] = e

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert "error" not in out, out.get("error")
    _same(out["q"], requantize_fp8(q1, (128, 1)).t(), "fresh thread")
