"""Batch-invariant causal GQA attention: a prefill row equals the KV-cached decode of that token, bit for bit.

The trainer runs each sequence's full causal attention at once (dense varlen: q, k, v [T, H, D] with cu_seqlens);
the engine attends one new token (decode) or a chunk (chunked prefill) against a paged KV cache. Both call
`_attention_kernel`, whose arithmetic for one query row is fixed by the row alone:

- the query at position i visits keys 0..i in ascending blocks of `KEY_BLOCK` keys (a module constant, never a
  function of the launch), with the same online softmax in fp32: s = (q . k) * scale * log2(e), running max m,
  p = exp2(s - m), l = l * alpha + sum(p), acc = acc * alpha + p @ v, out = acc / l (IEEE division);
- masking is the same everywhere: a key is used when j <= i (and j < the sequence's key count); a block with no
  visible key for a row leaves that row's state untouched (`tl.where`), so a prefill tile that runs past row i's
  own last block computes exactly what the decode of row i computes;
- keys and values are addressed either in a dense [T, Hkv, D] tensor (a sequence's keys start at `k_start`) or
  through a block table into a paged cache [num_blocks, page, Hkv, D] (`PAGED`); only the address differs, the
  loaded values and everything after them are the same, and masked keys are never loaded (a paged cache holds
  arbitrary bits past the context);
- the query tile is always `QUERY_TILE` rows (padded with masked rows), the launch shape always `NUM_WARPS`
  warps. `tl.dot` over a tile computes each output element from its own row and column in an order fixed by the
  tile shape and the instruction Triton picks for it, which these constants fix; nothing in a row's result reads
  another row, so its bits do not depend on how many real rows share the tile or where it sits in it (the same
  property vLLM's batch-invariant persistent matmul relies on). A decode row and the same token in a prefill sit
  in different rows of their tiles: `tests/gpu/test_invariant_kernels_gpu.py` checks the equality on the hardware,
  the interpreter tests check it on CPU;
- bf16 inputs multiply on the tensor cores with fp32 accumulation; p is rounded to bf16 for p @ v (as
  FlashAttention does); fp32 inputs use IEEE fp32 dots (no TF32);
- a tile's rows are query positions x query heads of one KV head (`heads_per_tile`: all of a GQA group when it
  fits), so the group's heads share every K/V load; a decode (one position) fills as many rows as the group has
  heads. Which rows share a tile is launch geometry only: by the property above, a row's bits are those it has
  alone (`pack_heads=False`, one head per tile, gives the same bits: the tests compare the two).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ._rounding import cast_rn

__all__ = ["KEY_BLOCK", "QUERY_TILE", "NUM_WARPS", "heads_per_tile", "varlen_attention", "paged_attention", "attention_segments"]

KEY_BLOCK = 32  # keys per block of the online softmax: part of the numerics, the same for every launch
QUERY_TILE = 16  # query rows per program (tl.dot needs >= 16); padded, never shrunk
NUM_WARPS = 4

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_LOG2E = math.log2(math.e)


@triton.jit
def _dot_device(a, b, DTYPE: tl.constexpr):
    if DTYPE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")  # IEEE fp32, not TF32
    else:
        return tl.dot(a, b)  # bf16 operands on the tensor cores, fp32 accumulation


@triton.jit
def _dot_interp(a, b, DTYPE: tl.constexpr):
    # Triton's CPU interpreter runs tl.dot through numpy's BLAS, whose micro-kernels treat edge rows of a tile
    # differently (row 15 of 16 came out an ulp off rows 0..14); a broadcast product summed over K in order gives
    # every output element the same arithmetic, which is what the interpreter tests need to check the rest.
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


_dot = _dot_interp if os.environ.get("TRITON_INTERPRET", "0") == "1" else _dot_device


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    q_start_ptr, q_len_ptr, k_start_ptr, k_len_ptr, bt_ptr,
    sq_t, sq_h, sk_0, sk_1, sk_h, sv_0, sv_1, sv_h, so_t, so_h, sbt,
    qk_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr, DTYPE: tl.constexpr, HEADS: tl.constexpr,
):
    # A tile is BLOCK_M rows: BLOCK_M // HEADS query positions x HEADS query heads of one KV head (row r is position
    # r // HEADS, head r % HEADS), so the group's heads share each K/V block load; rows past the last full
    # position group are padding.
    POSITIONS: tl.constexpr = BLOCK_M // HEADS
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head_group = tl.program_id(2)
    q_len = tl.load(q_len_ptr + seq)
    if tile * POSITIONS < q_len:
        k_len = tl.load(k_len_ptr + seq)
        q_start = tl.load(q_start_ptr + seq).to(tl.int64)
        kv_head = (head_group * HEADS) // GROUP
        r = tl.arange(0, BLOCK_M)
        rows = tile * POSITIONS + r // HEADS  # each row's query index within its sequence
        head = head_group * HEADS + r % HEADS
        row_ok = (r < POSITIONS * HEADS) & (rows < q_len)
        pos = k_len - q_len + rows  # each query's position among its sequence's keys
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(
            q_ptr + (q_start + rows)[:, None].to(tl.int64) * sq_t + head[:, None] * sq_h + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        last = k_len - q_len + tl.minimum(tile * POSITIONS + POSITIONS, q_len) - 1  # the tile's last real query
        if PAGED:
            k_base = k_ptr + kv_head * sk_h
            v_base = v_ptr + kv_head * sv_h
        else:
            k_start = tl.load(k_start_ptr + seq).to(tl.int64)
            k_base = k_ptr + k_start * sk_0 + kv_head * sk_h
            v_base = v_ptr + k_start * sv_0 + kv_head * sv_h
        for b in range(0, last // BLOCK_N + 1):
            j = b * BLOCK_N + tl.arange(0, BLOCK_N)
            j_ok = j < k_len
            if PAGED:
                phys = tl.load(bt_ptr + seq.to(tl.int64) * sbt + j // PAGE, mask=j_ok, other=0).to(tl.int64)
                k_off = phys * sk_0 + (j % PAGE) * sk_1
                v_off = phys * sv_0 + (j % PAGE) * sv_1
            else:
                k_off = j.to(tl.int64) * sk_0
                v_off = j.to(tl.int64) * sv_0
            kt = tl.load(k_base + k_off[None, :] + d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_base + v_off[:, None] + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
            s = _dot(q, kt, DTYPE)
            visible = (j[None, :] <= pos[:, None]) & j_ok[None, :]
            s = tl.where(visible, s * qk_scale, float("-inf"))
            active = b * BLOCK_N <= pos  # the row sees at least one key of this block
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_new = l_i * alpha + tl.sum(p, axis=1)
            pv = _dot(cast_rn(p, DTYPE), v, DTYPE)  # bf16: p rounded to bf16 for the tensor cores, as FlashAttention
            acc_new = acc * alpha[:, None] + pv
            # A row past its own last block keeps its state exactly: a decode of that row stops there.
            acc = tl.where(active[:, None], acc_new, acc)
            l_i = tl.where(active, l_new, l_i)
            m_i = tl.where(active, m_new, m_i)
        out = tl.math.div_rn(acc, l_i[:, None])
        tl.store(
            o_ptr + (q_start + rows)[:, None].to(tl.int64) * so_t + head[:, None] * so_h + d[None, :],
            cast_rn(out, DTYPE), mask=row_ok[:, None] & d_ok[None, :],
        )


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_dims: int, what: str) -> None:
    if q.dim() != 3 or k.dim() != kv_dims or v.shape != k.shape:
        raise ValueError(
            f"{what}: q [T, H, D] and k, v of one shape with {kv_dims} dims needed, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    h, hkv, dq, dk = q.shape[1], k.shape[-2], q.shape[-1], k.shape[-1]
    if dq != dk or hkv == 0 or h % hkv:
        raise ValueError(f"{what}: head_dim {dq} vs {dk} or {h} query heads for {hkv} KV heads (needs a multiple)")
    if q.dtype not in _TL_DTYPE or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{what}: q, k, v of one dtype in bf16/fp32 needed, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{what}: q, k, v on different devices ({q.device}, {k.device}, {v.device})")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def heads_per_tile(group: int) -> int:
    """How many query heads of one KV head share a tile: the largest divisor of the GQA group that fits in it."""
    return max(h for h in range(1, min(group, QUERY_TILE) + 1) if group % h == 0)


def _launch(q, k, v, q_start, q_len, k_start, k_len, block_table, max_q_len, scale, paged, zero_fill=False, out=None,
            pack_heads=True):
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    if out is None:
        out = torch.zeros_like(q) if zero_fill else torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(
            f"attention out: a {tuple(q.shape)} {q.dtype} tensor on {q.device} with a contiguous last dim needed, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}"
        )
    n_seq, heads, dim = q_len.numel(), q.shape[1], q.shape[2]
    if n_seq == 0 or max_q_len <= 0:
        return out
    scale = dim**-0.5 if scale is None else float(scale)
    as_i32 = lambda t: t.to(device=q.device, dtype=torch.int32).contiguous()  # noqa: E731
    q_start, q_len, k_start, k_len = (as_i32(t) for t in (q_start, q_len, k_start, k_len))
    if paged:
        bt = as_i32(block_table)
        sk, sv, sbt, page = (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2)), bt.stride(0), k.shape[1]
    else:
        bt = k_len  # unused
        sk, sv, sbt, page = (k.stride(0), 0, k.stride(1)), (v.stride(0), 0, v.stride(1)), 0, 1
    group = heads // k.shape[-2]
    packed = heads_per_tile(group) if pack_heads else 1
    grid = (triton.cdiv(int(max_q_len), QUERY_TILE // packed), n_seq, heads // packed)
    _attention_kernel[grid](
        q, k, v, out, q_start, q_len, k_start, k_len, bt,
        q.stride(0), q.stride(1), *sk, *sv, out.stride(0), out.stride(1), sbt,
        scale * _LOG2E,
        GROUP=group, D=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=QUERY_TILE,
        BLOCK_N=KEY_BLOCK, PAGE=page, PAGED=paged, DTYPE=_TL_DTYPE[q.dtype], HEADS=packed, num_warps=NUM_WARPS,
    )
    return out


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, softmax_scale: float | None = None, pack_heads: bool = True,
) -> torch.Tensor:
    """Causal attention over packed sequences: q [Tq, H, D], k/v [Tk, Hkv, D], cu_seqlens_* [S + 1] int.

    Sequence s's queries are the last q_len_s of its k_len_s keys (q_len == k_len for a full forward), so its
    query r sits at position k_len_s - q_len_s + r and attends keys 0..that position. Returns [Tq, H, D].
    `pack_heads=False`: one query head per tile (the same bits, more K/V traffic; for comparisons)."""
    _check_qkv(q, k, v, 3, "varlen_attention")
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    if cu_q.dim() != 1 or cu_q.shape != cu_k.shape or cu_q.numel() < 1:
        raise ValueError(f"varlen_attention: cu_seqlens_q {tuple(cu_q.shape)} and cu_seqlens_k {tuple(cu_k.shape)} must be [S + 1]")
    return _launch(q, k, v, cu_q[:-1], cu_q.diff(), cu_k[:-1], cu_k.diff(), None, max_seqlen_q, softmax_scale, False,
                   pack_heads=pack_heads)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
    block_table: torch.Tensor, max_seqlen_q: int, softmax_scale: float | None = None, out: torch.Tensor | None = None,
    pack_heads: bool = True,
) -> torch.Tensor:
    """Causal attention of new tokens against a paged KV cache that already holds them.

    q [Tq, H, D] (sequence s's queries are rows cu_seqlens_q[s]:cu_seqlens_q[s+1], the last tokens of its context);
    k_cache/v_cache [num_blocks, page, Hkv, D]; seq_lens [S] the context length (keys) of each sequence;
    block_table [S, max_blocks] the physical block of each page. Decode is q_len 1; chunked prefill q_len > 1.
    `out` [Tq, H, D] (last dim contiguous) receives the rows in place, for callers whose output buffer is fixed
    (an engine's CUDA graphs); rows outside every sequence are left as they are. Returns `out`. `pack_heads` as in
    `varlen_attention`."""
    _check_qkv(q, k_cache, v_cache, 4, "paged_attention")
    cu_q = cu_seqlens_q.long()
    if block_table.dim() != 2 or seq_lens.dim() != 1 or cu_q.numel() != seq_lens.numel() + 1 or block_table.shape[0] != seq_lens.numel():
        raise ValueError(
            f"paged_attention: cu_seqlens_q [S + 1], seq_lens [S] and block_table [S, blocks] needed, got "
            f"{tuple(cu_q.shape)}, {tuple(seq_lens.shape)}, {tuple(block_table.shape)}"
        )
    return _launch(
        q, k_cache, v_cache, cu_q[:-1], cu_q.diff(), seq_lens, seq_lens, block_table, max_seqlen_q, softmax_scale, True,
        out=out, pack_heads=pack_heads,
    )


def attention_segments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
    k_start: torch.Tensor, k_len: torch.Tensor, max_q_len: int, softmax_scale: float | None = None,
) -> torch.Tensor:
    """The dense form with explicit per-sequence rows: queries q[q_start_s : q_start_s + q_len_s], keys
    k[k_start_s : k_start_s + k_len_s] (a padded batch flattened to [B * T, H, D] has gaps between sequences).
    Rows of q outside every segment (padding) come out as zeros."""
    _check_qkv(q, k, v, 3, "attention_segments")
    return _launch(q, k, v, q_start, q_len, k_start, k_len, None, max_q_len, softmax_scale, False, zero_fill=True)
