"""Scale/operand layouts the vendor GEMMs want, built from a QuantizedTensor (pure torch, no Triton).

All copies here are small (scales) or happen only for shapes that are not multiples of 128;
`padding_events` counts the latter so a benchmark can report them instead of hiding them.
"""

from __future__ import annotations

import logging

import torch

from ..formats import QuantizedTensor

__all__ = ["mn_major", "row_major_padded_t", "pad_operands", "pad_columns", "padding_events", "column_blocks_of_one"]

logger = logging.getLogger(__name__)
padding_events: dict[str, int] = {}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def column_blocks_of_one(parts: list[torch.Tensor]) -> bool:
    """Whether 2-D `parts` of one row count are consecutive column blocks of one row-major [M, sum(N_i)] buffer
    (the halves a stacked gate/up GEMM writes, say): then that buffer is readable as one tensor without a copy."""
    total = 0
    for p in parts:  # a plain loop: this runs per backward of every stacked layer group
        total += p.shape[1]
    first = parts[0]
    start, ptr, off = first.storage_offset(), first.untyped_storage().data_ptr(), 0
    for p in parts:
        if (p.shape[0] != first.shape[0] or p.stride() != (total, 1) or p.storage_offset() != start + off
                or p.untyped_storage().data_ptr() != ptr):
            return False
        off += p.shape[1]
    return True


def mn_major(scale: torch.Tensor) -> torch.Tensor:
    """Same values as `scale` (R, G), with strides (1, R) (copies only if it is not already so)."""
    r, g = scale.shape
    if scale.stride(0) == 1 and (scale.stride(1) == r or g == 1):
        return scale
    return scale.t().contiguous().t()


def row_major_padded_t(scale: torch.Tensor) -> torch.Tensor:
    """A 128x128 scale (NB, KB) -> the (round_up(KB, 4), NB) view with strides (1, round_up(KB, 4)).

    This is cuBLASLt's scale_b for `mat_b = W.t()`. The Triton weight quantizer already allocates the
    padded row-major buffer, so normally this is a view; otherwise a padded copy (pad = 1.0) is made.
    """
    nb, kb = scale.shape
    kbp = _round_up(kb, 4)
    if scale.stride(1) == 1 and (scale.stride(0) == kbp or nb == 1):
        need = (scale.storage_offset() + (nb - 1) * kbp + kbp) * scale.element_size()
        if scale.untyped_storage().nbytes() >= need:
            return torch.as_strided(scale, (kbp, nb), (1, kbp))
    buf = torch.ones((nb, kbp), dtype=torch.float32, device=scale.device)
    buf[:, :kb] = scale
    return buf.t()


def _pad_data(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros((rows, cols), dtype=data.dtype, device=data.device)
    out[: data.shape[0], : data.shape[1]] = data
    return out


def pad_columns(qt: QuantizedTensor, multiple: int) -> QuantizedTensor:
    """A 1x128-grouped tensor with its columns (K) zero-padded to a multiple of `multiple` (a multiple of 128, so
    the scale's ceil(K/128) groups do not change): the operand `pad_operands` would build, for implementations
    whose kernels cannot write it padded themselves."""
    rows, cols = qt.shape
    kp = _round_up(cols, multiple) if multiple > 1 else cols
    if kp == cols:
        return qt
    if qt.block != (1, 128) or multiple % 128:
        raise ValueError(f"pad_columns pads 1x128-grouped data to a multiple of 128; got block {qt.block}, multiple {multiple}")
    return QuantizedTensor.trusted(_pad_data(qt.data, rows, kp), qt.scale, qt.block)


def pad_operands(
    a: QuantizedTensor, b: QuantizedTensor, k_mult: int = 128, n_mult: int = 128, m_mult: int = 1, who: str = "gemm"
):
    """Zero-pad A [M, K] and B [N, K] so M, K and N are multiples of m_mult / k_mult / n_mult.

    Returns (a_data, a_scale, b_data, b_scale, m, n) with contiguous data; the caller slices the
    output to [:m, :n]. Zero data contributes nothing, so padded groups' scales only need to be finite.
    """
    m, k = a.shape
    n = b.shape[0]
    mp, kp, np_ = _round_up(m, m_mult), _round_up(k, k_mult), _round_up(n, n_mult)
    a_data, b_data = a.data, b.data
    a_scale, b_scale = a.scale, b.scale
    if mp != m:
        key = f"{who}: M={m}->{mp}"
        if key not in padding_events:
            logger.info("jetrl_precision %s pads A rows (M not a multiple of %d): %s", who, m_mult, key)
        padding_events[key] = padding_events.get(key, 0) + 1
        a_data = _pad_data(a_data, mp, a_data.shape[1])
        buf = torch.ones((a_scale.shape[1], mp), dtype=a_scale.dtype, device=a_scale.device)
        buf[:, :m] = a_scale.t()
        a_scale = buf.t()
    if kp != k or np_ != n:
        key = f"{who}: K={k}->{kp}, N={n}->{np_}"
        if key not in padding_events:
            logger.info("jetrl_precision %s pads operands (shape not a multiple of the tile): %s", who, key)
        padding_events[key] = padding_events.get(key, 0) + 1
        a_data = _pad_data(a_data, a_data.shape[0], kp) if kp != k else a_data
        b_data = _pad_data(b_data, np_, kp)
        if np_ != n and b.block == (1, 128):
            pad = torch.ones((np_ - n, b_scale.shape[1]), dtype=b_scale.dtype, device=b_scale.device)
            b_scale = torch.cat([b_scale, pad], dim=0)
        # 128x128 B and 1x128 A keep ceil(./128) groups: their scale shapes do not change.
    if not a_data.is_contiguous():
        a_data = a_data.contiguous()
    if not b_data.is_contiguous():
        b_data = b_data.contiguous()
    return a_data, a_scale, b_data, b_scale, m, n
