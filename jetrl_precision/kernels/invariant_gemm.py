"""Batch-invariant GEMMs for decode-sized M: out[M, N] = A[M, K] @ B[N, K]^T, row m's bits independent of M.

Two kernels share one configuration:
- `fp8_gemm_nt_invariant`: A e4m3 1x128-scaled (scale (M, ceil(K/128))), B e4m3 128x128- or 1x128-scaled;
- `bf16_gemm_nt_invariant`: bf16/fp16 A and B, unscaled (lm_head and other high-precision linears).

A configuration (`InvariantConfig`) is two parts with different rules:
- the numerics (`InvariantNumerics`: block_k, split_k) fix each output element's K order, so they set the bits.
  They are a function of (K, dtype) only (`invariant_numerics`): not of M (batch invariance) and not of N, so a
  fused projection (qkv with N = q + k + v rows, gate_up) gives each row the bits of the separate q, k, v, gate
  and up GEMMs the trainer runs;
- the tile (`InvariantTile`: block_n, block_m, warps, stages) only decides how the outputs are cut into programs,
  so it is chosen from (N, K, dtype) and the M bucket (`invariant_tile`, buckets in `M_BUCKETS`).

Why the tile does not change a row's bits:
- each output element is one fixed sequence over K: per 128-wide K group one `tl.dot` from zero, then
  acc = fma(dot, sa[m] * sb, acc) in fp32, groups in increasing order (FP8); `tl.dot(b, a, acc)` over fixed
  BLOCK_K steps (BF16). Split-K ranges follow from K and split_k alone and their fp32 partials are summed by
  `_sum_splits_kernel` in split order (not torch.sum, whose reduction strategy depends on the shape);
- the MMA instruction follows the tile (wgmma m64n{BLOCK_M}k32 on sm90: test_invariant_gemm_sm90_compile.py),
  and its result for one output element depends neither on the instruction's N nor on the element's place in
  the tile: on an H200 every tile of `candidate_tiles` gave identical bits under one numerics for the Llama-3.1-8B and
  SmolLM2-135M projections and lm_heads (FP8 and BF16; docs/benchmarks.md has the record), and
  tests/gpu/test_invariant_gemm_gpu.py re-checks it on every GPU run;
- neither M nor any stride that follows M (an MN-major scale's, the split workspace's) is specialized on
  (`do_not_specialize`): within one bucket M = 1 and M = 16 run the same compiled code, and across buckets only
  the tile's constexprs change.

Why it is fast at decode sizes (swap-AB): the weight rows N sit on the MMA's wide side (64 per warpgroup) and
the batch on the narrow side, so a program streams a BLOCK_N x K slab of the weight once. Programs of one
weight slab for different M tiles are launched next to each other (M is grid axis 0), so beyond one M tile
they read the slab from L2, not HBM. The M tile grows with the bucket, so large batches keep the tensor cores
busy. The price of invariance at training sizes: the split-K chosen for K stays (an fp32 workspace of
split x M x N).

Edges: rows past M or N are clamped onto valid memory (wrapped indices) and masked on store; a partial last K
group is masked to zero. No padding copies.
"""

from __future__ import annotations

import bisect
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..gemm.vendor_route import routed_linear
from .launch import TritonLauncher

__all__ = [
    "InvariantNumerics",
    "InvariantTile",
    "InvariantConfig",
    "M_BUCKETS",
    "m_bucket",
    "invariant_numerics",
    "invariant_tile",
    "invariant_config",
    "candidate_numerics",
    "candidate_tiles",
    "candidate_configs",
    "TUNED_NUMERICS",
    "TUNED_TILES",
    "fp8_gemm_nt_invariant",
    "bf16_gemm_nt_invariant",
    "linear_invariant",
]

_FP8_GROUP = 128  # the scale group along K: one tl.dot per group in the FP8 kernel
# Lower bounds of the M buckets a tile is chosen for: 1-16, 17-32, 33-64, 65-128, 129-256, 257-512, 513-2048 and
# 2049 or more (decode batches below 513; the trainer's micro-batches, thousands of tokens, in the last two).
M_BUCKETS = (1, 17, 33, 65, 129, 257, 513, 2049)
# The default split-K aims for this many K elements per split (a power of two of splits, at most 8): enough K
# steps per split to amortize the fp32 partials' write and the second launch.
_K_PER_SPLIT = 4096


def _check_pow2(owner: str, name: str, v: int) -> None:
    if v < 16 or v & (v - 1):
        raise ValueError(f"{owner}.{name} must be a power of two >= 16, got {v}")


@dataclass(frozen=True)
class InvariantNumerics:
    """What sets the bits: the BF16 kernel's K step and the number of K ranges. Pick it from (K, dtype) only."""

    block_k: int = 128  # BF16 kernel's K step; the FP8 kernel always steps one 128-wide scale group
    split_k: int = 1  # K ranges summed in fixed order; the effective count is derived from K alone

    def __post_init__(self) -> None:
        _check_pow2("InvariantNumerics", "block_k", self.block_k)
        if self.split_k < 1:
            raise ValueError(f"InvariantNumerics.split_k must be >= 1, got {self.split_k}")


@dataclass(frozen=True)
class InvariantTile:
    """How the outputs are cut into programs; free to follow N and the M bucket (see the module docstring)."""

    block_n: int = 64  # weight rows per program: the MMA's M side (64 per warpgroup)
    block_m: int = 64  # batch rows per program: the MMA's N side
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m"):
            _check_pow2("InvariantTile", name, getattr(self, name))


@dataclass(frozen=True)
class InvariantConfig:
    """One launch's numerics and tile, flat (what the kernels and the benchmark records take)."""

    block_n: int = 64
    block_m: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    block_k: int = 128

    def __post_init__(self) -> None:
        InvariantTile(self.block_n, self.block_m, self.num_warps, self.num_stages)
        InvariantNumerics(self.block_k, self.split_k)

    @classmethod
    def of(cls, numerics: InvariantNumerics, tile: InvariantTile) -> "InvariantConfig":
        return cls(tile.block_n, tile.block_m, numerics.split_k, tile.num_warps, tile.num_stages, numerics.block_k)

    @property
    def numerics(self) -> InvariantNumerics:
        return InvariantNumerics(self.block_k, self.split_k)

    @property
    def tile(self) -> InvariantTile:
        return InvariantTile(self.block_n, self.block_m, self.num_warps, self.num_stages)


def _t(block_n: int, block_m: int, num_warps: int, num_stages: int) -> InvariantTile:
    return InvariantTile(block_n, block_m, num_warps, num_stages)


# Measured tables, taken over the heuristics: benchmarks/decode_gemm_triton.py prints both from one device run.
# Edit them here, not at run time (the lookups cache). A TUNED_NUMERICS entry sets the bits of every GEMM with
# that K and dtype, on the engine and the trainer alike; a TUNED_TILES entry changes only speed.
#
# (K, dtype name) -> numerics: per K and dtype, the (block_k, split_k) whose fastest tiles, summed over the shapes
# with that K (Llama-3.1-8B and SmolLM2-135M projections and lm_heads) and M = 1, 32, 64, 128, 256, 1024, took the
# least time on an H200. Split 1 also needs no fp32 workspace at training-sized M.
TUNED_NUMERICS: dict[tuple[int, str], InvariantNumerics] = {
    (576, "bfloat16"): InvariantNumerics(block_k=64, split_k=1),
    (576, "float8_e4m3fn"): InvariantNumerics(block_k=128, split_k=1),
    (1536, "float8_e4m3fn"): InvariantNumerics(block_k=128, split_k=1),
    (4096, "bfloat16"): InvariantNumerics(block_k=128, split_k=1),
    (4096, "float8_e4m3fn"): InvariantNumerics(block_k=128, split_k=1),
    (14336, "float8_e4m3fn"): InvariantNumerics(block_k=128, split_k=2),
}
# (N, K, dtype name) -> {M bucket's lower bound: tile}; an M uses the entry of the largest bucket <= M (else the
# smallest). The same run: at each M, the fastest tile under the numerics above (a bucket is listed where it changes).
TUNED_TILES: dict[tuple[int, int, str], dict[int, InvariantTile]] = {
    (49152, 576, "bfloat16"): {1: _t(128, 16, 8, 4), 17: _t(64, 32, 4, 4), 33: _t(64, 64, 4, 4), 65: _t(64, 128, 8, 3), 257: _t(128, 128, 8, 3)},
    (576, 576, "float8_e4m3fn"): {1: _t(64, 16, 4, 4), 129: _t(64, 32, 4, 4), 257: _t(64, 128, 4, 3)},
    (960, 576, "float8_e4m3fn"): {1: _t(64, 16, 4, 4), 129: _t(64, 32, 4, 4), 257: _t(64, 128, 4, 3)},
    (3072, 576, "float8_e4m3fn"): {1: _t(64, 16, 4, 4), 33: _t(64, 32, 4, 4), 65: _t(64, 64, 4, 4), 129: _t(64, 128, 4, 3)},
    (576, 1536, "float8_e4m3fn"): {1: _t(64, 16, 4, 4), 129: _t(64, 32, 4, 4), 257: _t(64, 128, 4, 3)},
    (128256, 4096, "bfloat16"): {1: _t(128, 16, 8, 4), 17: _t(64, 32, 4, 4), 33: _t(128, 64, 8, 4), 65: _t(128, 128, 8, 3)},
    (4096, 4096, "float8_e4m3fn"): {1: _t(64, 16, 4, 4), 33: _t(64, 32, 4, 4), 65: _t(64, 64, 4, 4), 257: _t(64, 128, 4, 3)},
    (6144, 4096, "float8_e4m3fn"): {1: _t(128, 16, 8, 4), 17: _t(64, 32, 4, 4), 33: _t(64, 64, 4, 4), 65: _t(64, 32, 4, 4), 129: _t(64, 128, 4, 3)},
    (28672, 4096, "float8_e4m3fn"): {1: _t(128, 16, 8, 4), 17: _t(128, 32, 8, 4), 33: _t(64, 32, 4, 4), 65: _t(64, 128, 4, 3)},
    (4096, 14336, "float8_e4m3fn"): {1: _t(128, 16, 8, 4), 17: _t(64, 16, 4, 4), 33: _t(64, 64, 4, 4), 65: _t(64, 128, 4, 3)},
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _pow2_ceil(x: int) -> int:
    return 1 << (max(x, 1) - 1).bit_length()


def m_bucket(m: int) -> int:
    """The lower bound of M's bucket in `M_BUCKETS` (M = 0 counts as 1)."""
    return M_BUCKETS[max(bisect.bisect_right(M_BUCKETS, m) - 1, 0)]


@functools.lru_cache(maxsize=None)  # a handful of K per model, asked on every call
def invariant_numerics(k: int, dtype: torch.dtype) -> InvariantNumerics:
    """The numerics for a weight with K columns of `dtype` (e4m3, bf16 or fp16). Neither N nor M is an argument:
    every GEMM with this K, fused or not, batch of 1 or of 16384, sums each output in the same order.

    By default one split per `_K_PER_SPLIT` elements of K, rounded up to a power of two, at most 8."""
    tuned = TUNED_NUMERICS.get((k, _dtype_name(dtype)))
    if tuned is not None:
        return tuned
    block_k = _FP8_GROUP if dtype == torch.float8_e4m3fn else 64
    return InvariantNumerics(block_k=block_k, split_k=min(_pow2_ceil(-(-k // _K_PER_SPLIT)), 8))


@functools.lru_cache(maxsize=None)
def _tile_for_bucket(n: int, k: int, dtype: torch.dtype, bucket: int) -> InvariantTile:
    table = TUNED_TILES.get((n, k, _dtype_name(dtype)))
    if table:
        keys = sorted(table)
        return table[keys[max(bisect.bisect_right(keys, bucket) - 1, 0)]]
    # The M tile covers the bucket up to 128 rows (a narrow MMA wastes no work on absent rows at decode sizes,
    # a wide one re-reads the weight slab fewer times at large M); 128-row weight slabs with 8 warps only for
    # the smallest M tiles of a tall weight, which still gives two waves of programs.
    block_m = min(max(_pow2_ceil(bucket), 16), 128)
    if block_m == 16 and n >= 128 * 264:
        return InvariantTile(128, 16, 8, 4)
    return InvariantTile(64, block_m, 4, 3 if block_m == 128 else 4)


def invariant_tile(n: int, k: int, dtype: torch.dtype, m: int) -> InvariantTile:
    """The tile for a weight [N, K] of `dtype` and a batch of M rows: `TUNED_TILES`, else a heuristic. Only
    M's bucket (`m_bucket`) matters."""
    return _tile_for_bucket(n, k, dtype, m_bucket(m))


def invariant_config(n: int, k: int, dtype: torch.dtype, m: int = 1) -> InvariantConfig:
    """What `fp8_gemm_nt_invariant` / `bf16_gemm_nt_invariant` run by default for A [M, K] and B [N, K]: the
    numerics of (K, dtype) and the tile of (N, K, dtype, M's bucket)."""
    return InvariantConfig.of(invariant_numerics(k, dtype), invariant_tile(n, k, dtype, m))


def candidate_numerics(k: int, dtype: torch.dtype) -> list[InvariantNumerics]:
    """Numerics worth timing for K (benchmarks/decode_gemm_triton.py): splits 1, 2, 4, 8, at K steps of 64 and
    128 for BF16/FP16 (FP8 always steps one scale group), one per distinct (K step, effective split), the
    current choice first."""
    base = invariant_numerics(k, dtype)
    block_ks = (base.block_k,) if dtype == torch.float8_e4m3fn else tuple(dict.fromkeys((base.block_k, 64, 128)))
    out, seen = [], set()
    for cand in [base, *(InvariantNumerics(bk, split) for bk in block_ks for split in (1, 2, 4, 8))]:
        step = _step(cand, dtype)
        key = (step, _splits(-(-k // step), cand.split_k))
        if key not in seen:
            seen.add(key)
            out.append(cand)
    return out


def candidate_tiles(n: int, k: int, dtype: torch.dtype) -> list[InvariantTile]:
    """Tiles worth timing for a weight [N, K] at any M (the benchmark picks one per M bucket)."""
    tiles = [(64, 16, 4), (64, 32, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8),
             (128, 16, 8), (128, 32, 8), (128, 64, 8), (128, 128, 8),
             (128, 256, 8)]  # (block_n, block_m, warps); the last for training-sized M
    return [InvariantTile(bn, bm, warps, 3 if bm >= 128 else 4) for bn, bm, warps in tiles]


def candidate_configs(n: int, k: int, dtype: torch.dtype) -> list[InvariantConfig]:
    """Every candidate numerics with every candidate tile, the current numerics first."""
    return [InvariantConfig.of(nu, t) for nu in candidate_numerics(k, dtype) for t in candidate_tiles(n, k, dtype)]


def _step(numerics: InvariantNumerics, dtype: torch.dtype) -> int:
    """K elements per K step: the FP8 kernel always steps one scale group."""
    return _FP8_GROUP if dtype == torch.float8_e4m3fn else numerics.block_k


# ---- kernels ----------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M", "s_sag", "s_ws"])
def _fp8_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr,
    M, N, K, GROUPS_PER_SPLIT,
    s_am, s_ak, s_sam, s_sag, s_bn, s_bk, s_sbn, s_sbg, s_ws, s_cm, s_cn,
    B_BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NUM_STAGES: tl.constexpr, EMULATE_MMA: tl.constexpr,
):
    pid_m = tl.program_id(0)  # fastest axis: the M tiles of one weight slab run together and share it in L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    # Wrapped indices keep every load in bounds and unmasked along M and N; the store masks them.
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rk = tl.arange(0, 128)
    g0 = pid_k * GROUPS_PER_SPLIT
    g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, (K + 127) // 128)
    b_ptrs = b_ptr + rn[:, None].to(tl.int64) * s_bn + (g0 * 128 + rk)[None, :] * s_bk
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * s_am + (g0 * 128 + rk)[None, :] * s_ak
    sa_ptrs = sa_ptr + rm * s_sam
    if B_BLOCK_N == 128:
        sb_ptrs = sb_ptr + ((pid_n * BLOCK_N) // 128) * s_sbn  # BLOCK_N divides 128: one scale per slab and group
    else:
        sb_ptrs = sb_ptr + rn * s_sbn
    # tl.full, not tl.zeros: the latter is a library @jit function, which Triton's interpreter can only run when
    # triton itself was imported under TRITON_INTERPRET=1 (the CPU tests import it both ways).
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    for g in tl.range(g0, g1, num_stages=NUM_STAGES):
        if EVEN_K:
            b = tl.load(b_ptrs)
            a = tl.load(a_ptrs)
        else:
            k_ok = g * 128 + rk < K
            b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        sa = tl.load(sa_ptrs + g * s_sag)
        sb = tl.load(sb_ptrs + g * s_sbg)
        if B_BLOCK_N == 128:
            s = tl.broadcast_to(sb * sa[None, :], (BLOCK_N, BLOCK_M))
        else:
            s = sb[:, None] * sa[None, :]
        if EMULATE_MMA:
            # CPU interpreter (see _interpreted): 128 e4m3 products span < 53 bits, so this float64 sum is exact
            # in any order and the group's dot is the exact value rounded once, wherever the row sits.
            d = tl.dot(b.to(tl.float32).to(tl.float64), tl.trans(a.to(tl.float32).to(tl.float64))).to(tl.float32)
        else:
            d = tl.dot(b, tl.trans(a))
        # An explicit FMA, so no compiler contraction choice can differ between builds of the kernel.
        acc = tl.math.fma(d, s, acc)
        b_ptrs += 128 * s_bk
        a_ptrs += 128 * s_ak
    _store_tile(acc, c_ptr, pid_k.to(tl.int64) * s_ws, pid_m, pid_n, M, N, s_cm, s_cn, BLOCK_N, BLOCK_M)


@triton.jit(do_not_specialize=["M", "s_ws"])
def _bf16_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K, STEPS_PER_SPLIT,
    s_am, s_ak, s_bn, s_bk, s_ws, s_cm, s_cn,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, EMULATE_MMA: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rk = tl.arange(0, BLOCK_K)
    t0 = pid_k * STEPS_PER_SPLIT
    t1 = tl.minimum(t0 + STEPS_PER_SPLIT, (K + BLOCK_K - 1) // BLOCK_K)
    b_ptrs = b_ptr + rn[:, None].to(tl.int64) * s_bn + (t0 * BLOCK_K + rk)[None, :] * s_bk
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * s_am + (t0 * BLOCK_K + rk)[None, :] * s_ak
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    for t in tl.range(t0, t1, num_stages=NUM_STAGES):
        if EVEN_K:
            b = tl.load(b_ptrs)
            a = tl.load(a_ptrs)
        else:
            k_ok = t * BLOCK_K + rk < K
            b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        if EMULATE_MMA:  # CPU interpreter (see _interpreted): each step's dot in float64, rounded once
            acc += tl.dot(b.to(tl.float32).to(tl.float64), tl.trans(a.to(tl.float32).to(tl.float64))).to(tl.float32)
        else:
            acc = tl.dot(b, tl.trans(a), acc)
        b_ptrs += BLOCK_K * s_bk
        a_ptrs += BLOCK_K * s_ak
    _store_tile(acc, c_ptr, pid_k.to(tl.int64) * s_ws, pid_m, pid_n, M, N, s_cm, s_cn, BLOCK_N, BLOCK_M)


@triton.jit
def _store_tile(acc, c_ptr, offset, pid_m, pid_n, M, N, s_cm, s_cn, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] into out[M, N] (or a split's fp32 partial at `offset`), rounded once."""
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ptrs = c_ptr + offset + om[None, :].to(tl.int64) * s_cm + on[:, None] * s_cn
    tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(on[:, None] < N) & (om[None, :] < M))


@triton.jit
def _sum_splits_kernel(ws_ptr, c_ptr, TOTAL, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """c = ((p0 + p1) + p2) + ... per element, then one rounding to c's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < TOTAL
    acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    src = offs
    for _ in tl.static_range(1, SPLIT):
        src += TOTAL  # int64: split * M * N may pass 2^31
        acc += tl.load(ws_ptr + src, mask=ok, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


# ---- launches ---------------------------------------------------------------------------------
# Launchers skip Triton's per-call binding on repeats where enabled (kernels/launch.py): eager decode is host-bound.
_fp8_launch = TritonLauncher(_fp8_kernel)
_bf16_launch = TritonLauncher(_bf16_kernel)
_sum_splits = TritonLauncher(_sum_splits_kernel)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _splits(steps: int, split_k: int) -> tuple[int, int]:
    """(steps per split, number of splits) from the K step count and the configured split: K alone decides."""
    per = -(-steps // max(1, min(split_k, steps)))
    return per, -(-steps // per)


def _output(m: int, n: int, splits: int, out_dtype: torch.dtype, device: torch.device):
    """(the kernel's destination, its per-split stride, the final output)."""
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    if splits == 1:
        return out, 0, out
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=device)
    return ws, ws.stride(0), out


def _finish(dest: torch.Tensor, out: torch.Tensor, splits: int) -> torch.Tensor:
    if splits > 1:
        total, block = out.numel(), 1024
        _sum_splits((triton.cdiv(total, block),), dest, out, total, SPLIT=splits, BLOCK=block)
    return out


def _interpreted() -> bool:
    """Whether kernels run in Triton's CPU interpreter. Its tl.dot is numpy's matmul, which multiplies bf16 tiles
    as their raw uint16 bits and whose fp32 sums depend on a row's position in the tile (BLAS blocking), unlike
    an MMA; there the kernels form each K step's dot in float64 instead (EMULATE_MMA), so the interpreter tests
    check everything around the MMA (indexing, masks, scales, split-K, the fixed order) against a dot that is
    position-independent as the hardware's is."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_common(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, who: str) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"{who}: needs A [M, K] and B [N, K] with the same K, got {tuple(a.shape)} and {tuple(b.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{who}: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if a.device != b.device:
        raise ValueError(f"{who}: A is on {a.device} and B on {b.device}; move both to one device")


def _fp8_plan(a: torch.Tensor, b: torch.Tensor, b_block_n: int, out_dtype: torch.dtype, config: InvariantConfig | None, who: str):
    """What an FP8 entry point (A [M, K] of any dtype its kernel reads, B e4m3 [N, K]) checks and derives before its
    launch: (config, K groups per split, splits, destination, its split stride, output, grid), or the empty output
    for M = 0."""
    _check_common(a, b, out_dtype, who)
    if b_block_n not in (1, 128):
        raise ValueError(f"{who}: B must be 128x128- or 1x128-scaled, got a {b_block_n}-row block")
    m, k = a.shape
    n = b.shape[0]
    cfg = config or invariant_config(n, k, torch.float8_e4m3fn, m)
    if b_block_n == 128 and cfg.block_n > 128:
        raise ValueError(f"{who}: block_n {cfg.block_n} > 128 cannot read one 128x128 scale per slab")
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=a.device)
    per, splits = _splits(-(-k // _FP8_GROUP), cfg.split_k)
    dest, s_ws, out = _output(m, n, splits, out_dtype, a.device)
    return cfg, per, splits, dest, s_ws, out, (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)


def fp8_gemm_nt_invariant(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_block_n: int, out_dtype: torch.dtype,
    config: InvariantConfig | None = None,
) -> torch.Tensor:
    """a e4m3 [M, K] with sa (M, ceil(K/128)); b e4m3 [N, K] with sb (ceil(N/128) or N, ceil(K/128)) for
    `b_block_n` 128 or 1. Any strides. `config` defaults to `invariant_config(N, K, e4m3, M)`: the numerics of
    K, the tile of N and M's bucket."""
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemm_nt_invariant: A and B must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    plan = _fp8_plan(a, b, b_block_n, out_dtype, config, "fp8_gemm_nt_invariant")
    if isinstance(plan, torch.Tensor):
        return plan
    cfg, per, splits, dest, s_ws, out, grid = plan
    m, k = a.shape
    n = b.shape[0]
    _fp8_launch(
        grid, a, sa, b, sb, dest, m, n, k, per,
        a.stride(0), a.stride(1), sa.stride(0), sa.stride(1), b.stride(0), b.stride(1), sb.stride(0), sb.stride(1),
        s_ws, n, 1,
        B_BLOCK_N=b_block_n, EVEN_K=k % _FP8_GROUP == 0, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
        NUM_STAGES=cfg.num_stages, EMULATE_MMA=_interpreted(), num_warps=cfg.num_warps,
    )
    return _finish(dest, out, splits)


def bf16_gemm_nt_invariant(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, config: InvariantConfig | None = None,
) -> torch.Tensor:
    """a [M, K] @ b[N, K]^T for bf16/fp16 operands of one dtype, fp32 accumulation, one rounding to `out_dtype`
    (default a's dtype). `config` defaults to `invariant_config(N, K, dtype, M)`."""
    out_dtype = out_dtype or a.dtype
    _check_common(a, b, out_dtype, "bf16_gemm_nt_invariant")
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        raise ValueError(f"bf16_gemm_nt_invariant: A and B must both be bf16 or both fp16, got {a.dtype} and {b.dtype}")
    m, k = a.shape
    n = b.shape[0]
    cfg = config or invariant_config(n, k, a.dtype, m)
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=a.device)
    per, splits = _splits(-(-k // cfg.block_k), cfg.split_k)
    dest, s_ws, out = _output(m, n, splits, out_dtype, a.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    _bf16_launch(
        grid, a, b, dest, m, n, k, per,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), s_ws, n, 1,
        EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, EMULATE_MMA=_interpreted(), num_warps=cfg.num_warps,
    )
    return _finish(dest, out, splits)


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for bf16/fp16 x [..., K] and weight [N, K], batch-invariant: each output row is
    `bf16_gemm_nt_invariant`'s fp32 result plus the bias in fp32, rounded once to x's dtype (an elementwise
    step, so the row still depends on nothing but itself)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if bias is None and routed_linear(weight, x.dtype, x2.shape[0]):  # F.linear gave these bits at every probed M (opt-in)
        y = torch.nn.functional.linear(x2, weight)
    elif bias is None:
        y = bf16_gemm_nt_invariant(x2, weight, x.dtype)
    else:
        y = (bf16_gemm_nt_invariant(x2, weight, torch.float32) + bias.float()).to(x.dtype)
    return y.reshape(*lead, weight.shape[0])
