"""Fused producer + 1x128 quantization kernels for Llama/Qwen blocks.

- `silu_mul_quantize(gate, up)`: h = silu(gate) * up in the input dtype, then Q(h, 1x128).
  The arithmetic follows torch's CUDA kernels op by op (silu = g / (1 + exp(g * -1)) in fp32,
  rounded to the input dtype; the product in fp32, rounded again), so `h` is what
  `F.silu(gate) * up` gives and Q(h) is byte-exact with `quantize_fp8(h, (1, 128))`.
- `rmsnorm_quantize(x, weight, eps)`: y = weight * (x * rsqrt(mean(x^2) + eps)) in the HF Llama
  order (normalize in fp32, round to the input dtype, multiply by the weight in fp32, round),
  then Q(y, 1x128). The mean's summation order differs from torch's reduction, so `y` may differ
  from HF's by one bf16 ulp on a few elements; Q(y) is byte-exact with the reference quantizer of
  this kernel's own `y` (returned when `return_hp=True`).

- `rmsnorm_backward(dy, x, weight, eps)`: (dx, dweight) of that RMSNorm in one pass over the rows (the rstd
  recomputed from x, dweight's per-program partial sums added by torch), instead of the dozen elementwise and
  reduction kernels autograd runs for transformers' formula. fp32 arithmetic with the forward's rounding points
  (x / rms rounded to the input dtype before the weight, dy * weight rounded before the norm's backward), but not
  autograd's bytes: its reduction orders differ.

- `silu_mul_backward(dh, gate, up)`: the gradients of h = silu(gate) * up in one pass, in the order and at the
  rounding points of autograd's kernels for that expression (`silu_backward(dh * up, gate)` and
  `dh * silu(gate)`), instead of four elementwise kernels over the MLP-wide tensors.
- `silu_mul_backward_quantize(dh, gate, up)`: the same gradients as the halves of a stacked gate/up GEMM's dY, and
  Q(dY, 1x128) for that GEMM's DGrad in the same pass (one read of dY fewer).

The quantizing kernels do not write the high-precision result unless asked: the GEMM only needs the FP8 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import FP8_DTYPE, QuantizedTensor
from ._common import abs_max, group_scale, quantize_values
from .launch import TritonLauncher
from .layout import column_blocks_of_one
from .quant import empty_scale_1x128

try:  # Triton >= 3.2 spells the CUDA libdevice module like this
    from triton.language.extra import libdevice as _libdevice
except ImportError:  # pragma: no cover
    from triton.language.extra.cuda import libdevice as _libdevice

__all__ = ["silu_mul_quantize", "silu_mul_backward", "silu_mul_backward_quantize", "rmsnorm_quantize", "rmsnorm_backward",
           "KERNEL_DTYPES"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
KERNEL_DTYPES = tuple(_TL_DTYPE)  # input dtypes the fused kernels take


@triton.jit
def _silu_mul_quant_kernel(
    g_ptr, u_ptr, h_ptr, q_ptr, s_ptr, R, C,
    sgr, sgc, sur, suc, shr, shc, sqr, sqc, ssr, ssg,
    BLOCK_R: tl.constexpr, POW2: tl.constexpr, WRITE_H: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    pid_r = tl.program_id(0)
    g_idx = tl.program_id(1)
    rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cc = g_idx * 128 + tl.arange(0, 128)
    mask = (rr[:, None] < R) & (cc[None, :] < C)
    r64 = rr[:, None].to(tl.int64)
    g = tl.load(g_ptr + r64 * sgr + cc[None, :] * sgc, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * sur + cc[None, :] * suc, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + _libdevice.exp(-g))
    silu = silu.to(OUT_DTYPE).to(tl.float32)
    h = (silu * u).to(OUT_DTYPE)
    if WRITE_H:
        tl.store(h_ptr + r64 * shr + cc[None, :] * shc, h, mask=mask)
    h32 = tl.where(mask, h.to(tl.float32), 0.0)
    scale = group_scale(abs_max(h32, 1), POW2)
    q = quantize_values(h32, scale[:, None], POW2)
    tl.store(q_ptr + r64 * sqr + cc[None, :] * sqc, q, mask=mask)
    tl.store(s_ptr + rr * ssr + g_idx * ssg, scale, mask=rr < R)


_kern_silu_mul = TritonLauncher(_silu_mul_quant_kernel)


def silu_mul_quantize(
    gate: torch.Tensor, up: torch.Tensor, pow2_scale: bool = False, return_hp: bool = False
) -> QuantizedTensor | tuple[QuantizedTensor, torch.Tensor]:
    """Q(silu(gate) * up, 1x128). gate/up are 2-D [M, I] (views such as chunks of a fused gate_up are fine)."""
    if gate.shape != up.shape or gate.dim() != 2:
        raise ValueError(f"silu_mul_quantize needs two 2-D tensors of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype not in _TL_DTYPE or up.dtype != gate.dtype:
        raise TypeError(f"silu_mul_quantize supports bf16/fp16/fp32 inputs of one dtype, got {gate.dtype} and {up.dtype}")
    rows, cols = gate.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=gate.device)
    h = torch.empty((rows, cols), dtype=gate.dtype, device=gate.device) if return_hp else q
    scale = empty_scale_1x128(rows, cols, gate.device)
    br = 16 if rows <= 2048 else 32
    grid = (_cdiv(rows, br), _cdiv(cols, 128))
    _kern_silu_mul(grid,
        gate, up, h, q, scale, rows, cols,
        gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), h.stride(0), h.stride(1),
        q.stride(0), q.stride(1), scale.stride(0), scale.stride(1),
        BLOCK_R=br, POW2=pow2_scale, WRITE_H=return_hp, OUT_DTYPE=_TL_DTYPE[gate.dtype], num_warps=4,
    )
    qt = QuantizedTensor.trusted(q, scale, (1, 128))
    return (qt, h) if return_hp else qt


@triton.jit
def _silu_mul_grads(dh, g, u, OUT_DTYPE: tl.constexpr):
    """(dgate, dup) in OUT_DTYPE from fp32 dh, gate, up: aten's silu_backward(dh * up, gate) and dh * silu(gate)."""
    e = _libdevice.exp(-g)
    # dgate: aten's silu_backward(dh * up, gate), its product rounded first; 1 + x * (1 - s) is one fma in torch's build.
    t = (dh * u).to(OUT_DTYPE).to(tl.float32)
    sig = tl.math.div_rn(1.0, 1.0 + e)
    dg = (t * sig) * tl.math.fma(g, 1.0 - sig, 1.0)
    # dup: dh * silu(gate), silu rounded to the input dtype first as F.silu returns it.
    silu = tl.math.div_rn(g, 1.0 + e).to(OUT_DTYPE).to(tl.float32)
    du = dh * silu
    return dg.to(OUT_DTYPE), du.to(OUT_DTYPE)


@triton.jit
def _silu_mul_bwd_kernel(
    dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, R, C,
    sdr, sdc, sgr, sgc, sur, suc, sdgr, sdgc, sdur, sduc,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rr[:, None] < R) & (cc[None, :] < C)
    r64 = rr[:, None].to(tl.int64)
    dh = tl.load(dh_ptr + r64 * sdr + cc[None, :] * sdc, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r64 * sgr + cc[None, :] * sgc, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * sur + cc[None, :] * suc, mask=mask, other=0.0).to(tl.float32)
    dg, du = _silu_mul_grads(dh, g, u, OUT_DTYPE)
    tl.store(dg_ptr + r64 * sdgr + cc[None, :] * sdgc, dg, mask=mask)
    tl.store(du_ptr + r64 * sdur + cc[None, :] * sduc, du, mask=mask)


_kern_silu_mul_bwd = TritonLauncher(_silu_mul_bwd_kernel)


def silu_mul_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of h = silu(gate) * up for 2-D operands of one shape and dtype, in new tensors.

    When gate and up are the two column halves of one [M, 2I] tensor (a stacked gate/up GEMM's output), dgate and
    dup are the halves of one new [M, 2I] tensor too, so that GEMM's backward reads its dY without a copy.
    """
    if not (dh.shape == gate.shape == up.shape) or gate.dim() != 2:
        raise ValueError(f"silu_mul_backward needs three 2-D tensors of one shape, got {tuple(dh.shape)}, "
                         f"{tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype not in _TL_DTYPE or not (dh.dtype == up.dtype == gate.dtype):
        raise TypeError(f"silu_mul_backward supports bf16/fp16/fp32 inputs of one dtype, got {dh.dtype}, {gate.dtype}, {up.dtype}")
    rows, cols = gate.shape
    if column_blocks_of_one([gate, up]):
        both = torch.empty((rows, 2 * cols), dtype=gate.dtype, device=gate.device)
        dgate, dup = both[:, :cols], both[:, cols:]
    else:
        dgate, dup = torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(up, memory_format=torch.contiguous_format)
    br, bc = 8, 256
    _kern_silu_mul_bwd((_cdiv(rows, br), _cdiv(cols, bc)),
        dh, gate, up, dgate, dup, rows, cols,
        dh.stride(0), dh.stride(1), gate.stride(0), gate.stride(1), up.stride(0), up.stride(1),
        dgate.stride(0), dgate.stride(1), dup.stride(0), dup.stride(1),
        BLOCK_R=br, BLOCK_C=bc, OUT_DTYPE=_TL_DTYPE[gate.dtype], num_warps=4,
    )
    return dgate, dup


@triton.jit
def _quantize_group_store(v, mask, rr, R, q_ptr, r64, sq, cols, s_ptr, ssr, ssg, g_col, POW2: tl.constexpr):
    """Q(v, 1x128) of one [BLOCK_R, 128] tile of the high-precision values v, stored at columns `cols` of q and
    scale column `g_col`."""
    v32 = tl.where(mask, v.to(tl.float32), 0.0)
    scale = group_scale(abs_max(v32, 1), POW2)
    tl.store(q_ptr + r64 * sq + cols, quantize_values(v32, scale[:, None], POW2), mask=mask)
    tl.store(s_ptr + rr * ssr + g_col * ssg, scale, mask=rr < R)


@triton.jit
def _silu_mul_bwd_quant_kernel(
    dh_ptr, g_ptr, u_ptr, d_ptr, q_ptr, s_ptr, R, C,
    sdr, sgr, sur, sd, sq, ssr, ssg,
    BLOCK_R: tl.constexpr, POW2: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    # One program: BLOCK_R rows of one 128-column group of gate and the same group of up. d(gate) lands in columns
    # [0, C) of the stacked dY, d(up) in [C, 2C); C is a multiple of 128, so no 1x128 group straddles the two.
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g_idx = tl.program_id(1)
    cc = g_idx * 128 + tl.arange(0, 128)
    mask = (rr[:, None] < R) & (cc[None, :] < C)
    r64 = rr[:, None].to(tl.int64)
    dh = tl.load(dh_ptr + r64 * sdr + cc[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r64 * sgr + cc[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * sur + cc[None, :], mask=mask, other=0.0).to(tl.float32)
    dg, du = _silu_mul_grads(dh, g, u, OUT_DTYPE)
    tl.store(d_ptr + r64 * sd + cc[None, :], dg, mask=mask)
    tl.store(d_ptr + r64 * sd + (C + cc[None, :]), du, mask=mask)
    _quantize_group_store(dg, mask, rr, R, q_ptr, r64, sq, cc[None, :], s_ptr, ssr, ssg, g_idx, POW2)
    _quantize_group_store(du, mask, rr, R, q_ptr, r64, sq, C + cc[None, :], s_ptr, ssr, ssg, C // 128 + g_idx, POW2)


_kern_silu_mul_bwd_quant = TritonLauncher(_silu_mul_bwd_quant_kernel)


def silu_mul_backward_quantize(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, pow2_scale: bool = False
) -> tuple[torch.Tensor, QuantizedTensor]:
    """(dY, Q(dY, 1x128)) for dY = [d(gate), d(up)], the [M, 2I] gradient of a stacked gate/up GEMM's output.

    dY's bytes are `silu_mul_backward`'s (one device function computes both); Q(dY) is the reference quantizer's
    of those bytes, written in the same pass, so the GEMM's DGrad does not read dY again to quantize it. Needs I a
    multiple of 128 and row-contiguous operands (views with a row stride, such as the halves of gate_up, are fine).
    """
    if not (dh.shape == gate.shape == up.shape) or gate.dim() != 2:
        raise ValueError(f"silu_mul_backward_quantize needs three 2-D tensors of one shape, got {tuple(dh.shape)}, "
                         f"{tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype not in _TL_DTYPE or not (dh.dtype == up.dtype == gate.dtype):
        raise TypeError(f"silu_mul_backward_quantize supports bf16/fp16/fp32 inputs of one dtype, got {dh.dtype}, "
                        f"{gate.dtype}, {up.dtype}")
    rows, cols = gate.shape
    if cols % 128 or any(t.stride(1) != 1 for t in (dh, gate, up)):
        raise ValueError(f"silu_mul_backward_quantize needs a width that is a multiple of 128 and row-contiguous "
                         f"operands, got {cols} columns and strides {dh.stride()}, {gate.stride()}, {up.stride()}")
    d = torch.empty((rows, 2 * cols), dtype=gate.dtype, device=gate.device)
    q = torch.empty((rows, 2 * cols), dtype=FP8_DTYPE, device=gate.device)
    scale = empty_scale_1x128(rows, 2 * cols, gate.device)
    br = 16 if rows <= 2048 else 32
    _kern_silu_mul_bwd_quant((_cdiv(rows, br), cols // 128),
        dh, gate, up, d, q, scale, rows, cols,
        dh.stride(0), gate.stride(0), up.stride(0), d.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
        BLOCK_R=br, POW2=pow2_scale, OUT_DTYPE=_TL_DTYPE[gate.dtype], num_warps=4,
    )
    return d, QuantizedTensor.trusted(q, scale, (1, 128))


@triton.jit
def _rmsnorm_quant_kernel(
    x_ptr, w_ptr, y_ptr, q_ptr, s_ptr, R, C, eps,
    sxr, syr, sqr, ssr, ssg,
    BLOCK_C: tl.constexpr, POW2: tl.constexpr, WRITE_Y: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    row = tl.program_id(0)
    cc = tl.arange(0, BLOCK_C)
    cmask = cc < C
    r64 = row.to(tl.int64)
    x = tl.load(x_ptr + r64 * sxr + cc, mask=cmask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / C
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    xn = (x * rstd).to(OUT_DTYPE).to(tl.float32)
    w = tl.load(w_ptr + cc, mask=cmask, other=0.0).to(tl.float32)
    y = (w * xn).to(OUT_DTYPE)
    if WRITE_Y:
        tl.store(y_ptr + r64 * syr + cc, y, mask=cmask)
    y32 = tl.where(cmask, y.to(tl.float32), 0.0)
    yg = tl.reshape(y32, (BLOCK_C // 128, 128))
    scale = group_scale(abs_max(yg, 1), POW2)
    q = tl.reshape(quantize_values(yg, scale[:, None], POW2), (BLOCK_C,))
    tl.store(q_ptr + r64 * sqr + cc, q, mask=cmask)
    gi = tl.arange(0, BLOCK_C // 128)
    tl.store(s_ptr + row * ssr + gi * ssg, scale, mask=gi * 128 < C)


_kern_rmsnorm = TritonLauncher(_rmsnorm_quant_kernel)


def rmsnorm_quantize(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, pow2_scale: bool = False, return_hp: bool = False
) -> QuantizedTensor | tuple[QuantizedTensor, torch.Tensor]:
    """Q(RMSNorm(x) * weight, 1x128) for x [M, H] (row-contiguous) and weight [H]."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rmsnorm_quantize needs x [M, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    y = torch.empty((rows, cols), dtype=x.dtype, device=x.device) if return_hp else q
    scale = empty_scale_1x128(rows, cols, x.device)
    block_c = max(128, triton.next_power_of_2(cols))
    _kern_rmsnorm((rows,),
        x, weight, y, q, scale, rows, cols, float(eps),
        x.stride(0), y.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
        BLOCK_C=block_c, POW2=pow2_scale, WRITE_Y=return_hp, OUT_DTYPE=_TL_DTYPE[x.dtype],
        num_warps=8 if block_c >= 4096 else 4,
    )
    qt = QuantizedTensor(q, scale, (1, 128))
    return (qt, y) if return_hp else qt


@triton.jit
def _rmsnorm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, dx_ptr, dw_ptr, R, C, eps, rows_per_prog,
    sdyr, sxr, sdxr,
    BLOCK_C: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    pid = tl.program_id(0)
    cc = tl.arange(0, BLOCK_C)
    cmask = cc < C
    w = tl.load(w_ptr + cc, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    start = pid * rows_per_prog
    for i in range(0, rows_per_prog):
        row = start + i
        m = cmask & (row < R)
        r64 = row.to(tl.int64)
        x = tl.load(x_ptr + r64 * sxr + cc, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64 * sdyr + cc, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / C + eps)
        xh = x * rstd
        dw += dy * xh.to(OUT_DTYPE).to(tl.float32)  # y = w * round(xh): dL/dw sums dy * round(xh)
        g = (dy * w).to(OUT_DTYPE).to(tl.float32)  # dL/d round(xh), in the input dtype as the forward's product
        dx = rstd * (g - xh * (tl.sum(g * xh, axis=0) / C))
        tl.store(dx_ptr + r64 * sdxr + cc, dx.to(OUT_DTYPE), mask=m)
    tl.store(dw_ptr + pid * C + cc, dw, mask=cmask)


_kern_rmsnorm_bwd = TritonLauncher(_rmsnorm_bwd_kernel)


def rmsnorm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, programs: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype) for x, dy [M, H] and weight [H].

    `programs` (default: 4 per SM, at most M) each take a contiguous run of rows and keep their own fp32 partial
    of dweight; the partials are summed in fp32 and rounded to the weight's dtype."""
    if x.dim() != 2 or dy.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"rmsnorm_backward needs dy and x [M, H] and weight [H], got {tuple(dy.shape)}, "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    dy = dy if dy.stride(1) == 1 else dy.contiguous()
    weight = weight.contiguous()
    rows, cols = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0:
        return dx, torch.zeros_like(weight)
    if programs is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        programs = 4 * sms
    programs = max(1, min(programs, rows))
    per = _cdiv(rows, programs)
    programs = _cdiv(rows, per)
    partial = torch.empty((programs, cols), dtype=torch.float32, device=x.device)
    block_c = max(128, triton.next_power_of_2(cols))
    _kern_rmsnorm_bwd((programs,),
        dy, x, weight, dx, partial, rows, cols, float(eps), per,
        dy.stride(0), x.stride(0), dx.stride(0),
        BLOCK_C=block_c, OUT_DTYPE=_TL_DTYPE[x.dtype],
        num_warps=8 if block_c >= 4096 else 4,
    )
    return dx, partial.sum(0).to(weight.dtype)
