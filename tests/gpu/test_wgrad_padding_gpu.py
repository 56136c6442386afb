"""WGrad operands padded along tokens by the quantizer kernels: the bytes `layout.pad_columns` gives (zero columns
after the reference's), and the same weight gradient as the GEMM's own padding copy."""

from __future__ import annotations

import pytest
import torch

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision.quantize import quantize_fp8, requantize_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

if torch.cuda.is_available():
    from jetrl_precision.kernels import cast_transpose, quant
    from jetrl_precision.kernels.layout import pad_columns

SHAPES = [(200, 384), (4128, 1024), (272, 4100), (256, 512), (16, 128)]


def _same(got, ref, what):
    assert got.block == ref.block and got.data.shape == ref.data.shape, what
    # The inputs hold a NaN and an inf on purpose, so their blocks' scales are non-finite: equal_nan.
    torch.testing.assert_close(got.scale, ref.scale, rtol=0, atol=0, equal_nan=True, msg=f"{what}: scales differ")
    bad = (got.data.view(torch.uint8) != ref.data.view(torch.uint8)).sum().item()
    assert bad == 0, f"{what}: {bad} of {got.data.numel()} fp8 bytes differ"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_padded_transposed_quantizers_match_the_padded_reference(shape, pow2):
    x = outlier_data(*shape, seed=31)
    x[1, 2] = float("nan")  # non-finite values keep their bytes next to the padding
    x[-1, -1] = float("inf")
    want = pad_columns(quantize_fp8(x, (128, 1), pow2_scale=pow2, nonfinite="propagate").t(), 128)
    got = quant.quantize_128x1_t(x, pow2, pad_to=128)
    _same(got, want, f"128x1^T {shape}")
    assert got.data.shape[1] % 128 == 0
    q1 = quantize_fp8(x, (1, 128), nonfinite="propagate")
    want_r = pad_columns(requantize_fp8(q1, (128, 1), pow2_scale=pow2).t(), 128)
    _same(quant.requantize_1x128_to_128x1(q1, True, pow2, kernel="triton", pad_to=128), want_r, f"triton requant^T {shape}")
    if cast_transpose.supported_shape(q1):
        _same(cast_transpose.requantize_1x128_to_128x1_t(q1, pow2, pad_to=128), want_r, f"cuda requant^T {shape}")


def test_the_device_probe_passes_on_this_gpu():
    """Where the kernels are right the probe must say so: otherwise every layer silently pads by a copy again."""
    from jetrl_precision.kernels import padding_probe
    from jetrl_precision.kernels.impl import TritonQuantizeImpl

    padding_probe._verdicts.pop(str(torch.device("cuda")), None)
    assert TritonQuantizeImpl._kernel_pad(torch.device("cuda"), 128) == 128, padding_probe._verdicts


def test_a_layer_gets_the_same_weight_gradient_without_the_gemms_padding_copy(monkeypatch):
    from jetrl_precision import Fp8Linear, get_recipe
    from jetrl_precision.gemm import torch_backend
    from jetrl_precision.kernels import layout

    recipe = get_recipe("jet_fp8")
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 768, bias=False, device="cuda", dtype=torch.bfloat16)
    x = outlier_data(4128, 1024, seed=32).to(torch.bfloat16)  # 4 sequences of 1032 tokens: K of WGrad % 128 != 0
    dy = outlier_data(4128, 768, seed=33).to(torch.bfloat16) * 1e-2

    def grads(multiple: int):
        monkeypatch.setattr(torch_backend.TorchPreparedGemm, "wgrad_k_multiple", multiple)
        layer = Fp8Linear.from_linear(lin, recipe.train_fprop, recipe.train_backward, "torch")
        lin.weight.grad = None
        xi = x.clone().requires_grad_(True)
        layer(xi).backward(dy)
        return xi.grad, lin.weight.grad.clone()

    layout.padding_events.clear()
    new = grads(128)
    assert not any("K=4128" in k for k in layout.padding_events), layout.padding_events
    old = grads(1)
    assert any("K=4128" in k for k in layout.padding_events), "the unpadded operands must take the GEMM's padding copy"
    for a, b in zip(new, old):
        assert torch.equal(a, b)
