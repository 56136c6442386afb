"""EngineLinear (the vLLM jetrl_fp8 forward) on the GPU: its cuBLASLt fast path gives the bytes the trainer's
FP8 linear gives, for every M (decode sizes included) and for shapes that are not multiples of 128."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu_testutil import outlier_data, rel_err, requires_cuda_reason
from jetrl_precision import Fp8Linear, get_recipe, quantize_fp8
from jetrl_precision.formats import QuantizedTensor
from jetrl_precision.gemm import available_backends, gemm_nt
from jetrl_precision.integrations import vllm_plugin  # noqa: F401  (registers torch.ops.jetrl.fp8_linear)
from jetrl_precision.integrations.engine_linear import EngineLinear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

RECIPE = get_recipe("jet_fp8")


def _torch_backend() -> str:
    reason = available_backends("cuda")["torch"]
    if reason is not None:
        pytest.skip(f"torch backend: {reason}")
    return "torch"


def _engine_and_trainer(parts: list[int], k: int, seed: int = 0):
    backend = _torch_backend()
    ws = [outlier_data(n, k, seed=seed + i) * 0.02 for i, n in enumerate(parts)]
    qs = [quantize_fp8(w, (128, 128)) for w in ws]
    weight = torch.cat([q.data for q in qs]).contiguous()
    scale = torch.cat([q.scale for q in qs]).contiguous()
    groups = [(n, q.scale.shape[0], 128) for n, q in zip(parts, qs)]
    eng = EngineLinear(weight, scale, groups, 128, RECIPE.rollout.input, backend)
    trainers = []
    for w in ws:
        lin = nn.Linear(k, w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w)
        trainers.append(Fp8Linear.from_linear(lin, RECIPE.train_fprop, RECIPE.train_backward, gemm_backend=backend))
    return eng, trainers


@pytest.mark.parametrize("parts,k", [([6144], 4096), ([4096], 14336), ([576], 576), ([576, 192, 192], 576)],
                         ids=["qkv_8b", "down_8b", "o_proj_smollm2", "qkv_smollm2"])
@pytest.mark.parametrize("m", [1, 3, 64, 130, 256])
def test_engine_forward_equals_the_trainers_fp8_forward(parts, k, m):
    eng, trainers = _engine_and_trainer(parts, k)
    x = outlier_data(m, k, seed=7)
    y = eng(x)
    assert y.is_contiguous() and y.shape == (m, sum(parts))
    with torch.no_grad():
        ref = torch.cat([t(x) for t in trainers], dim=-1)
    assert torch.equal(y, ref), f"max diff {(y.float() - ref.float()).abs().max():.3g}"
    assert eng._fast is not False or (k % 128 or sum(parts) % 128 or len(parts) > 1), "the aligned shapes must take the fast path"
    op = torch.ops.jetrl.fp8_linear(x, eng.weight, eng.weight_scale, *eng.op_args)
    assert torch.equal(op, y)
    hp = x.float() @ torch.cat([t.weight.float() for t in trainers]).t()
    assert rel_err(y, hp) < 0.08  # FP8 error against the unquantized layer: sanity, not the contract


@pytest.mark.parametrize("m", [1, 3, 64, 130, 512, 513, 2048])
def test_decode_batches_run_deep_gemm_with_its_backends_bytes(m):
    """With DeepGEMM as the decode backend, M <= 512 gives `gemm_nt`'s bytes on deep_gemm, larger M cuBLASLt's."""
    if available_backends("cuda")["deep_gemm"] is not None:
        pytest.skip(f"deep_gemm backend: {available_backends('cuda')['deep_gemm']}")
    plain, _ = _engine_and_trainer([6144], 4096)
    eng = EngineLinear(plain.weight, plain.weight_scale, plain.groups, 128, RECIPE.rollout.input, "torch", "deep_gemm", 512)
    assert eng.decode_gemm == "deep_gemm (M <= 512)"
    x = outlier_data(m, 4096, seed=11)
    y = eng(x)
    xq = quantize_fp8(x, (1, 128))
    wq = QuantizedTensor(eng.weight, eng.weight_scale, (128, 128))
    ref = gemm_nt(xq, wq, torch.bfloat16, "deep_gemm" if m <= 512 else "torch")
    assert y.is_contiguous() and y.shape == (m, 6144)
    assert torch.equal(y, ref), f"max diff {(y.float() - ref.float()).abs().max():.3g}"
    assert torch.equal(torch.ops.jetrl.fp8_linear(x, eng.weight, eng.weight_scale, *eng.op_args), y)
    exact = xq.dequantize(torch.float32) @ wq.dequantize(torch.float32).t()
    assert rel_err(y, exact) < 0.01  # the FP8 operands' product, rounded to bf16 (both kernels accumulate in fp32)
    if m <= 512:  # under a CUDA graph (how vLLM runs decode batches), after a weight install
        y_static, new = _replay_after_install(eng, x, seed=12)
        assert torch.equal(y_static, gemm_nt(xq, new, torch.bfloat16, "deep_gemm"))


def _replay_after_install(eng: EngineLinear, x: torch.Tensor, seed: int):
    """Capture eng(x) in a CUDA graph, install new FP8 weights in place (as a sync does), refresh, replay:
    (the replay's output, the installed weights)."""
    g = torch.cuda.CUDAGraph()
    eng(x)  # warm-up outside the capture (kernels compiled, autotuned)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        y_static = eng(x)
    new = quantize_fp8(outlier_data(eng.n, eng.k, seed=seed) * 0.02, (128, 128))
    eng.weight.copy_(new.data)
    eng.weight_scale.copy_(new.scale)
    eng.refresh()
    g.replay()
    torch.cuda.synchronize()
    return y_static, new


def test_refresh_after_an_in_place_install_keeps_the_graph_buffers():
    eng, _ = _engine_and_trainer([512], 1024)
    x = outlier_data(64, 1024, seed=3)
    y_static, _ = _replay_after_install(eng, x, seed=9)
    assert torch.equal(y_static, eng(x)), "a captured graph must read the installed weights"


def test_compiled_engine_layer_equals_eager_without_stride_asserts():
    import torch._inductor.config as inductor_config

    eng, _ = _engine_and_trainer([576], 576)
    args = eng.op_args

    def block(x):
        return (torch.ops.jetrl.fp8_linear(x, eng.weight, eng.weight_scale, *args).float() * 0.5 + 1.0).flatten()

    x = outlier_data(37, 576, seed=5)
    torch._dynamo.reset()
    with inductor_config.patch(size_asserts=False, alignment_asserts=False, scalar_asserts=False):
        got = torch.compile(block, fullgraph=True, dynamic=False)(x)
    assert torch.equal(got, block(x))


def test_op_passes_opcheck():
    eng, _ = _engine_and_trainer([576], 576)
    x = outlier_data(20, 576, seed=6)
    torch.library.opcheck(torch.ops.jetrl.fp8_linear.default, (x, eng.weight, eng.weight_scale, *eng.op_args),
                          test_utils=("test_faketensor",))  # test_schema mutates inputs with ops e4m3 lacks


@pytest.mark.parametrize("m", [1, 3, 64, 130, 256, 600])
def test_eager_decode_on_vllm_cutlass(m):
    """vLLM's CUTLASS blockwise kernel as the decode GEMM (an eager engine's auto): within the GEMM backends' bound of
    a float64 product of the same FP8 operands for M <= 512, contiguous [M, N]; above 512 the cuBLASLt bytes."""
    pytest.importorskip("vllm")
    from jetrl_precision.integrations import vllm_cutlass

    why = vllm_cutlass.unusable_reason("cuda")
    if torch.cuda.get_device_capability() >= (9, 0):
        assert why == "", f"the kernel must run and pass its check on sm90: {why}"
    else:
        pytest.skip(why)
    plain, _ = _engine_and_trainer([1536], 4096)
    eng = EngineLinear(plain.weight, plain.weight_scale, plain.groups, 128, RECIPE.rollout.input, plain.backend, "vllm_cutlass", 512)
    assert eng.decode_gemm == "vllm_cutlass (M <= 512)"
    x = outlier_data(m, 4096, seed=11)
    y = eng(x)
    assert y.is_contiguous() and y.shape == (m, 1536) and y.dtype == torch.bfloat16
    if m > 512:
        assert torch.equal(y, plain(x))
        return
    xq = quantize_fp8(x, (1, 128))
    ref = xq.dequantize(torch.float64) @ QuantizedTensor(plain.weight, plain.weight_scale, (128, 128)).dequantize(torch.float64).t()
    assert rel_err(y, ref) <= vllm_cutlass.REL_TOL
    op = torch.ops.jetrl.fp8_linear(x, eng.weight, eng.weight_scale, *eng.op_args)
    assert torch.equal(op, y)
