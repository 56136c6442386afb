"""The reference quantizer: the one definition of FP8 quantization in this project.

For a group g of values (fp32 math):
    amax  = max(max|x_g|, 1e-10)
    scale = amax / 448                       (fp32; optionally rounded up to a power of two)
    q     = e4m3(clamp(x_g / scale, -448, 448))   (IEEE division, round-to-nearest-even)

Every fast kernel (Triton, CUDA, the vLLM plugin) must reproduce these bytes exactly; the
tests compare bytes, not tolerances. Division (not multiplication by 1/scale) is part of
the contract: the reciprocal costs an ulp and changes bytes.

Non-finite input: `quantize_fp8` raises `NonFiniteInputError` by default (it names the
count and the first position). With `nonfinite="propagate"` (used on the training hot
path, where a check would cost a device sync) a NaN or inf makes its whole group's scale
non-finite, so the group dequantizes to NaN and the NaN surfaces in the loss, where the
trainer stops with a clear error.
"""

from __future__ import annotations

from typing import Literal

import torch

from .formats import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE, Block, Granularity, QuantizedTensor, resolve_block

__all__ = [
    "NonFiniteInputError",
    "quantize_fp8",
    "requantize_fp8",
    "dequantize_fp8",
    "round_scale_pow2",
]


class NonFiniteInputError(ValueError):
    """Raised when a tensor handed to the quantizer holds NaN or inf."""


_FLOAT8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)
)


def round_scale_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Round fp32 scales up to the next power of two (UE8M0-representable). Exact: via frexp, no log2."""
    mantissa, exponent = torch.frexp(scale)
    # scale = m * 2^e with m in [0.5, 1); an exact power of two has m == 0.5.
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(scale), exponent)


def _check_finite(x: torch.Tensor, name: str) -> None:
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise NonFiniteInputError(
            f"{name} of shape {tuple(x.shape)} holds {int(bad.sum())} non-finite value(s) (first at index {first}). "
            "FP8 quantization needs finite input: check the loss for divergence, lower the learning rate, "
            "or find the op that produced NaN/inf."
        )


def _group_view(x: torch.Tensor, block: Block) -> tuple[torch.Tensor, int, int]:
    """Zero-pad [M, K] to full blocks and view as [M/b0, b0, K/b1, b1]. Zeros never change a group's amax."""
    m, k = x.shape
    b0, b1 = block
    pm, pk = (-m) % b0, (-k) % b1
    if pm or pk:
        x = torch.nn.functional.pad(x, (0, pk, 0, pm))
    return x.reshape((m + pm) // b0, b0, (k + pk) // b1, b1), pm, pk


def quantize_fp8(
    x: torch.Tensor,
    block: Block | Granularity | str = (1, 128),
    *,
    pow2_scale: bool = False,
    nonfinite: Literal["raise", "propagate"] = "raise",
) -> QuantizedTensor:
    """Quantize a 2-D tensor to e4m3 with one fp32 scale per block (reference implementation).

    `block` is (1, 128), (128, 128), (128, 1), a `Granularity`, or any (b0, b1). Shapes that are
    not multiples of the block are handled as if zero-padded; `QuantizedTensor.padded` records it.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_fp8 expects a torch.Tensor, got {type(x).__name__}; wrap the data with torch.as_tensor first")
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8 expects a 2-D [M, K] tensor, got shape {tuple(x.shape)}; reshape to 2-D first")
    if x.dtype in _FLOAT8_DTYPES:
        raise TypeError(
            f"quantize_fp8 got a {x.dtype} tensor, which is already FP8 (bytes without their scales); quantize the "
            "high-precision tensor, or re-group a QuantizedTensor with requantize_fp8"
        )
    if not x.is_floating_point():
        raise TypeError(f"quantize_fp8 expects a floating-point tensor (bf16/fp16/fp32), got {x.dtype}")
    if x.device.type == "meta":
        raise ValueError("quantize_fp8 got a meta tensor (no data): materialize the weights first (e.g. load the checkpoint, or gather ZeRO-3 params)")
    if nonfinite == "raise":
        _check_finite(x, "quantize_fp8 input")
    elif nonfinite != "propagate":
        raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
    blk = resolve_block(block, tuple(x.shape))
    m, k = x.shape
    if m == 0 or k == 0:
        raise ValueError(f"quantize_fp8 got an empty tensor of shape {tuple(x.shape)}")
    groups, pm, pk = _group_view(x.float(), blk)
    amax = groups.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)
    # torch's clamp_min drops NaN in favour of the bound; keep NaN visible so it propagates.
    amax = torch.where(torch.isnan(groups).any(dim=(1, 3)), torch.full_like(amax, float("nan")), amax)
    # A tensor divisor, not the Python scalar: on CUDA, torch turns `t / scalar` into t * (1/scalar),
    # which is not the IEEE division of the contract and changes ~1e-3 of the scales (and bytes).
    scale = amax / torch.full_like(amax, E4M3_MAX)
    if pow2_scale:
        scale = round_scale_pow2(scale)
    q = (groups / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    q = q.reshape(m + pm, k + pk)[:m, :k].contiguous()
    return QuantizedTensor(q, scale.contiguous(), blk)


def requantize_fp8(qt: QuantizedTensor, block: Block | Granularity | str, *, pow2_scale: bool = False) -> QuantizedTensor:
    """Re-quantize an FP8 tensor to another granularity (e.g. saved 1x128 activations -> 128x1 for WGrad).

    Defined as quantizing the fp32 dequantization: q * scale is one fp32 multiply, correctly
    rounded (not exact: 4 + 24 significant bits), with no bf16 round trip. Fast kernels must
    form the same fp32 product (a plain multiply, not fused into anything) to match bytes.
    """
    return quantize_fp8(qt.dequantize(torch.float32), block, pow2_scale=pow2_scale, nonfinite="propagate")


def dequantize_fp8(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return qt.dequantize(dtype)
