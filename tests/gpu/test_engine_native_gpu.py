"""The eager engine's native FP8 linear (`engine_native`, csrc/engine_linear.cpp): one C++ call making the 1x128
quantizer launch and the cuBLASLt blockwise GEMM. It must give the Python path's bits (layers of one K in turn, so
the shared workspace is reused; M not a multiple of 4; strided rows; a side stream; a thread with no current CUDA
context), refuse what it is not for (more than 512 rows, a capturing stream) so the Python path runs those, follow
in-place weight installs, and fall back with a named reason when turned off."""

from __future__ import annotations

import threading

import pytest
import torch

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision.quantize import quantize_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)


def _sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the prepared cuBLASLt path is sm90-only")


def _pair(n=1024, k=4096, seed=0):
    """(native, python) EngineLinear over the same weight parameters."""
    from jetrl_precision import get_recipe
    from jetrl_precision.integrations.engine_linear import EngineLinear

    spec = get_recipe("jet_fp8").rollout.input
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * torch.exp(torch.randn(n, 1, device="cuda", generator=g))
    wq = quantize_fp8(w, (128, 128))
    args = (wq.data, wq.scale, [(n, n // 128, 128)], 128, spec, "torch")
    nat, py = EngineLinear(*args, native=True), EngineLinear(*args)
    if nat.host_call != "native":
        from jetrl_precision.integrations import engine_native

        pytest.fail(f"the native linear is not used: {engine_native.status('cuda')}")
    return nat, py


def _bits(t):
    return t.view(torch.int16)


def test_native_equals_python_path_bits():
    _sm90()
    layers = [_pair(n, 4096, seed=i) for i, n in enumerate((1024, 4096, 1536))]
    for m in (1, 3, 7, 64, 130, 256, 512):
        x = outlier_data(m, 4096, seed=m)
        for i, (nat, py) in enumerate(layers):
            got, want = nat(x), py(x)
            assert got.shape == want.shape and got.is_contiguous() and got.dtype == torch.bfloat16
            assert torch.equal(_bits(got), _bits(want)), f"M={m} layer {i}"
    # strided rows (a slice of a wider activation)
    wide = outlier_data(48, 4096 + 256, seed=9)
    nat, py = layers[0]
    assert torch.equal(_bits(nat(wide[:, :4096])), _bits(py(wide[:, :4096])))


def test_native_refuses_what_it_is_not_for():
    _sm90()
    from jetrl_precision.integrations.engine_native import NATIVE_MAX_M

    nat, py = _pair()
    stream = torch.cuda.current_stream().cuda_stream
    assert nat._native(outlier_data(NATIVE_MAX_M + 1, 4096), stream) is None
    assert nat._native(outlier_data(8, 4096, dtype=torch.float16), stream) is None
    assert nat._native(outlier_data(0, 4096), stream) is None
    # the EngineLinear call runs the Python path for those: same bits
    x = outlier_data(NATIVE_MAX_M + 88, 4096, seed=3)
    assert torch.equal(_bits(nat(x)), _bits(py(x)))
    assert nat(outlier_data(0, 4096)).shape == (0, 1024)


def test_native_under_capture_side_stream_and_new_thread():
    _sm90()
    nat, py = _pair()
    static = outlier_data(64, 4096, seed=1).clone()
    nat(static)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = nat(static)  # the C++ call sees the capture and returns None: the Python path is captured
    for seed in (2, 3):
        fresh = outlier_data(64, 4096, seed=seed)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bits(out), _bits(py(fresh))), f"replay {seed}"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    x = outlier_data(16, 4096, seed=4)
    with torch.cuda.stream(side):
        got = nat(x)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(_bits(got), _bits(py(x))), "side stream"
    result = {}

    def worker():  # a plain thread: no current CUDA context until the call makes the primary one current
        try:
            result["y"] = nat(x)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert "error" not in result, result.get("error")
    assert torch.equal(_bits(result["y"]), _bits(py(x))), "new thread"


def test_native_follows_in_place_weight_installs():
    _sm90()
    nat, py = _pair(seed=5)
    x = outlier_data(32, 4096, seed=6)
    before = nat(x).clone()
    new = quantize_fp8(torch.randn(1024, 4096, device="cuda") * 3.0, (128, 128))
    nat.weight.copy_(new.data)  # py shares the parameters: what a weight sync does, then refresh
    nat.weight_scale.copy_(new.scale)
    nat.refresh()
    py.refresh()
    after = nat(x)
    assert not torch.equal(_bits(before), _bits(after))
    assert torch.equal(_bits(after), _bits(py(x)))


def test_turned_off_names_why(monkeypatch):
    _sm90()
    from jetrl_precision import get_recipe
    from jetrl_precision.integrations import engine_native
    from jetrl_precision.integrations.engine_linear import EngineLinear

    monkeypatch.setenv(engine_native.ENV_SWITCH, "0")
    monkeypatch.setattr(engine_native, "_runtimes", {})
    wq = quantize_fp8(torch.randn(256, 256, device="cuda"), (128, 128))
    lin = EngineLinear(wq.data, wq.scale, [(256, 2, 128)], 128, get_recipe("jet_fp8").rollout.input, "torch", native=True)
    assert lin.host_call == "python"
    assert engine_native.status("cuda") == f"python (turned off ({engine_native.ENV_SWITCH}=0))"
