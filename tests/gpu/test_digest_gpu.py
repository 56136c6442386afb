"""The weight-sync digest is computed where a tensor lives: a GPU tensor digests as its CPU copy does."""

from __future__ import annotations

import pytest
import torch

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision import quantize_fp8
from jetrl_precision.digests import _DIGEST_CHUNK, digest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_digest_equals_cpu_digest(dtype):
    x = outlier_data(1000, 3 * _DIGEST_CHUNK // 1000 // 4 + 7, dtype=dtype)  # spans several chunks
    assert digest(x) == digest(x.cpu())
    q = quantize_fp8(x.float(), (128, 128))
    assert digest(q.data) == digest(q.data.cpu()) and digest(q.scale) == digest(q.scale.cpu())
    y = x.clone()
    y.view(torch.uint8).reshape(-1)[-1] ^= 0x80
    assert digest(y) != digest(x)
