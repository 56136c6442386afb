"""An FP8 linear in one launch for decode-sized batches: the activation's 1x128 quantization inside the GEMM.

`fp8_linear_invariant(x, b, sb, ...)` takes the bf16/fp16 activation itself. Each K step of the batch-invariant FP8
GEMM (`invariant_gemm._fp8_kernel`) loads one 128-wide group of x's rows, quantizes it in registers with the
reference quantizer's arithmetic (`_common.group_scale` / `quantize_values`, as the 1x128 quantize kernel does), and
feeds the e4m3 tile and its scale to the same MMA and FMA. So its output equals, bit for bit,
`quantize_1x128(x)` followed by `fp8_gemm_nt_invariant` under the same numerics (`invariant_config`), and keeps
that kernel's batch invariance.

Why: an eager engine's decode step waits on host time, and the two-launch call (quantize, then GEMM) costs about
2.6x `F.linear`'s host time; one Triton launch through the direct launcher costs less than `F.linear`. The price
is GPU time: every program of a weight slab quantizes its rows again (cheap at decode sizes, where the weight read
dominates), and the invariant GEMM's tiles are slower than cuBLASLt's beyond M = 64 on 8B shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import abs_max, group_scale, quantize_values
from .invariant_gemm import _FP8_GROUP, InvariantConfig, _finish, _fp8_plan, _interpreted, _store_tile
from .launch import TritonLauncher

__all__ = ["fp8_linear_invariant"]


@triton.jit(do_not_specialize=["M", "s_ws"])
def _fp8_quant_kernel(
    x_ptr, b_ptr, sb_ptr, c_ptr,
    M, N, K, GROUPS_PER_SPLIT,
    s_xm, s_xk, s_bn, s_bk, s_sbn, s_sbg, s_ws, s_cm, s_cn,
    B_BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, POW2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NUM_STAGES: tl.constexpr, EMULATE_MMA: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rk = tl.arange(0, 128)
    g0 = pid_k * GROUPS_PER_SPLIT
    g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, (K + 127) // 128)
    b_ptrs = b_ptr + rn[:, None].to(tl.int64) * s_bn + (g0 * 128 + rk)[None, :] * s_bk
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * s_xm + (g0 * 128 + rk)[None, :] * s_xk
    if B_BLOCK_N == 128:
        sb_ptrs = sb_ptr + ((pid_n * BLOCK_N) // 128) * s_sbn
    else:
        sb_ptrs = sb_ptr + rn * s_sbn
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    for g in tl.range(g0, g1, num_stages=NUM_STAGES):
        if EVEN_K:
            b = tl.load(b_ptrs)
            x = tl.load(x_ptrs).to(tl.float32)
        else:
            k_ok = g * 128 + rk < K
            b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
        # the 1x128 quantize kernel's steps: the group's amax (masked columns are zeros), its scale, the e4m3 bytes
        sa = group_scale(abs_max(x, 1), POW2)
        a = quantize_values(x, sa[:, None], POW2)
        sb = tl.load(sb_ptrs + g * s_sbg)
        if B_BLOCK_N == 128:
            s = tl.broadcast_to(sb * sa[None, :], (BLOCK_N, BLOCK_M))
        else:
            s = sb[:, None] * sa[None, :]
        if EMULATE_MMA:  # CPU interpreter: see invariant_gemm._interpreted
            d = tl.dot(b.to(tl.float32).to(tl.float64), tl.trans(a.to(tl.float32).to(tl.float64))).to(tl.float32)
        else:
            d = tl.dot(b, tl.trans(a))
        acc = tl.math.fma(d, s, acc)
        b_ptrs += 128 * s_bk
        x_ptrs += 128 * s_xk
    _store_tile(acc, c_ptr, pid_k.to(tl.int64) * s_ws, pid_m, pid_n, M, N, s_cm, s_cn, BLOCK_N, BLOCK_M)


_launch = TritonLauncher(_fp8_quant_kernel)


def fp8_linear_invariant(
    x: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_block_n: int, out_dtype: torch.dtype | None = None,
    pow2_scale: bool = False, config: InvariantConfig | None = None,
) -> torch.Tensor:
    """x bf16/fp16 [M, K] (any strides) quantized 1x128 (`pow2_scale` as the recipe's input spec) times b e4m3 [N, K]
    with sb (ceil(N/128) or N, ceil(K/128)) for `b_block_n` 128 or 1; out_dtype defaults to x's. Equals
    `fp8_gemm_nt_invariant(quantize_1x128(x), ...)` bit for bit under the same `config` (default
    `invariant_config(N, K, e4m3, M)`)."""
    out_dtype = out_dtype or x.dtype
    if x.dtype not in (torch.bfloat16, torch.float16) or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear_invariant: x must be bf16/fp16 and B float8_e4m3fn, got {x.dtype} and {b.dtype}")
    plan = _fp8_plan(x, b, b_block_n, out_dtype, config, "fp8_linear_invariant")
    if isinstance(plan, torch.Tensor):
        return plan
    cfg, per, splits, dest, s_ws, out, grid = plan
    m, k = x.shape
    n = b.shape[0]
    _launch(
        grid, x, b, sb, dest, m, n, k, per,
        x.stride(0), x.stride(1), b.stride(0), b.stride(1), sb.stride(0), sb.stride(1), s_ws, n, 1,
        B_BLOCK_N=b_block_n, EVEN_K=k % _FP8_GROUP == 0, POW2=pow2_scale, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
        NUM_STAGES=cfg.num_stages, EMULATE_MMA=_interpreted(), num_warps=cfg.num_warps,
    )
    return _finish(dest, out, splits)
