"""The torch backend's legacy `torch._scaled_mm` shortcut must give F.scaled_mm's exact bits."""

from __future__ import annotations

import pytest
import torch

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision.gemm import available_backends
from jetrl_precision.gemm import torch_backend as tb

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)


@pytest.mark.parametrize("m,n,k", [(64, 4096, 4096), (200, 6144, 4096), (4096, 4096, 14336), (130, 256, 640)])
def test_legacy_scaled_mm_is_bitwise_equal(m, n, k):
    from jetrl_precision.kernels import quant  # needs Triton, which CPU machines do not have

    reason = available_backends("cuda")["torch"]  # runs the probe, which decides the shortcut
    if reason is not None:
        pytest.skip(f"torch backend unavailable: {reason}")
    if not tb._legacy_same.get(tb.device_key("cuda"), False):
        pytest.skip("the probe found torch._scaled_mm different from F.scaled_mm on this build; the shortcut is off")
    a = quant.quantize_1x128(outlier_data(m, k, seed=m + n))
    b = quant.quantize_128x128(outlier_data(n, k, seed=k) * 0.02)[0]
    dev = tb.device_key(a.data.device)
    with_legacy = tb.torch_gemm_nt(a, b, torch.bfloat16)
    saved = dict(tb._legacy_same)
    tb._legacy_same.clear()  # forces F.scaled_mm
    try:
        without = tb.torch_gemm_nt(a, b, torch.bfloat16)
    finally:
        tb._legacy_same.update(saved)
    assert tb._legacy_same.get(dev, False), f"the probe ran for {list(saved)}, not for {dev}"
    assert with_legacy.shape == (m, n) and torch.isfinite(with_legacy).all()
    assert torch.equal(with_legacy, without)
