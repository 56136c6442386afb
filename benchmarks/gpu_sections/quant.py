"""Section `quant`: every quantizer's bandwidth against the copy (Triton 1x128, 128x1 transposed, the CUDA
requantizer, 128x128 and its transpose, the fused SwiGLU and RMSNorm quantizers and the fused RMSNorm's backward, each
beside what it replaces), plus the plain-torch reference."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from jetrl_precision import get_recipe, ops
from jetrl_precision.kernels import cast_transpose, fused, quant
from jetrl_precision.quantize import quantize_fp8

from .timing import bench, data, rec

__all__ = ["section_quant"]

BW = get_recipe("jet_fp8").train_backward


def section_quant(args, copy_bw):
    rows = []

    def one(name, shape, fn, nbytes, backend="triton"):
        fn()
        t = bench(fn)
        bw = nbytes / (t * 1e-3) / 1e12
        rows.append((name, shape, t * 1e3, bw, bw / copy_bw))
        rec(f"quant_{name}", shape, backend, round(bw, 3), "TB/s", None, time_us=round(t * 1e3, 2),
            frac_of_copy=round(bw / copy_bw, 3))

    for m, k in ((16384, 4096), (16384, 14336), (8192, 4096), (4096, 4096)):
        x = data(m, k, seed=1)
        shp = f"{m}x{k}"
        io = m * k * 2 + m * k + 4 * m * math.ceil(k / 128)
        one("1x128", shp, lambda: quant.quantize_1x128(x), io)
        if (m, k) == (16384, 4096):
            for br in (8, 16, 32, 64):
                one(f"1x128_blockr{br}", shp, lambda br=br: quant.quantize_1x128(x, block_r=br), io)
        one("128x1_transposed", shp, lambda: quant.quantize_128x1_t(x), io)
        # dY's two layouts from one read (what Fp8Linear's backward runs) against the two kernels apart.
        io_dual = m * k * 2 + 2 * m * k + 4 * m * math.ceil(k / 128) + 4 * k * math.ceil(m / 128)
        one("ops_quantize_dual", shp, lambda: ops.quantize_dual(x, BW.dgrad_grad_output, BW.wgrad_grad_output), io_dual)
        one("separate_1x128_then_128x1_T", shp, lambda: (quant.quantize_1x128(x), quant.quantize_128x1_t(x)), io_dual)
        one("dual_fused_one_read", shp, lambda: quant.quantize_dual_1x128_128x1_t(x), io_dual)
        if (m, k) == (16384, 4096):
            # Other tiles (32 columns x 4 warps; 16 x 1 and 16 x 2, column blocks fastest) next to the default;
            # the full tile sweep is benchmarks/quant_sweep.py.
            for t in (quant.Tile128x1(32, 4, False), quant.Tile128x1(16, 1, True), quant.Tile128x1(16, 2, True)):
                one(f"128x1_transposed_blockc{t.block_c}_w{t.num_warps}{'_colfast' if t.col_fastest else ''}", shp,
                    lambda t=t: quant.quantize_128x1_t(x, tile=t), io)
        q1 = quant.quantize_1x128(x)
        io_rq = m * k * 2 + 4 * m * math.ceil(k / 128) + 4 * k * math.ceil(m / 128)
        # The default is the CUDA cast-transpose kernel; the Triton one stays as the fallback.
        one("requant_1x128_to_128x1_T", shp, lambda: quant.requantize_1x128_to_128x1(q1, True), io_rq,
            backend="cuda" if cast_transpose.usable(x.device) else "triton")
        one("requant_1x128_to_128x1_T_triton", shp, lambda: quant.requantize_1x128_to_128x1(q1, True, kernel="triton"), io_rq)
        if (m, k) == (16384, 4096):
            for t in (quant.Tile128x1(32, 4, False), quant.Tile128x1(16, 2, True), quant.Tile128x1(16, 2, False)):
                one(f"requant_T_blockc{t.block_c}_w{t.num_warps}{'_colfast' if t.col_fastest else ''}", shp,
                    lambda t=t: quant.requantize_1x128_to_128x1(q1, True, tile=t), io_rq)
        if (m, k) == (16384, 14336):
            # pow2 (UE8M0) scales have an exact reciprocal: no FMA corrections in the kernels.
            one("1x128_pow2", shp, lambda: quant.quantize_1x128(x, pow2_scale=True), io)
            one("128x1_transposed_pow2", shp, lambda: quant.quantize_128x1_t(x, pow2_scale=True), io)
            q1p = quant.quantize_1x128(x, pow2_scale=True)
            one("requant_1x128_to_128x1_T_pow2", shp, lambda: quant.requantize_1x128_to_128x1(q1p, True, pow2_scale=True), io_rq,
                backend="cuda" if cast_transpose.usable(x.device) else "triton")
            one("requant_1x128_to_128x1_T_pow2_triton", shp,
                lambda: quant.requantize_1x128_to_128x1(q1p, True, pow2_scale=True, kernel="triton"), io_rq)
            del q1p
        if (m, k) == (16384, 4096):
            one("torch_reference_1x128", shp, lambda: quantize_fp8(x, (1, 128), nonfinite="propagate"), io, backend="torch-ops")
        del x, q1
    for n, k in ((28672, 4096), (4096, 14336), (6144, 4096)):
        w = data(n, k, seed=2, scale=0.02)
        shp = f"{n}x{k}"
        io = n * k * 2 + n * k
        one("128x128", shp, lambda: quant.quantize_128x128(w), io)
        one("128x128_w8", shp, lambda: quant.quantize_128x128(w, num_warps=8), io)  # against the default's 4 warps
        if (n, k) == (28672, 4096):
            one("128x128_pow2", shp, lambda: quant.quantize_128x128(w, pow2_scale=True), io)
        if (n, k) == (28672, 4096):
            one("128x128_T_only", shp, lambda: quant.quantize_128x128(w, write=False, write_t=True), io)
        one("128x128_plus_T", shp, lambda: quant.quantize_128x128(w, write_t=True), io + n * k)
        wq = quant.quantize_128x128(w)[0]
        one("torch_fp8_transpose_copy", shp, lambda: wq.t(), 2 * n * k, backend="torch-ops")
        one("triton_fp8_transpose", shp, lambda: quant.transpose_quantized(wq), 2 * n * k)
        if (n, k) == (28672, 4096):
            for blk, nw in ((32, 4), (64, 8), (128, 8)):
                one(f"triton_fp8_transpose_b{blk}_w{nw}", shp, lambda blk=blk, nw=nw: quant.transpose_quantized(wq, blk, nw), 2 * n * k)
        del w, wq
    for m, i in ((16384, 14336), (8192, 14336)):
        gu = data(m, 2 * i, seed=3)
        g, u = gu[:, :i], gu[:, i:]
        io = 2 * m * i * 2 + m * i + 4 * m * i // 128
        one("silu_mul_1x128", f"{m}x{i}", lambda: fused.silu_mul_quantize(g, u), io)
        one("torch_silu_mul_then_1x128", f"{m}x{i}", lambda: quant.quantize_1x128(F.silu(g) * u), io, backend="torch+triton")
        del gu, g, u
    for m, h in ((16384, 4096), (8192, 4096)):
        x = data(m, h, seed=4)
        w = torch.ones(h, device="cuda", dtype=torch.bfloat16)
        io = m * h * 2 + m * h + 4 * m * h // 128
        one("rmsnorm_1x128", f"{m}x{h}", lambda: fused.rmsnorm_quantize(x, w), io)
        # What a fused norm runs (y written too) against the plain norm then its projections' quantizer, and the
        # backward kernel against autograd's through transformers' formula (its graph kept, so only the backward is
        # timed); bytes: x (and dy) read, y (dx) written, plus Q(y).
        from jetrl_precision.rmsnorm import rms_norm_formula

        io_y = io + m * h * 2
        one("rmsnorm_1x128_with_y", f"{m}x{h}", lambda: fused.rmsnorm_quantize(x, w, return_hp=True), io_y)
        one("torch_rmsnorm_then_1x128", f"{m}x{h}", lambda: quant.quantize_1x128(rms_norm_formula(x, w, 1e-5)), io_y, backend="torch+triton")
        dy = data(m, h, seed=5)
        one("rmsnorm_backward", f"{m}x{h}", lambda: fused.rmsnorm_backward(dy, x, w), 6 * m * h)
        xg, wg = x.detach().requires_grad_(), w.detach().clone().requires_grad_()
        with torch.enable_grad():
            y = rms_norm_formula(xg, wg, 1e-5)
        one("torch_rmsnorm_backward", f"{m}x{h}", lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True),
            6 * m * h, backend="torch")
        del x, dy, xg, y
    print(f"\n{'quantizer':34s} {'shape':>12s} {'us':>8s} {'TB/s':>6s} {'%copy':>6s}")
    for name, shp, us, bw, fr in rows:
        print(f"{name:34s} {shp:>12s} {us:8.1f} {bw:6.2f} {100 * fr:5.0f}%")
