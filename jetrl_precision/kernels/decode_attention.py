"""Decode attention over a paged KV cache in e4m3 (or the query's dtype), the query kept in its dtype: split-KV.

The recipe's e4m3 KV cache (`jetrl_precision.kv_cache`) halves the bytes a decode step's attention reads, which at
hundreds of sequences of a long context is most of the step. The attention must read those keys and values as the
trainer's mirror does: dequantized exactly to the query's dtype (BF16 or FP16: every e4m3 value is one of either),
with the query and the probabilities never rounded to FP8. FlashAttention-3 would round both (a function the trainer does not compute), and vLLM's
Triton kernel runs one program per sequence and KV head over the whole context, which at large decode batches leaves
the halved bytes well below the card's bandwidth. This kernel does:

- one program per (sequence, KV head, split of the context): the GQA group's query heads share every K/V tile (the
  tile's rows are the group's heads, padded to the 16 rows `tl.dot` needs), and the context is cut into `splits`
  slices so that small batches still fill the card;
- each program runs the online softmax in fp32 over its slice in tiles of `BLOCK_N` keys (K/V converted to the
  query's dtype on load, the probabilities rounded to it for p @ v, as FlashAttention does) and leaves (acc, max, sum);
- a second kernel combines the slices (the log-sum-exp merge); with one slice the first kernel writes the output.

Only the numerics of ordinary attention are kept (fp32 accumulation, 16-bit operands), not a fixed order: this is the
jet_fp8 engine's fast path, whose mismatch against the trainer is measured, not the bitwise mode's kernel
(`invariant_attention`). Nothing here reads a device value on the host, so a CUDA graph captures it; the grid depends
only on the number of sequences.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from ..formats import FP8_DTYPE

__all__ = ["BLOCK_N", "MAX_GROUP", "decode_splits", "decode_attention", "launch_decode_attention"]

# keys per tile (16 KiB of e4m3 per K or V tile at head_dim 128): the fastest tile of benchmarks/kv_decode_gpu.py's
# sweep at 64 and 256 sequences; smaller tiles leave too few bytes in flight per program
BLOCK_N = 128
_BLOCK_H = 16  # query rows per tile (tl.dot needs >= 16): a GQA group of up to 16 heads
MAX_GROUP = _BLOCK_H  # query heads per KV head the kernel serves
_MAX_SPLITS = 16
_LOG2E = math.log2(math.e)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    if INTERPRET:  # the CPU interpreter's tl.dot goes through numpy with bf16 operands; fp32 products are exact here
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, acc_ptr, ml_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
    sq_t, sq_h, sk_0, sk_1, sk_h, sv_0, sv_1, sv_h, so_t, so_h, sbt,
    qk_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, SPLITS: tl.constexpr, INTERPRET: tl.constexpr,
):
    DT = q_ptr.dtype.element_ty  # the query's dtype: keys, values and p are read in it
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - row
    if q_len == 1:  # decode rows only; CUDA-graph padding (no query) and longer queries are left alone
        n_keys = tl.load(seq_lens_ptr + seq)
        per = tl.cdiv(tl.cdiv(n_keys, SPLITS), BLOCK_N) * BLOCK_N  # whole tiles per slice
        start = split * per
        end = tl.minimum(n_keys, start + per)
        h = tl.arange(0, BLOCK_H)
        h_ok = h < GROUP
        head = kv_head * GROUP + h
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        row64 = row.to(tl.int64)
        q = tl.load(q_ptr + row64 * sq_t + head[:, None] * sq_h + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        k_base = k_ptr + kv_head * sk_h
        v_base = v_ptr + kv_head * sv_h
        for j0 in range(start, end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            j_ok = j < end
            phys = tl.load(bt_ptr + seq.to(tl.int64) * sbt + j // PAGE, mask=j_ok, other=0).to(tl.int64)
            kt = tl.load(k_base + (phys * sk_0 + (j % PAGE) * sk_1)[None, :] + d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
            s = _dot(q, kt.to(DT), INTERPRET) * qk_scale
            s = tl.where(j_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + (phys * sv_0 + (j % PAGE) * sv_1)[:, None] + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(DT), v.to(DT), INTERPRET)
            m_i = m_new
        if SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(o_ptr + row64 * so_t + head[:, None] * so_h + d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=h_ok[:, None] & d_ok[None, :])
        else:  # partials [T, H, SPLITS, D] and [T, H, SPLITS, 2] (max, sum), fp32
            part = (row64 * (GROUP * tl.num_programs(1)) + head) * SPLITS + split
            tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])
            tl.store(ml_ptr + part * 2, m_i, mask=h_ok)
            tl.store(ml_ptr + part * 2 + 1, l_i, mask=h_ok)


@triton.jit
def _combine_kernel(
    o_ptr, acc_ptr, ml_ptr, qsl_ptr, so_t, so_h,
    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - row == 1:
        s = tl.arange(0, BLOCK_S)
        s_ok = s < SPLITS
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        part = (row.to(tl.int64) * H + head) * SPLITS + s
        m = tl.load(ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
        l = tl.load(ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.math.exp2(m - m_max), 0.0)  # an empty slice weighs nothing
        total = tl.sum(l * w, axis=0)
        acc = tl.load(acc_ptr + part[:, None] * D + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(o_ptr + row.to(tl.int64) * so_t + head * so_h + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def decode_splits(num_seqs: int, num_kv_heads: int, sm_count: int) -> int:
    """How many slices each sequence's context is cut into: enough programs for about four per SM, at most 16.
    A function of the batch's shape only, so a CUDA graph captured for it stays valid."""
    programs = max(1, num_seqs * num_kv_heads)
    return max(1, min(_MAX_SPLITS, triton.cdiv(4 * sm_count, programs)))


@functools.cache
def _sm_count(device: torch.device) -> int:  # cached: it runs on every layer's decode step
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
    block_table: torch.Tensor, softmax_scale: float | None = None, out: torch.Tensor | None = None,
    splits: int | None = None, block_n: int = BLOCK_N, num_warps: int = 4, num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one new token against its paged context: q [T, H, D] (BF16 or FP16; sequence s's
    query is row cu_seqlens_q[s] when cu_seqlens_q[s + 1] - cu_seqlens_q[s] == 1, other sequences are skipped);
    k_cache / v_cache [num_blocks, page, Hkv, D] in e4m3 or the query's dtype, any strides with a contiguous last
    dim; seq_lens [S] keys per sequence (the new token's included); block_table [S, max_blocks] int. Writes `out`
    ([T, H, D], the query's dtype; made if None) in place and returns it. `splits`: slices per context (default
    `decode_splits`); `block_n` (keys per tile), `num_warps` and `num_stages` (Triton's default when None) are the
    launch's, for tuning runs."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention: q [T, H, D] and k/v caches [blocks, page, Hkv, D] needed, got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    t, heads, dim = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != dim or heads % hkv or heads // hkv > _BLOCK_H:
        raise ValueError(f"decode_attention: head_dim {dim} vs {k_cache.shape[3]}, or {heads} query heads for {hkv} KV "
                         f"heads (a multiple, at most {_BLOCK_H} per KV head)")
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype not in (q.dtype, FP8_DTYPE):
        raise TypeError(f"decode_attention: a bf16/fp16 query and caches in e4m3 or its dtype needed, got {q.dtype}, {k_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode_attention: q and the caches need a contiguous last dim")
    n_seq = seq_lens.numel()
    if block_table.dim() != 2 or block_table.shape[0] != n_seq or cu_seqlens_q.numel() != n_seq + 1:
        raise ValueError(f"decode_attention: cu_seqlens_q [S + 1], seq_lens [S] and block_table [S, blocks] needed, got "
                         f"{tuple(cu_seqlens_q.shape)}, {tuple(seq_lens.shape)}, {tuple(block_table.shape)}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"decode_attention out: {tuple(q.shape)} with a contiguous last dim needed, got {tuple(out.shape)}")
    if splits is not None and not 1 <= splits <= _MAX_SPLITS:
        raise ValueError(f"decode_attention: splits must be in 1..{_MAX_SPLITS}, got {splits}")
    return launch_decode_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, softmax_scale, out, splits=splits,
                                   block_n=block_n, num_warps=num_warps, num_stages=num_stages)


def launch_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
    block_table: torch.Tensor, softmax_scale: float | None, out: torch.Tensor, splits: int | None = None,
    block_n: int = BLOCK_N, num_warps: int = 4, num_stages: int | None = None,
) -> torch.Tensor:
    """`decode_attention` without its argument checks, for a caller whose shapes are fixed once checked (an engine
    layer, every decode step: `integrations.vllm_kv_attention`)."""
    t, heads, dim = q.shape
    hkv, n_seq = k_cache.shape[2], seq_lens.numel()
    if n_seq == 0:
        return out
    splits = splits or decode_splits(n_seq, hkv, _sm_count(q.device))
    scale = (dim**-0.5 if softmax_scale is None else float(softmax_scale)) * _LOG2E
    block_d = max(16, triton.next_power_of_2(dim))
    if splits > 1:
        acc = torch.empty((t, heads, splits, dim), dtype=torch.float32, device=q.device)
        ml = torch.empty((t, heads, splits, 2), dtype=torch.float32, device=q.device)
    else:
        acc = ml = out  # unused
    _split_kernel[(n_seq, hkv, splits)](
        q, k_cache, v_cache, out, acc, ml, cu_seqlens_q, seq_lens, block_table,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_table.stride(0),
        scale,
        GROUP=heads // hkv, D=dim, BLOCK_D=block_d, BLOCK_H=_BLOCK_H, BLOCK_N=block_n, PAGE=k_cache.shape[1],
        SPLITS=splits, INTERPRET=_INTERPRET, num_warps=num_warps, **({"num_stages": num_stages} if num_stages else {}),
    )
    if splits > 1:
        _combine_kernel[(n_seq, heads)](
            out, acc, ml, cu_seqlens_q, out.stride(0), out.stride(1),
            H=heads, D=dim, BLOCK_D=block_d, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
        )
    return out
