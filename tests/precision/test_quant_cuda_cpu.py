"""The CUDA 1x128 activation quantizer's host side without CUDA: refusals, the launch it makes (grid, arguments,
output layout), the inputs it hands to Triton, and the first-use check that gates it.

Its bytes are checked on the GPU (tests/gpu/test_quant_cuda_gpu.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from jetrl_precision.kernels import quant_cuda
from jetrl_precision.quantize import quantize_fp8


class _FakeKernel:
    """Stands in for the compiled kernel: records each launch and writes what the kernel is specified to write
    (the reference quantizer's bytes and scales, through the launch's own strides), optionally one byte wrong."""

    def __init__(self, pow2: bool, corrupt: bool = False) -> None:
        self.device_index = -1  # CPU tensors count as this kernel's device
        self.pow2, self.corrupt, self.launches = pow2, corrupt, []

    def __call__(self, grid, threads, tensors, ints, meta=None):
        x, q, s = tensors
        rows, cols, ldx, ldq_words, lds = ints
        self.launches.append((grid, threads, ints))
        assert threads == 128 and grid == (-(-rows // 4), -(-cols // 128))
        src = torch.as_strided(x, (rows, cols), (ldx, 1), x.storage_offset())
        ref = quantize_fp8(src, (1, 128), pow2_scale=self.pow2, nonfinite="propagate")
        torch.as_strided(q, (rows, cols), (4 * ldq_words, 1)).copy_(ref.data)
        torch.as_strided(s, (rows, -(-cols // 128)), (1, lds)).copy_(ref.scale)
        if self.corrupt:
            q.view(torch.uint8)[rows - 1, cols - 1] ^= 1


def _x(rows, cols, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(2 * torch.randn(rows, 1, generator=g))
    x[torch.rand(rows, cols, generator=g) < 3e-3] *= 200.0
    return x.to(dtype)


def test_cpu_is_reported_unusable_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert quant_cuda.status("cpu") == (False, "not a CUDA device")
        assert quant_cuda.quantizer_1x128("cpu", False, torch.bfloat16) is None
    assert not caplog.records


@pytest.mark.parametrize("rows,cols,alloc", [(1, 4096, None), (3, 4096, 4), (130, 576, 132), (64, 1024, 64)])
def test_launch_layout_matches_the_triton_quantizers(rows, cols, alloc):
    kern = _FakeKernel(pow2=False)
    q = quant_cuda.Quantizer1x128(kern, False, torch.bfloat16)
    x = _x(rows, cols)
    got = q(x, alloc)
    n = alloc or rows
    assert got.data.shape == (n, cols) and got.data.is_contiguous()
    assert got.scale.shape == (n, -(-cols // 128)) and got.scale.stride() == (1, n)  # MN-major, M-padded
    ref = quantize_fp8(x, (1, 128), nonfinite="propagate")
    assert torch.equal(got.data[:rows].view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(got.scale[:rows], ref.scale)
    assert kern.launches[0][2] == (rows, cols, cols, cols // 4, n)


def test_inputs_it_cannot_take_go_to_triton(monkeypatch):
    import sys
    import types

    calls = []
    fake = types.ModuleType("jetrl_precision.kernels.quant")  # the Triton module, without importing triton here
    fake.quantize_1x128 = lambda x, pow2, rows_alloc=None: calls.append((x.dtype, x.stride(), rows_alloc))
    monkeypatch.setitem(sys.modules, "jetrl_precision.kernels.quant", fake)
    kern = _FakeKernel(pow2=False)
    q = quant_cuda.Quantizer1x128(kern, False, torch.bfloat16)
    wide = _x(8, 1026)
    # fp32, strided columns, rows 2-byte aligned, C % 4 != 0, fp16 into a bf16 quantizer, more rows than MAX_ROWS
    for x in (_x(8, 256, torch.float32), _x(256, 8).t(), wide[:, 1:1025], _x(8, 254), _x(8, 256, torch.float16),
              _x(quant_cuda.MAX_ROWS + 1, 128)):
        q(x, 12)
    assert len(calls) == 6 and not kern.launches
    assert calls[0] == (torch.float32, (256, 1), 12)


def test_first_use_check_passes_the_exact_kernel_and_names_a_wrong_byte():
    good = quant_cuda.Quantizer1x128(_FakeKernel(pow2=False), False, torch.bfloat16)
    assert quant_cuda.first_mismatch(good, torch.device("cpu")) == ""
    bad = quant_cuda.Quantizer1x128(_FakeKernel(pow2=True, corrupt=True), True, torch.bfloat16)
    msg = quant_cuda.first_mismatch(bad, torch.device("cpu"))
    assert msg.startswith("1 fp8 bytes and 0 scales differ from the reference at shape (1, 4096)")
    wrong_rule = quant_cuda.Quantizer1x128(_FakeKernel(pow2=True), False, torch.bfloat16)  # pow2 scales where plain ones are due
    assert "scales differ" in quant_cuda.first_mismatch(wrong_rule, torch.device("cpu"))


def test_probe_inputs_hold_the_cases_that_break_quantizers():
    xs = quant_cuda.probe_inputs(torch.bfloat16, torch.device("cpu"))
    both = torch.cat([x.flatten().float() for x in xs])
    assert torch.isnan(both).any() and torch.isinf(both).any() and (both == 0).any()
    assert any((x.float().view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any() for x in xs)
    assert any(x.shape[1] % 128 for x in xs) and any(x.shape[0] % 4 for x in xs)
    assert all(bool((x[0, :128] == 0).all()) for x in xs)  # a zero group in each


def test_vllm_cutlass_is_refused_by_name_without_cuda():
    from jetrl_precision.integrations import vllm_cutlass

    assert vllm_cutlass.unavailable_reason("cpu") == "not a CUDA device"
    assert vllm_cutlass.unusable_reason("cpu") == "not a CUDA device"
