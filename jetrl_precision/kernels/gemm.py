"""Block-scaled FP8 GEMM in Triton: out[M, N] = A[M, K] @ B[N, K]^T with per-128-K-group scales.

A is 1x128-scaled (scale (M, ceil(K/128)), any strides). B is either 128x128-scaled (scale
(ceil(N/128), ceil(K/128))) or 1x128-scaled (scale (N, ceil(K/128))). Every K step of 128 is one
`tl.dot` in fp32, promoted into the accumulator with its scales:
- 128x128 B and BLOCK_N <= 128: one combined per-row factor sa[m] * sb, i.e. one FMA per element;
- 1x128 B: the outer product sa[m] * sb[n].
Edges: rows/columns past M/N are clamped onto valid memory and masked on store; a partial last K
group is masked to zero. Split-K (deterministic: fp32 partials summed in a fixed order) keeps the
GPU busy for decode-sized M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fp8_gemm_nt", "GEMM_CONFIGS"]


def _configs():
    out = []
    for bm, bn, warps, stages in (
        (64, 128, 4, 4),
        (128, 128, 8, 3),
        (128, 128, 8, 4),
        (64, 64, 4, 4),
        (64, 256, 8, 3),
        (128, 256, 8, 3),
    ):
        out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=warps, num_stages=stages))
    return out


GEMM_CONFIGS = _configs()


def _prune(configs, named_args, **kwargs):
    # 128x128 B scales are read as one scalar per K step only when an N tile sits in one 128-block.
    b_block = kwargs.get("B_BLOCK_N", named_args.get("B_BLOCK_N", 1))
    m = named_args["M"]
    keep = []
    for c in configs:
        bn, bm = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_M"]
        if b_block == 128 and bn > 128:
            continue
        if m <= 64 and bm > 64:
            continue
        keep.append(c)
    return keep or configs[:1]


@triton.autotune(
    configs=GEMM_CONFIGS,
    key=["M_BUCKET", "N", "K", "B_BLOCK_N", "SPLIT_K"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _fp8_gemm_nt_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr,
    M, N, K, M_BUCKET, K_TILES_PER_SPLIT,
    s_am, s_ak, s_bn, s_bk, s_cs, s_cm, s_cn,
    s_sam, s_sag, s_sbn, s_sbg,
    SPLIT_K, B_BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row tiles share the B tiles they stream through L2.
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, 128)
    k_tiles = tl.cdiv(K, 128)
    kt0 = pid_k * K_TILES_PER_SPLIT
    kt1 = tl.minimum(kt0 + K_TILES_PER_SPLIT, k_tiles)

    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * s_am + (kt0 * 128 + rk)[None, :] * s_ak
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * s_bn + (kt0 * 128 + rk)[:, None] * s_bk
    sa_ptrs = sa_ptr + rm * s_sam
    if B_BLOCK_N == 128:
        sb_ptrs = sb_ptr + (pid_n * BLOCK_N // 128) * s_sbn
    else:
        sb_ptrs = sb_ptr + rn * s_sbn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(kt0, kt1):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = kt * 128 + rk < K
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        sa = tl.load(sa_ptrs + kt * s_sag)
        sb = tl.load(sb_ptrs + kt * s_sbg)
        d = tl.dot(a, b)
        if B_BLOCK_N == 128:
            acc += d * (sa * sb)[:, None]
        else:
            acc += d * (sa[:, None] * sb[None, :])
        a_ptrs += 128 * s_ak
        b_ptrs += 128 * s_bk

    om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + pid_k * s_cs + om[:, None].to(tl.int64) * s_cm + on[None, :] * s_cn
    mask = (om[:, None] < M) & (on[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _split_k(m: int, n: int, k_tiles: int, sms: int) -> int:
    """Split K only when the output has too few 64x128 tiles to fill the GPU (decode shapes)."""
    tiles = -(-m // 64) * -(-n // 128)
    if tiles >= sms or k_tiles < 8:
        return 1
    # A power of two: other split counts are much slower on the H200 (an M=64 o_proj at split 5).
    want = min(sms // tiles, k_tiles // 4, 8)
    split = 1
    while split * 2 <= want:
        split *= 2
    return split


def fp8_gemm_nt(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_block_n: int, out_dtype: torch.dtype,
    split_k: int | None = None, config: triton.Config | None = None,
) -> torch.Tensor:
    """a e4m3 [M, K] (K contiguous), sa (M, ceil(K/128)); b e4m3 [N, K] (K contiguous), sb per `b_block_n` (128 or 1)."""
    m, k = a.shape
    n = b.shape[0]
    k_tiles = -(-k // 128)
    if split_k is None:
        split_k = _split_k(m, n, k_tiles, _num_sms(a.device))
    per_split = -(-k_tiles // split_k)
    split_k = -(-k_tiles // per_split)  # no empty splits
    if split_k == 1:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
        s_cs = 0
    else:
        out = torch.empty((split_k, m, n), dtype=torch.float32, device=a.device)
        s_cs = out.stride(0)
    c2 = out if split_k == 1 else out[0]
    m_bucket = triton.next_power_of_2(m) if m <= 4096 else 8192 * -(-m // 8192)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), split_k)

    args = (
        a, b, out, sa, sb,
        m, n, k, m_bucket, per_split,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), s_cs, c2.stride(0), c2.stride(1),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), split_k,
    )
    if config is None:
        _fp8_gemm_nt_kernel[grid](*args, B_BLOCK_N=b_block_n, EVEN_K=(k % 128 == 0))
    else:  # a fixed tile (benchmarks, and the CPU interpreter, which cannot autotune)
        if b_block_n == 128 and config.kwargs["BLOCK_N"] > 128:
            raise ValueError("BLOCK_N > 128 is not supported with 128x128 B scales")
        _fp8_gemm_nt_kernel.fn[grid](
            *args, B_BLOCK_N=b_block_n, EVEN_K=(k % 128 == 0), **config.kwargs,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    if split_k == 1:
        return out
    return out.sum(0).to(out_dtype)
