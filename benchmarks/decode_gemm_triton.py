"""Prototype: a decode-sized block-scaled FP8 GEMM in Triton that streams the weight at memory speed.

    python benchmarks/decode_gemm_triton.py [--out results.json]

At decode sizes (M = batch, 1..256) a layer's GEMM is a weight read: FP8 halves the bytes, so it should take
about half of BF16's time. The vendor block-scaled kernels (cuBLASLt, vLLM's CUTLASS) stream FP8 weights at
1.2-1.4 TB/s on the H200 where BF16 reaches 3.2 TB/s (benchmarks/decode_gemm_probe.py), which erases the gain.
This kernel reads each weight byte once: one program per (N tile, K split, M tile covering the whole batch),
a 128-wide K group per step (one A scale per row, one B scale per tile), fp32 accumulation; split-K partials
go to an fp32 workspace summed in a fixed order, so the result is deterministic and independent of M's tiling
(the property the bitwise mode needs). It sweeps a few configurations per shape and prints the best against
BF16 F.linear and cuBLASLt, each timed under a CUDA graph. It is not wired into the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def _decode_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
    s_am, s_ak, s_asm, s_asg, s_bn, s_bk, s_bsn, s_bsg, s_cs, s_cm, s_cn, GROUPS_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 128)
    m_ok = rm < M
    n_ok = rn < N
    nb = (pid_n * BLOCK_N) // 128  # BLOCK_N divides 128: the tile lies in one 128-row weight block
    g0 = pid_k * GROUPS_PER_SPLIT
    g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, tl.cdiv(K, 128))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in tl.range(g0, g1, num_stages=NUM_STAGES):
        kk = g * 128 + rk
        a = tl.load(a_ptr + rm[:, None] * s_am + kk[None, :] * s_ak, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptr + rn[:, None] * s_bn + kk[None, :] * s_bk, mask=n_ok[:, None], other=0.0)
        part = tl.dot(a, tl.trans(b))
        sa = tl.load(as_ptr + rm * s_asm + g * s_asg, mask=m_ok, other=0.0)
        sb = tl.load(bs_ptr + nb * s_bsn + g * s_bsg)
        acc += part * (sa[:, None] * sb)
    c = c_ptr + pid_k * s_cs + rm[:, None] * s_cm + rn[None, :] * s_cn
    if SPLIT_K == 1:
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(c, acc, mask=m_ok[:, None] & n_ok[None, :])


def decode_gemm(aq, bq, out_dtype=torch.bfloat16, block_m=None, block_n=64, split_k=4, num_warps=4, num_stages=3):
    """aq: QuantizedTensor [M, K] 1x128; bq: QuantizedTensor [N, K] 128x128 (N, K multiples of 128)."""
    a, sa, b, sb = aq.data, aq.scale, bq.data, bq.scale
    m, k = a.shape
    n = b.shape[0]
    groups = -(-k // 128)
    per_split = -(-groups // split_k)
    block_m = block_m or min(128, max(16, triton.next_power_of_2(m)))
    grid = (-(-n // block_n), split_k, -(-m // block_m))
    if split_k == 1:
        c = torch.empty((m, n), dtype=out_dtype, device=a.device)
        cs = 0
    else:
        c = torch.empty((split_k, m, n), dtype=torch.float32, device=a.device)
        cs = c.stride(0)
    _decode_gemm_kernel[grid](
        a, sa, b, sb, c, m, n, k,
        a.stride(0), a.stride(1), sa.stride(0), sa.stride(1), b.stride(0), b.stride(1), sb.stride(0), sb.stride(1),
        cs, c.stride(-2), c.stride(-1), per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split_k, NUM_STAGES=num_stages,
        num_warps=num_warps,
    )
    if split_k == 1:
        return c
    return c.sum(0).to(out_dtype)  # a fixed-order reduction over the splits


def graph_us(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000 / reps)
    return sorted(ts)[2]


def main() -> None:
    import torch.nn.functional as F

    from jetrl_precision import quantize_fp8
    from jetrl_precision.gemm import resolve_backend, torch_backend
    from jetrl_precision.kernels import quant
    from jetrl_precision.kernels.layout import row_major_padded_t

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--m", type=int, nargs="+", default=[64, 256])
    a_ = ap.parse_args()
    resolve_backend("torch", "cuda")
    mm = torch_backend.prepared_scaled_mm("cuda")
    def configs(m):
        if m <= 64:
            return [(max(16, triton.next_power_of_2(m)), bn, sk, 4, st) for bn in (64, 128) for sk in (1, 4, 8) for st in (3, 4)]
        # larger batches: one M tile for the whole batch reads each weight byte once; more warps hold its accumulator
        return [(bm, bn, sk, w, st) for bm in (128, 256) for bn in (32, 64, 128) for sk in (1, 2, 4) for w in (4, 8) for st in (3, 4)
                if not (bm == 256 and bn == 128)]
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for proj, (k, n) in {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}.items():
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16() * 0.02
        wq = quantize_fp8(w, (128, 128))
        wt, sbp = wq.data.t(), row_major_padded_t(wq.scale)
        for m in a_.m:
            x = (torch.randn(m, k, device="cuda", generator=g) * torch.exp(torch.randn(m, 1, device="cuda", generator=g))).bfloat16()
            xq = quant.quantize_1x128(x, False)  # the engine's quantizer: same bytes, MN-major scales as cuBLASLt reads them
            ref = (xq.dequantize(torch.float32) @ wq.dequantize(torch.float32).t())
            cub = mm(xq.data, wt, xq.scale, sbp, torch.bfloat16)
            row = {"proj": proj, "m": m, "bf16_us": graph_us(lambda: F.linear(x, w)),
                   "cublaslt_us": graph_us(lambda: mm(xq.data, wt, xq.scale, sbp, torch.bfloat16)),
                   "cublaslt_rel_err": float((cub.float() - ref).norm() / ref.norm())}
            best = None
            for bm, bn, sk, nw, st in configs(m):
                kw = dict(block_m=bm, block_n=bn, split_k=sk, num_warps=nw, num_stages=st)
                try:
                    out = decode_gemm(xq, wq, **kw)
                    err = float((out.float() - ref).norm() / ref.norm())
                    if not err < 5e-3:
                        row.setdefault("wrong", []).append([kw, err])
                        continue
                    us = graph_us(lambda: decode_gemm(xq, wq, **kw))
                except Exception as e:  # noqa: BLE001 - a configuration that does not compile is skipped, and said
                    row.setdefault("failed", []).append([kw, f"{type(e).__name__}: {str(e)[:100]}"])
                    continue
                if best is None or us < best[0]:
                    best = (us, kw, err)
            if best:
                row.update(triton_us=best[0], config=best[1], triton_rel_err=best[2], weight_tb_s=n * k / best[0] / 1e6)
            row["bf16_weight_tb_s"] = 2 * n * k / row["bf16_us"] / 1e6
            rows.append(row)
            print(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items() if kk not in ("wrong", "failed")}),
                  "wrong:", len(row.get("wrong", [])), "failed:", len(row.get("failed", [])), (row.get("failed") or [[""]])[0][-1], flush=True)
    if a_.out:
        Path(a_.out).write_text(json.dumps(rows, indent=1))
    tot = {key: sum(r.get(key, float("nan")) for r in rows if r["m"] == m) for m in a_.m for key in ("bf16_us", "cublaslt_us", "triton_us")}
    print("per-layer sums (last M):", {k: round(v, 1) for k, v in tot.items()})


if __name__ == "__main__":
    main()
