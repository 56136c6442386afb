"""Shared helpers for the GPU tests (skips, data with outliers, error metrics)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

requires_cuda_reason = "needs a CUDA GPU"


def require_cuda_and_vllm() -> None:
    """Skip the calling test module (at collection) without a CUDA GPU or without vLLM's GPU build."""
    if not torch.cuda.is_available():
        pytest.skip(requires_cuda_reason, allow_module_level=True)
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (GPU build)", allow_module_level=True)


def outlier_data(m: int, k: int, dtype=torch.bfloat16, seed: int = 0, device: str = "cuda") -> torch.Tensor:
    """Normal values x a log-normal factor per row, 0.5% of channels x20, 1e-4 of entries x50; no exact zeros."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device) * torch.exp(0.5 * torch.randn(m, 1, generator=g, device=device))
    x = torch.where(x == 0, torch.full_like(x, 1e-3), x)
    ch = torch.rand(k, generator=g, device=device) < 5e-3
    x = torch.where(ch[None, :], x * 20, x)
    x = torch.where(torch.rand(m, k, generator=g, device=device) < 1e-4, x * 50, x)
    return x.to(dtype)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def sqnr_db(got: torch.Tensor, ref: torch.Tensor) -> float:
    noise = (got.double() - ref.double()).norm()
    return float("inf") if noise == 0 else 20 * math.log10(float(ref.double().norm() / noise))


def fwd_bwd(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """One forward and backward from fresh gradients: (y, dX, {parameter name: gradient})."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = model(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


# -- blockwise scaled_mm (the torch backend's GEMMs and the plans that stand in for its calls) --------------------
def require_blockwise_scaled_mm() -> None:
    """Skip the calling test where torch's blockwise scaled_mm cannot run (sm90 only)."""
    from jetrl_precision.gemm import torch_backend

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("blockwise scaled_mm is sm90-only here")
    why = torch_backend.unavailable_reason(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)


def blockwise_operands(m: int, n: int, k: int, block_b: str, seed: int) -> tuple:
    """(a, b_t, sa, sb) as the torch backend passes them: `a` 1x128 with outlier rows and columns, `b` 128x128 or
    1x128 (`block_b`), their scales in the layouts scaled_mm reads."""
    from jetrl_precision.kernels.layout import mn_major, row_major_padded_t
    from jetrl_precision.quantize import quantize_fp8

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.exp(2 * torch.randn(m, 1, device="cuda", generator=g))
    x[:, ::97] *= 300.0  # outlier columns
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    aq = quantize_fp8(x, (1, 128))
    wq = quantize_fp8(w, (128, 128) if block_b == "128x128" else (1, 128))
    sb = row_major_padded_t(wq.scale) if block_b == "128x128" else mn_major(wq.scale)
    return aq.data, wq.data.t(), mn_major(aq.scale), sb


def f_scaled_mm(block_b: str):
    """fn(a, b_t, sa, sb, out_dtype): F.scaled_mm for 1x128 x `block_b`, the reference every plan must equal."""
    from jetrl_precision.gemm import torch_backend

    one, block = torch_backend.scaling_types()
    rec_b = block if block_b == "128x128" else one
    return lambda a, b_t, sa, sb, od: torch.nn.functional.scaled_mm(a, b_t, sa, one, sb, rec_b, output_dtype=od)


def assert_same_as_scaled_mm(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    bad = int((got != ref).sum())
    assert got.dtype == ref.dtype and got.shape == ref.shape and bad == 0, f"{what}: {bad} of {ref.numel()} outputs differ from F.scaled_mm"
