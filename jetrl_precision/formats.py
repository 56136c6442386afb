"""FP8 formats, quantization granularities and the quantized-tensor container."""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

import torch

__all__ = [
    "FP8_DTYPE",
    "E4M3_MAX",
    "E4M3_MIN_NORMAL",
    "AMAX_FLOOR",
    "Granularity",
    "Block",
    "QuantizedTensor",
    "resolve_block",
]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6  # below this an e4m3 value is subnormal: fewer than 4 significant bits
# Floor on a group's amax so an all-zero group gets a finite, tiny scale (and quantizes to zeros).
AMAX_FLOOR = 1e-10

Block = tuple[int, int]


class Granularity(str, enum.Enum):
    """Which elements share one scale. Block shapes are (rows, cols) of a 2-D [M, K] tensor."""

    BLOCK_1x128 = "1x128"  # one scale per 128 consecutive elements along K (per token-group)
    BLOCK_128x128 = "128x128"  # one scale per 128x128 tile (weights)
    BLOCK_128x1 = "128x1"  # one scale per 128 consecutive rows of one column (groups along tokens)
    ROW = "row"  # one scale per row (comparison only)
    TENSOR = "tensor"  # one scale for the whole tensor (comparison only)

    def block(self, shape: tuple[int, int]) -> Block:
        # Called on every quantization in the hot path: plain branches, no per-call dict.
        if self is Granularity.BLOCK_1x128:
            return (1, 128)
        if self is Granularity.BLOCK_128x128:
            return (128, 128)
        if self is Granularity.BLOCK_128x1:
            return (128, 1)
        rows, cols = shape
        return (1, max(cols, 1)) if self is Granularity.ROW else (max(rows, 1), max(cols, 1))

    @property
    def transposed(self) -> "Granularity":
        return {
            Granularity.BLOCK_1x128: Granularity.BLOCK_128x1,
            Granularity.BLOCK_128x1: Granularity.BLOCK_1x128,
        }.get(self, self)


def resolve_block(block: Block | Granularity | str, shape: tuple[int, int]) -> Block:
    """(b0, b1) for a block given as a pair of positive ints, a Granularity, or its string value."""
    valid = f"(1, 128), (128, 128), (128, 1), any pair of positive ints, or one of {[g.value for g in Granularity]}"
    if isinstance(block, (Granularity, str)):
        try:
            return Granularity(block).block(shape)
        except ValueError:
            raise ValueError(f"block {block!r} is not a granularity: use {valid}") from None
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise TypeError(f"block must be {valid}; got {block!r}")
    try:
        if any(isinstance(b, bool) for b in block):
            raise TypeError
        b0, b1 = (operator.index(b) for b in block)
    except TypeError:
        raise TypeError(f"block sizes must be ints, got {block!r}") from None
    if b0 < 1 or b1 < 1:
        raise ValueError(f"block sizes must be positive, got {tuple(block)}")
    return b0, b1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class QuantizedTensor:
    """An e4m3 tensor plus its fp32 scales.

    `data` has the original (unpadded) 2-D shape. `scale` has the logical shape
    [ceil(M / b0), ceil(K / b1)]; its strides are a private detail (fast kernels write it
    MN-major so GEMMs read it without a copy). The value represented is `data * scale`
    broadcast over each block. Edge blocks of shapes that are not multiples of the block
    are partial: they behave exactly as if the tensor were zero-padded to full blocks.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: Block

    def __post_init__(self) -> None:
        if self.data.dtype != FP8_DTYPE:
            raise TypeError(f"QuantizedTensor data must be {FP8_DTYPE}, got {self.data.dtype}; quantize with quantize_fp8")
        if self.scale.dtype != torch.float32:
            raise TypeError(f"QuantizedTensor scales must be float32, got {self.scale.dtype}")
        if self.data.dim() != 2:
            raise ValueError(f"QuantizedTensor holds 2-D data, got shape {tuple(self.data.shape)}")
        expected = (_ceil_div(self.data.shape[0], self.block[0]), _ceil_div(self.data.shape[1], self.block[1]))
        if tuple(self.scale.shape) != expected:
            raise ValueError(
                f"scale shape {tuple(self.scale.shape)} does not match data {tuple(self.data.shape)} "
                f"with block {self.block}: expected {expected}"
            )

    @classmethod
    def trusted(cls, data: torch.Tensor, scale: torch.Tensor, block: Block) -> "QuantizedTensor":
        """A QuantizedTensor without `__post_init__`'s checks, for producers whose output is right by construction
        (the quantize kernels, autograd's saved tensors): the hot path makes several per training step."""
        qt = object.__new__(cls)
        object.__setattr__(qt, "data", data)
        object.__setattr__(qt, "scale", scale)
        object.__setattr__(qt, "block", block)
        return qt

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def padded(self) -> bool:
        """True when the last block along some dim is partial (the shape is not a multiple of the block)."""
        return self.data.shape[0] % self.block[0] != 0 or self.data.shape[1] % self.block[1] != 0

    def expanded_scale(self) -> torch.Tensor:
        """Scales broadcast to one per element, fp32, data's shape."""
        s = self.scale.float()
        s = s.repeat_interleave(self.block[0], dim=0)[: self.data.shape[0]]
        return s.repeat_interleave(self.block[1], dim=1)[:, : self.data.shape[1]]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not dtype.is_floating_point:
            raise TypeError(f"dequantize returns a floating-point tensor; got dtype {dtype}")
        return (self.data.float() * self.expanded_scale()).to(dtype)

    def t(self) -> "QuantizedTensor":
        """Exact transpose: the blocks transpose with the data (128x128 stays 128x128, 1x128 <-> 128x1)."""
        return QuantizedTensor(self.data.t().contiguous(), self.scale.t().contiguous(), (self.block[1], self.block[0]))

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()
