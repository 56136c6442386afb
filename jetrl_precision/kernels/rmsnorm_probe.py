"""Whether the fused RMSNorm kernels hold their contract on this device, checked once per (device, dtype).

`rmsnorm.FusedRMSNorm` runs them by default wherever the Triton quantize implementation does, so a kernel that a
Triton or driver version miscompiles must not reach a training run. The probe runs both kernels on rows that cover
what a decoder layer's norm sees (log-normal row scales, outlier channels, a partial 128-column group) and checks:
- the output within two ulps of transformers' formula on every element, and differing on few (the summation order);
- its FP8 bytes and scales equal the reference quantizer's of that output, for both scale rules;
- the backward within bf16's rounding of float64's gradients.
Where any check fails, or a kernel cannot run, the norms compute the formula there instead, and one warning says why.
"""

from __future__ import annotations

import logging

import torch

from ._probe import device_key, verdict_once

__all__ = ["probe_values", "problems", "fused_norm_ok"]

logger = logging.getLogger(__name__)

_verdicts: dict[tuple[str, torch.dtype], bool] = {}
_reasons: dict[tuple[str, torch.dtype], str] = {}
_EPS = 1e-5


def probe_values(device: torch.device | str, dtype: torch.dtype, rows: int = 300, cols: int = 1216):
    """(x, weight, dy): normal values times log-normal row scales, a few channels x40 (a norm's outliers), a weight
    around 1; 1216 columns end in a partial 128-column group, 300 rows in a partial 128-row block."""
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    x[:, torch.randperm(cols, generator=g)[:6]] *= 40.0
    w = 1 + 0.2 * torch.randn(cols, generator=g)
    dy = torch.randn(rows, cols, generator=g) * torch.exp(0.5 * torch.randn(rows, 1, generator=g))
    return tuple(t.to(device=device, dtype=dtype) for t in (x, w, dy))


def problems(fused, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> str:
    """Why the kernels of module `fused` (kernels.fused) break their contract on these operands, or ""."""
    from ..quantize import quantize_fp8
    from ..rmsnorm import rms_norm_formula  # here: jetrl_precision.rmsnorm imports the quantize implementations

    ref = rms_norm_formula(x, w, _EPS)
    for pow2 in (False, True):
        qt, y = fused.rmsnorm_quantize(x, w, _EPS, pow2, return_hp=True)
        rel = ((y.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-30)).max().item()
        if not rel <= 2 ** -6 * 1.01:
            return f"its output is {rel:.3g} (relative) from transformers' formula"
        if (y != ref).float().mean().item() >= 0.05:
            return f"its output differs from transformers' formula on {100 * (y != ref).float().mean().item():.1f}% of elements"
        want = quantize_fp8(y, (1, 128), pow2_scale=pow2, nonfinite="propagate")
        if not (torch.equal(qt.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(qt.scale, want.scale)):
            return f"its FP8 output is not the reference quantizer's (pow2 scales: {pow2})"
    dx, dw = fused.rmsnorm_backward(dy, x, w, _EPS)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    with torch.enable_grad():
        (wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + _EPS))).backward(dy.double())
    for name, got, want in (("dx", dx, xd.grad), ("dweight", dw, wd.grad)):
        rel = ((got.double() - want).abs().max() / want.abs().max()).item()
        if not rel <= 2 ** -5:
            return f"its backward's {name} is {rel:.3g} (relative to the largest) from float64's"
    return ""


def fused_norm_ok(device: torch.device, dtype: torch.dtype, kernels=None) -> bool:
    """The probe's verdict on (device, dtype) for `kernels` (default: kernels.fused), computed on first use; a
    failure is logged once."""

    def check() -> str:
        if kernels is None:
            from . import fused

            return problems(fused, *probe_values(device, dtype))
        return problems(kernels, *probe_values(device, dtype))

    def warn(why: str) -> None:
        logger.warning(
            "jetrl_precision: the fused RMSNorm kernel %s on %s (%s); the norms before FP8 projections compute "
            "transformers' formula there instead, and their projections quantize its output themselves", why, device, dtype,
        )

    return verdict_once(_verdicts, _reasons, (device_key(device), dtype), check, warn)
