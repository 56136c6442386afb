"""The host-lean training path on the GPU: direct Triton launches give kernel[grid]'s bytes and are really taken;
a planned Fp8Linear step (bound quantizers, prepared GEMM operands) gives the bytes of the unplanned calls on every
backend, eager and under a CUDA graph; the scaled_mm_v2 shortcut equals F.scaled_mm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision import Fp8Linear, get_recipe, mark_weights_updated, ops
from jetrl_precision.gemm import available_backends, gemm_nt
from jetrl_precision.quantize import quantize_fp8, requantize_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

if torch.cuda.is_available():
    from jetrl_precision.kernels import fused, launch, quant, transpose_quantized

RECIPE = get_recipe("jet_fp8")


def _same_qt(got, ref, what):
    assert got.block == ref.block and got.data.shape == ref.data.shape, what
    bad = int((got.data.view(torch.uint8) != ref.data.view(torch.uint8)).sum())
    assert bad == 0, f"{what}: {bad} fp8 bytes differ"
    assert torch.equal(got.scale, ref.scale), f"{what}: scales differ"


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.contiguous().view(torch.int16), want.contiguous().view(torch.int16)), f"{what}: bits differ"


def _count_direct(launcher):
    """Wrap the learnt launchers of `launcher` so that direct launches are counted."""
    calls = [0]
    for key, (run, function, packed, tail) in list(launcher._table.items()):
        def counted(*a, _run=run):
            calls[0] += 1
            return _run(*a)
        launcher._table[key] = (counted, function, packed, tail)
    return calls


CASES = {
    "1x128": (lambda: quant._kern_1x128, lambda x: quant.quantize_1x128(x), lambda x: quantize_fp8(x, (1, 128))),
    "128x1^T": (lambda: quant._kern_128x1, lambda x: quant.quantize_128x1_t(x), lambda x: quantize_fp8(x, (128, 1)).t()),
    "128x128": (lambda: quant._kern_128x128, lambda x: quant.quantize_128x128(x)[0], lambda x: quantize_fp8(x, (128, 128))),
    "requant (triton)": (lambda: quant._kern_128x1,
                         lambda x: quant.requantize_1x128_to_128x1(quantize_fp8(x, (1, 128)), True, kernel="triton"),
                         lambda x: requantize_fp8(quantize_fp8(x, (1, 128)), (128, 1)).t()),
    "silu_mul": (lambda: fused._kern_silu_mul, lambda x: fused.silu_mul_quantize(x, x * 0.5),
                 lambda x: quantize_fp8(F.silu(x) * (x * 0.5), (1, 128))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_direct_launches_are_taken_and_give_kernel_grid_bytes(case, monkeypatch):
    monkeypatch.setenv("JETRL_TRITON_DIRECT_LAUNCH", "1")  # on for any checked version: this test is what checks it
    monkeypatch.setattr(launch, "_status", {})
    ok, why = launch.direct_launch_status()
    if launch._triton_version() not in launch.DIRECT_LAUNCH_VERSIONS:
        pytest.skip(f"direct launches are off here: {why}")
    assert ok, why
    get_launcher, run, ref = CASES[case]
    x = outlier_data(1000, 1536, seed=3)
    first = run(x)  # learns the signature (through kernel[grid])
    calls = _count_direct(get_launcher())
    second = run(x)
    torch.cuda.synchronize()
    assert calls[0] >= 1, f"{case}: the repeat launch did not take the direct path"
    want = ref(x)
    _same_qt(first, want, f"{case} via kernel[grid]")
    _same_qt(second, want, f"{case} via the direct launch")


def _layers(n, k, backend, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(outlier_data(n, k, seed=seed) * 0.02)
    return lin, Fp8Linear.from_linear(lin, RECIPE.train_fprop, RECIPE.train_backward, gemm_backend=backend)


def _unplanned(weight, x, dy, backend):
    """The step spelled out with the dispatching calls (what Fp8Linear ran before step plans)."""
    fp, bw = RECIPE.train_fprop, RECIPE.train_backward
    ops.release_shared_results()
    xq = ops.quantize(x, fp.input)
    wq = ops.quantize(weight.detach(), fp.weight)
    y = gemm_nt(xq, wq, torch.bfloat16, backend)
    gq, gt = ops.quantize_dual(dy, bw.dgrad_grad_output, bw.wgrad_grad_output)
    dx = gemm_nt(gq, transpose_quantized(wq), torch.bfloat16, backend)
    dw = gemm_nt(gt, ops.requantize_transposed(xq, bw.wgrad_input), torch.bfloat16, backend)
    return y, dx, dw


@pytest.mark.parametrize("backend", ["torch", "deep_gemm", "triton"])
@pytest.mark.parametrize("shape", [(256, 512, 768), (200, 384, 640), (96, 384, 640), (4096, 4096, 4096)], ids=str)
def test_planned_step_equals_unplanned_calls(backend, shape):
    reason = available_backends("cuda")[backend]
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    if backend == "deep_gemm" and shape[0] % 128:
        # DeepGEMM compiles a kernel per (N, K) at first use (seconds each): two shapes cover its prepared path; the
        # ragged-M shapes exercise the same call and the torch backend runs them all.
        pytest.skip("deep_gemm: covered by the aligned shapes (JIT compile time)")
    m, k, n = shape
    lin, layer = _layers(n, k, backend)
    x = outlier_data(m, k, seed=1)
    dy = outlier_data(m, n, seed=2) * 1e-3
    want = _unplanned(lin.weight, x, dy, backend)
    for step in range(2):  # the second step runs on the cached weight operands
        ops.release_shared_results()
        xx = x.clone().requires_grad_(True)
        lin.weight.grad = None
        y = layer(xx)
        y.backward(dy)
        for what, got, w in zip(("y", "dX", "dW"), (y, xx.grad, lin.weight.grad), want):
            _same(got, w, f"{backend} {shape} step {step} {what}")
    with torch.no_grad():
        _same(layer(x), want[0], f"{backend} {shape} no-grad forward")
    mark_weights_updated()


def test_planned_step_under_a_cuda_graph():
    if available_backends("cuda")["torch"] is not None:
        pytest.skip("needs the torch backend")
    lin, layer = _layers(1024, 512, "torch")
    x = outlier_data(512, 512, seed=4).requires_grad_(True)
    dy = outlier_data(512, 1024, seed=5) * 1e-3
    eager_y = layer(x)
    eager_y.backward(dy)
    want = (eager_y.detach().clone(), x.grad.clone(), lin.weight.grad.clone())
    # The capture re-reads the warm-up input: the share cache must not let a hit skip its quantization.
    w = nn.Parameter(lin.weight.detach().clone())
    with torch.device("meta"):
        over = nn.Linear(512, 1024, bias=False)
    over.weight = w
    graphed = torch.cuda.make_graphed_callables(
        Fp8Linear.from_linear(over, RECIPE.train_fprop, RECIPE.train_backward, gemm_backend="torch"),
        (x.detach().clone().requires_grad_(True),), num_warmup_iters=3)
    xg = x.detach().clone().requires_grad_(True)
    yg = graphed(xg)
    yg.backward(dy)
    # Same operands and calls; cuBLASLt may pick another algorithm on the capture stream, which can move an fp32 sum
    # by an ulp and so flip the bf16 rounding of an output: at most one bf16 ulp (2^-8 relative) per element.
    for what, got, ref in (("y", yg.detach(), want[0]), ("dX", xg.grad, want[1]), ("dW", w.grad, want[2])):
        err = float((got.double() - ref.double()).norm() / ref.double().norm())
        assert err <= 2.0**-8, f"graph {what}: relative error {err:.2e} above one bf16 rounding"


def test_shared_quantization_is_not_reused_across_a_graph_capture():
    """A quantization kept from an eager call must not stand in for the kernel inside a capture (the replay would
    read the bytes of the input seen at capture), nor may one made inside a capture serve a later eager call."""
    impl = ops._impl_for(torch.device("cuda"))
    assert impl is not None and impl.share_results
    spec = RECIPE.train_fprop.input
    x = outlier_data(256, 1024, seed=6)
    ops.quantize(x, spec)  # kept: same storage, version and shape as the captured call below
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.quantize(x, spec)
    eager = ops.quantize(x, spec)  # the capture ran no kernel: a kept capture result would hold no valid bytes yet
    assert eager.data.data_ptr() != captured.data.data_ptr(), "an eager call reused the graph's buffer"
    _same_qt(eager, quantize_fp8(x, (1, 128)), "eager right after the capture")
    for seed in (7, 8):
        x.copy_(outlier_data(256, 1024, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        _same_qt(captured, quantize_fp8(x, (1, 128)), f"replay with input seed {seed}")


def test_scaled_mm_v2_shortcut_equals_f_scaled_mm():
    from jetrl_precision.gemm import torch_backend as tb

    if available_backends("cuda")["torch"] is not None:
        pytest.skip("needs the torch backend")
    key = tb.device_key("cuda")
    assert key in tb._v2_same, "the device probe decides whether the shortcut is taken"
    a = quant.quantize_128x1_t(outlier_data(1024, 512, seed=6))  # (512, 1024): WGrad's dY^T
    b = quant.quantize_128x1_t(outlier_data(1024, 768, seed=7))  # (768, 1024): WGrad's X^T
    one = tb.scaling_types()[0]
    ref = F.scaled_mm(a.data, b.data.t(), a.scale, one, b.scale, one, output_dtype=torch.bfloat16)
    got = tb.prepared_scaled_mm_1x128("cuda")(a.data, b.data.t(), a.scale, b.scale, torch.bfloat16)
    _same(got, ref, f"scaled_mm 1x128.1x128 ({'v2 shortcut' if tb._v2_same[key] else 'F.scaled_mm'})")


def test_prepared_blockwise_scaled_mm_equals_f_scaled_mm():
    """The forward's and DGrad's GEMM (1x128 x 128x128) through the prepared entry point the probe chose (legacy,
    direct `_scaled_mm_v2` or F.scaled_mm itself) gives F.scaled_mm's bits, M = 64 and 256 (decode) and 4096."""
    from jetrl_precision.gemm import torch_backend as tb
    from jetrl_precision.kernels.layout import row_major_padded_t

    if available_backends("cuda")["torch"] is not None:
        pytest.skip("needs the torch backend")
    key = tb.device_key("cuda")
    assert key in tb._v2_block_same, "the device probe decides whether the shortcut is taken"
    one, block = tb.scaling_types()
    w = quant.quantize_128x128(outlier_data(1536, 1024, seed=9) * 0.02)[0]
    for m in (64, 256, 4096):
        a = quant.quantize_1x128(outlier_data(m, 1024, seed=m))
        sb = row_major_padded_t(w.scale)
        ref = F.scaled_mm(a.data, w.data.t(), a.scale, one, sb, block, output_dtype=torch.bfloat16)
        got = tb.prepared_scaled_mm("cuda")(a.data, w.data.t(), a.scale, sb, torch.bfloat16)
        route = "legacy" if tb._legacy_same.get(key) else "v2 shortcut" if tb._v2_block_same[key] else "F.scaled_mm"
        _same(got, ref, f"scaled_mm 1x128.128x128 at M={m} ({route})")
