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
