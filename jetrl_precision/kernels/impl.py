"""The Triton quantize implementation registered with `jetrl_precision.ops`."""

from __future__ import annotations

import torch

from ..formats import Block, QuantizedTensor
from ..quantize import quantize_fp8, requantize_fp8
from . import quant

__all__ = ["TritonQuantizeImpl"]


def _fp8_capable(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    # The e4m3 conversion instruction (cvt.rn.satfinite.e4m3x2.f32) needs sm89 or newer.
    return torch.cuda.get_device_capability(device) >= (8, 9)


class TritonQuantizeImpl:
    """Byte-exact Triton kernels for 1x128, 128x128 and 128x1 blocks; other blocks use the reference."""

    name = "triton"

    def __init__(self) -> None:
        self._ok: dict[str, bool] = {}

    def supports(self, device: torch.device) -> bool:
        key = str(device)
        if key not in self._ok:
            self._ok[key] = _fp8_capable(torch.device(device))
        return self._ok[key]

    def quantize(self, x: torch.Tensor, block: Block, pow2_scale: bool) -> QuantizedTensor:
        if x.dim() == 2 and x.numel() > 0 and x.is_floating_point():
            if block == (1, 128):
                return quant.quantize_1x128(x, pow2_scale)
            if block == (128, 128):
                return quant.quantize_128x128(x, pow2_scale)[0]
            if block == (128, 1):
                return quant.quantize_128x1(x, pow2_scale)
        return quantize_fp8(x, block, pow2_scale=pow2_scale, nonfinite="propagate")

    def requantize(self, qt: QuantizedTensor, block: Block, pow2_scale: bool) -> QuantizedTensor:
        if qt.block == (1, 128) and block == (128, 1):
            return quant.requantize_1x128_to_128x1(qt, transposed=False, pow2_scale=pow2_scale)
        return requantize_fp8(qt, block, pow2_scale=pow2_scale)

    def quantize_transposed(self, x: torch.Tensor, block: Block, pow2_scale: bool) -> QuantizedTensor:
        """quantize(x, block).t() with the transposed layout written directly."""
        if x.dim() == 2 and x.numel() > 0 and x.is_floating_point():
            if block == (128, 1):
                return quant.quantize_128x1_t(x, pow2_scale)
            if block == (128, 128):
                return quant.quantize_128x128(x, pow2_scale, write=False, write_t=True)[1]
        return self.quantize(x, block, pow2_scale).t()

    def requantize_transposed(self, qt: QuantizedTensor, block: Block, pow2_scale: bool) -> QuantizedTensor:
        if qt.block == (1, 128) and block == (128, 1):
            return quant.requantize_1x128_to_128x1(qt, transposed=True, pow2_scale=pow2_scale)
        return self.requantize(qt, block, pow2_scale).t()
