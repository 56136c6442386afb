"""EngineLinear and the `jetrl::fp8_linear` custom op: one implementation for eager and compiled engines.

The op declares a contiguous [M, N] output to torch.compile. A backend that returns a column slice of
a wider result (cuBLASLt with N padded to 128) broke that promise, and vLLM's compiled graphs (which run
without Inductor's stride asserts on torch < 2.12) then read the slice with the wrong row stride: the
FP8 engine produced nonsense in vLLM's default mode only. These tests plant such a backend on CPU.
"""

from __future__ import annotations

import pytest
import torch

from precision_testutil import outlier_data
from jetrl_precision import get_recipe, quantize_fp8
from jetrl_precision.gemm import dispatch
from jetrl_precision.gemm.emulated import emulated_gemm_nt
from jetrl_precision.integrations import vllm_plugin  # registers torch.ops.jetrl.fp8_linear
from jetrl_precision.integrations.engine_linear import EngineLinear, spec_code

INPUT = get_recipe("jet_fp8").rollout.input


def _sliced_backend(a, b, out_dtype):
    """Like a vendor GEMM that pads N to 128: the result is a column slice of a NaN-padded buffer."""
    n = b.shape[0]
    wide = torch.full((a.shape[0], -(-n // 128) * 128 + 128), float("nan"), dtype=out_dtype)
    wide[:, :n] = emulated_gemm_nt(a, b, out_dtype)
    return wide[:, :n]


@pytest.fixture
def sliced_backend(monkeypatch):
    dispatch._ensure_registered()
    monkeypatch.setitem(dispatch._REGISTRY, "test_sliced", dispatch.GemmBackend("test_sliced", _sliced_backend, lambda d: None))
    return "test_sliced"


def _weight(parts: list[int], k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qs = [quantize_fp8(outlier_data((n, k), generator=g), (128, 128)) for n in parts]
    groups = [(n, q.scale.shape[0], 128) for n, q in zip(parts, qs)]
    return torch.cat([q.data for q in qs]), torch.cat([q.scale for q in qs]), groups, qs


@pytest.mark.parametrize("parts,k", [([576], 576), ([576, 192, 192], 576), ([256, 256], 384)], ids=["o_proj", "gqa_qkv", "gate_up"])
def test_output_is_contiguous_and_equals_per_part_gemms(sliced_backend, parts, k):
    weight, scale, groups, qs = _weight(parts, k)
    lin = EngineLinear(weight, scale, groups, 128, INPUT, sliced_backend)
    x = outlier_data((7, k), generator=torch.Generator().manual_seed(1))
    y = lin(x)
    assert y.is_contiguous() and y.shape == (7, sum(parts))
    xq = quantize_fp8(x, (1, 128))
    assert torch.equal(y, torch.cat([emulated_gemm_nt(xq, q, torch.float32) for q in qs], dim=-1))
    op = torch.ops.jetrl.fp8_linear(x, weight, scale, *lin.op_args)
    assert op.is_contiguous() and torch.equal(op, y), "the custom op and the eager path must be one implementation"
    assert lin(x[:0]).shape == (0, sum(parts))


def test_compiled_graph_reads_the_op_output_correctly_without_stride_asserts(sliced_backend):
    """vLLM compiles with Inductor's size/stride asserts off (torch < 2.12): the op must keep its declared layout."""
    import torch._inductor.config as inductor_config

    weight, scale, groups, _ = _weight([576], 576)
    args = EngineLinear(weight, scale, groups, 128, INPUT, sliced_backend).op_args

    def block(x):
        y = torch.ops.jetrl.fp8_linear(x, weight, scale, *args)
        return (y * 0.5 + 1.0).flatten()  # a fused pointwise consumer that indexes with the declared strides

    x = outlier_data((5, 576), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    with inductor_config.patch(size_asserts=False, alignment_asserts=False, scalar_asserts=False):
        got = torch.compile(block, fullgraph=True, dynamic=False)(x)
    assert not got.isnan().any()
    assert torch.equal(got, block(x))


def test_refresh_follows_in_place_weight_installs():
    weight, scale, groups, _ = _weight([256], 256)
    lin = EngineLinear(weight, scale, groups, 128, INPUT, "emulated")
    x = outlier_data((4, 256), generator=torch.Generator().manual_seed(3))
    before = lin(x)
    new = quantize_fp8(outlier_data((256, 256), generator=torch.Generator().manual_seed(4)), (128, 128))
    weight.copy_(new.data)
    scale.copy_(new.scale)
    lin.refresh()
    after = lin(x)
    assert not torch.equal(before, after)
    assert torch.equal(after, emulated_gemm_nt(quantize_fp8(x, (1, 128)), new, torch.float32))


def test_op_args_round_trip():
    weight, scale, groups, _ = _weight([128, 64, 64], 256)
    lin = EngineLinear(weight, scale, groups, 128, INPUT, "emulated")
    again = EngineLinear.from_op_args(weight, scale, *lin.op_args)
    assert again.groups == lin.groups and again.input_spec == INPUT and again.one_grid is False
    assert lin.op_args[4] == spec_code(INPUT)
    assert vllm_plugin.spec_from_code(spec_code(INPUT)) == INPUT
    split = EngineLinear(weight, scale, groups, 128, INPUT, "emulated", "deep_gemm", 512)
    again = EngineLinear.from_op_args(weight, scale, *split.op_args)
    assert (again.decode_backend, again.decode_max_m) == ("deep_gemm", 512) and split.op_args[-2:] == ("deep_gemm", 512)
    assert lin.op_args[-2:] == ("", 0) and split.decode_gemm == ""  # no fast path on CPU: one backend at every M
    cut = EngineLinear(weight, scale, groups, 128, INPUT, "emulated", "vllm_cutlass", 512)
    again = EngineLinear.from_op_args(weight, scale, *cut.op_args)
    assert (again.decode_backend, again.decode_max_m) == ("vllm_cutlass", 512)


def test_decode_backend_is_deep_gemm_only_for_auto_over_cublaslt(monkeypatch):
    """An engine's auto runs DeepGEMM for decode-sized batches where it would run cuBLASLt and DeepGEMM is usable;
    a named backend runs at every M."""
    dispatch._ensure_registered()
    real = dispatch._REGISTRY["deep_gemm"]
    assert dispatch.resolve_decode_backend("auto", "cpu", "emulated") is None
    monkeypatch.setitem(dispatch._REGISTRY, "deep_gemm", dispatch.GemmBackend("deep_gemm", real.gemm_nt, lambda d: None))
    assert dispatch.resolve_decode_backend("auto", "cuda", "torch") == "deep_gemm"
    assert dispatch.resolve_decode_backend("torch", "cuda", "torch") is None
    assert dispatch.resolve_decode_backend("auto", "cuda", "triton_invariant") is None  # the bitwise engine's
    monkeypatch.setitem(dispatch._REGISTRY, "deep_gemm", dispatch.GemmBackend(
        "deep_gemm", real.gemm_nt, lambda d: f"{dispatch.NOT_INSTALLED} (test)"))
    assert dispatch.resolve_decode_backend("auto", "cuda", "torch") is None


def test_auto_backend_order_for_rollout_engines(monkeypatch):
    """Where both are usable, training takes DeepGEMM and a rollout engine cuBLASLt (faster at decode sizes)."""
    dispatch._ensure_registered()
    for name in ("deep_gemm", "torch", "triton"):
        b = dispatch._REGISTRY[name]
        monkeypatch.setitem(dispatch._REGISTRY, name, dispatch.GemmBackend(name, b.gemm_nt, lambda d: None))
    assert dispatch.resolve_backend("auto", "cuda") == "deep_gemm"
    assert dispatch.resolve_backend("auto", "cuda", role="rollout") == "torch"
    assert dispatch.resolve_backend("deep_gemm", "cuda", role="rollout") == "deep_gemm"  # an explicit choice stands
    with pytest.raises(ValueError, match="role must be"):
        dispatch.resolve_backend("auto", "cuda", role="decode")


def test_decode_gemm_takes_only_batches_vllm_replays_from_cuda_graphs(monkeypatch):
    """DeepGEMM compiles per tiling at first use: the engine gives it batches up to the largest captured size, and
    none in an eager engine (where it would compile while serving)."""
    pytest.importorskip("vllm")
    from vllm.config import CUDAGraphMode, VllmConfig, set_current_vllm_config

    from jetrl_precision.integrations.vllm_plugin import JetFp8Settings
    from jetrl_precision.integrations.vllm_quant import JetFp8LinearMethod, captured_batch_max

    dispatch._ensure_registered()
    for name in ("deep_gemm", "torch"):
        b = dispatch._REGISTRY[name]
        monkeypatch.setitem(dispatch._REGISTRY, name, dispatch.GemmBackend(name, b.gemm_nt, lambda d: None))
    cuda = torch.device("cuda", 0)
    assert captured_batch_max() is None  # outside an engine's construction
    assert JetFp8LinearMethod(JetFp8Settings.default(), "x").decode_backend_for(cuda) == ("deep_gemm", 512)
    cfg = VllmConfig()
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    for sizes, want in (([1, 2, 4, 8, 16, 32, 64, 128, 256], 256), ([1, 2, 4] + list(range(8, 1025, 8)), 512)):
        cfg.compilation_config.cudagraph_capture_sizes = sizes
        with set_current_vllm_config(cfg):
            assert captured_batch_max() == sizes[-1]
            assert JetFp8LinearMethod(JetFp8Settings.default(), "x").decode_backend_for(cuda) == ("deep_gemm", want)
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    with set_current_vllm_config(cfg):
        assert captured_batch_max() == 0
        assert JetFp8LinearMethod(JetFp8Settings.default(), "x").decode_backend_for(cuda) == (None, 0)


def test_eager_engine_decodes_on_vllm_cutlass_only_when_asked_and_checked(monkeypatch):
    """No CUDA graphs: decode-sized batches stay on cuBLASLt unless JETRL_EAGER_CUTLASS=1 asks for vLLM's CUTLASS
    kernel, and then only under auto and where its check passed."""
    pytest.importorskip("vllm")
    import dataclasses

    from vllm.config import CUDAGraphMode, VllmConfig, set_current_vllm_config

    from jetrl_precision.integrations import vllm_cutlass, vllm_quant
    from jetrl_precision.integrations.vllm_plugin import JetFp8Settings

    dispatch._ensure_registered()
    b = dispatch._REGISTRY["torch"]
    monkeypatch.setitem(dispatch._REGISTRY, "torch", dispatch.GemmBackend("torch", b.gemm_nt, lambda d: None))
    cuda = torch.device("cuda", 0)
    cfg = VllmConfig()
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    verdicts, reasons = {"cuda:0": True}, {}
    monkeypatch.setattr(vllm_cutlass, "_verdicts", verdicts)
    monkeypatch.setattr(vllm_cutlass, "_reasons", reasons)
    auto = JetFp8Settings.default()
    with set_current_vllm_config(cfg):
        assert vllm_quant.JetFp8LinearMethod(auto, "x").decode_backend_for(cuda) == (None, 0)  # off by default
        monkeypatch.setenv("JETRL_EAGER_CUTLASS", "1")
        assert vllm_quant.JetFp8LinearMethod(auto, "x").decode_backend_for(cuda) == ("vllm_cutlass", 512)
        named = dataclasses.replace(auto, recipe=dataclasses.replace(auto.recipe, gemm_backend="torch"))
        assert vllm_quant.JetFp8LinearMethod(named, "x").decode_backend_for(cuda) == (None, 0)
        verdicts["cuda:0"], reasons["cuda:0"] = False, "relative error 1e-1 against float64"
        assert vllm_quant.JetFp8LinearMethod(auto, "x").decode_backend_for(cuda) == (None, 0)
        assert vllm_cutlass.unusable_reason(cuda) == "relative error 1e-1 against float64"


def test_native_call_off_cuda_names_why_and_changes_nothing(sliced_backend):
    """An engine asking for the native one-call linear where it cannot run (here: no CUDA) keeps the Python path,
    with the same output, and says why (what the rollout precision graph records)."""
    from jetrl_precision.integrations import engine_native

    weight, scale, groups, _ = _weight([256], 384)
    x = outlier_data((5, 384), generator=torch.Generator().manual_seed(2))
    plain = EngineLinear(weight, scale, groups, 128, INPUT, sliced_backend)
    asked = EngineLinear(weight, scale, groups, 128, INPUT, sliced_backend, native=True)
    assert asked.native_asked and asked.host_call == "python" and not plain.native_asked
    assert torch.equal(asked(x), plain(x))
    assert engine_native.status("cpu") == "python (needs a CUDA device, got cpu)"
    assert engine_native.native_linear(weight, scale, pow2=True) is None
