"""Weight digests: a checksum of a tensor's bytes that a sharded holder can compute piece by piece.

`digest(t)` is two sums over the bytes b_i of a tensor, each weighted by its position,
w(i) = 1 + (A * i mod (P - 1)), taken modulo the prime P = 2^31 - 1, plus the byte count. Any single
changed byte changes both sums. It guards against corrupted or mis-installed weights, not against an
adversary. Integer arithmetic on the tensor's own device: every device gives the same value for the
same bytes, and nothing is copied to the host (a host-side sha1 of an 8B model's sampled tensors took
about 10 s per check).

Because the weights depend on the global position only, a shard of a 2-D tensor (a tensor-parallel
engine's slice of a projection, a vocab range of an embedding) can be summed on its own rank with its
bytes' positions in the whole tensor (`digest_part`), and the parts combine into the whole tensor's
digest (`combine_digest_parts`): an engine split over several workers answers the same string as one
that holds the tensor whole, so the trainer's side of the check does not change with the engine's
layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["digest", "DigestPart", "digest_part", "combine_digest_parts", "DigestPartsError", "shape_2d"]

_DIGEST_P = (1 << 31) - 1  # a Mersenne prime: byte changes (|delta| <= 255) never vanish modulo it
_DIGEST_A = (1_103_515_245, 1_664_525_891)  # two position multipliers: two independent 31-bit sums
_DIGEST_CHUNK = 1 << 22  # bytes per pass: 255 * (P - 1) * chunk < 2^63, so int64 sums never overflow
_digest_base: dict[str, torch.Tensor] = {}


class DigestPartsError(ValueError):
    """Parts that do not make up one tensor: different totals, overlaps or gaps, or replicas that differ."""


def _digest_weights(device: torch.device) -> torch.Tensor:
    """(A_k * j) mod (P - 1) for j < chunk, per multiplier: bytes at global offset s add A_k * s mod (P - 1)."""
    key = str(device)
    if key not in _digest_base:
        j = torch.arange(_DIGEST_CHUNK, dtype=torch.int64, device=device)
        _digest_base[key] = torch.stack([(j * a) % (_DIGEST_P - 1) for a in _DIGEST_A])
    return _digest_base[key]


def _row_sums(rows: torch.Tensor, starts: torch.Tensor) -> tuple[int, int]:
    """The two position-weighted sums of `rows` ([R, L] uint8), row r's bytes sitting at global byte offsets
    starts[r], starts[r] + 1, ... Rows longer than a chunk are cut into segments; rows go in blocks of at most
    a chunk of bytes, which keeps the int64 sums from overflowing."""
    p, m = _DIGEST_P, _DIGEST_P - 1
    device = rows.device
    sums = torch.zeros(2, dtype=torch.int64, device=device)
    n_rows, length = rows.shape
    if n_rows == 0 or length == 0:
        return 0, 0
    base = _digest_weights(device)
    seg = min(length, _DIGEST_CHUNK)
    per_block = max(1, _DIGEST_CHUNK // seg)
    starts = starts.to(device=device, dtype=torch.int64)
    for c0 in range(0, length, seg):
        width = min(seg, length - c0)
        for r0 in range(0, n_rows, per_block):
            b = rows[r0 : r0 + per_block, c0 : c0 + width].to(torch.int64)
            # (A * s) mod m with s < 2^63: reduce s first, so the product stays below 2^62
            offset = (starts[r0 : r0 + per_block] + c0) % m
            for k, a in enumerate(_DIGEST_A):
                w = base[k, :width].unsqueeze(0) + ((offset * a) % m).unsqueeze(1)  # < 2m: one subtraction reduces it
                w = torch.where(w >= m, w - m, w) + 1
                sums[k] = (sums[k] + (b * w).sum() % p) % p
    h1, h2 = sums.tolist()
    return int(h1), int(h2)


def _format(h1: int, h2: int, nbytes: int) -> str:
    return f"{h1:08x}{h2:08x}-{nbytes}"  # "-": ":" separates the data and scale digests of an FP8 tensor


def digest(t: torch.Tensor) -> str:
    """The checksum of a tensor's raw bytes (module docstring), computed where the tensor lives."""
    t = t.detach().contiguous()
    raw = (t if t.element_size() == 1 else t.reshape(-1)).view(torch.uint8).reshape(1, -1)
    h1, h2 = _row_sums(raw, torch.zeros(1, dtype=torch.int64))
    return _format(h1, h2, raw.numel())


@dataclass(frozen=True)
class DigestPart:
    """The sums of one rectangular piece of a tensor. Shapes and offsets are in elements of a 2-D view of the
    whole tensor (1-D tensors are columns: [n, 1]); `element_size` is in bytes."""

    full: tuple[int, int]
    offset: tuple[int, int]
    shape: tuple[int, int]
    element_size: int
    sums: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.element_size

    def overlaps(self, other: "DigestPart") -> bool:
        return all(
            self.offset[d] < other.offset[d] + other.shape[d] and other.offset[d] < self.offset[d] + self.shape[d] for d in (0, 1)
        )


def shape_2d(t: torch.Tensor) -> tuple[int, int]:
    """The 2-D view digests use: [n, 1] for 1-D (and 0-D) tensors, the leading dim by the rest otherwise."""
    if t.dim() < 2:
        return (t.numel(), 1)
    return (t.shape[0], math.prod(t.shape[1:]))


def digest_part(t: torch.Tensor, full: Sequence[int] | None = None, offset: Sequence[int] = (0, 0)) -> DigestPart:
    """The sums of `t`, a piece of a larger tensor whose 2-D shape is `full` (default: t's own), at `offset`.

    `combine_digest_parts` of the pieces that tile a tensor equals `digest` of the whole."""
    rows, cols = shape_2d(t)
    piece = t.detach().reshape(rows, cols)
    full = tuple(int(x) for x in (full if full is not None else piece.shape))
    offset = tuple(int(x) for x in offset)
    if len(full) != 2 or len(offset) != 2 or offset[0] + rows > full[0] or offset[1] + cols > full[1] or min(offset) < 0:
        raise DigestPartsError(f"digest_part: a [{rows}, {cols}] piece at {offset} does not fit in a tensor of {full}")
    e = piece.element_size()
    if piece.stride(-1) != 1 or (rows > 1 and piece.stride(0) != cols):
        piece = piece.contiguous()
    raw = piece.view(torch.uint8).reshape(rows, cols * e)
    if cols == full[1]:  # (then offset[1] == 0)
        # whole rows: one run of bytes, summed as one row (the same passes as `digest`)
        sums = _row_sums(raw.reshape(1, -1), torch.tensor([offset[0] * full[1] * e]))
    else:
        starts = (torch.arange(rows, dtype=torch.int64) + offset[0]) * full[1] * e + offset[1] * e
        sums = _row_sums(raw, starts)
    return DigestPart(full, offset, (rows, cols), e, sums)


def combine_digest_parts(parts: Sequence[DigestPart]) -> str:
    """The digest of the tensor that `parts` tile. Parts with the same window (replicas, e.g. a norm every
    tensor-parallel rank holds) count once and must agree; the rest must cover the tensor exactly once.
    Raises DigestPartsError otherwise, naming what is wrong."""
    if not parts:
        raise DigestPartsError("no parts to combine")
    fulls = {(p.full, p.element_size) for p in parts}
    if len(fulls) > 1:
        raise DigestPartsError(f"parts of different tensors: {sorted(fulls)}")
    distinct: dict[tuple, DigestPart] = {}
    for p in parts:
        key = (p.offset, p.shape)
        seen = distinct.setdefault(key, p)
        if seen.sums != p.sums:
            raise DigestPartsError(f"replicas of the window at {p.offset} of shape {p.shape} hold different bytes")
    pieces = list(distinct.values())
    for i, a in enumerate(pieces):
        for b in pieces[i + 1 :]:
            if a.overlaps(b):
                raise DigestPartsError(f"windows at {a.offset} {a.shape} and {b.offset} {b.shape} overlap")
    (full, e), = fulls
    total = full[0] * full[1] * e
    covered = sum(p.nbytes for p in pieces)
    if covered != total:
        raise DigestPartsError(f"the parts cover {covered} of the tensor's {total} bytes")
    h1 = sum(p.sums[0] for p in pieces) % _DIGEST_P
    h2 = sum(p.sums[1] for p in pieces) % _DIGEST_P
    return _format(h1, h2, total)
