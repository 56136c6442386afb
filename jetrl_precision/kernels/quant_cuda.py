"""CUDA 1x128 activation quantizer with a lean launch, byte-exact with `quantize_fp8` (checked at first use).

Why a second 1x128 quantizer beside the Triton one: an eager inference engine calls it once per projection per
decode step, where the host time of the launch, not the kernel, is what the step waits for. A launch through
Triton's launcher (even the direct one in `launch.py`) costs ~15 us of host time on the H100/H200 hosts; this
kernel launches through `nvrtc.NvrtcKernel` (one ctypes `cuLaunchKernel`). The arithmetic is
`nvrtc.DEVICE_FUNCTIONS`, the same steps as the Triton kernels and the CUDA requantizer.

Layout: one warp per (row, 128-column group), lane l holding columns [4l, 4l + 4); a CTA is 4 rows of one group,
so its 4 scales land side by side in the MN-major scale buffer (`quant.quantize_1x128`'s layout: (R, G) with
strides (1, rows_alloc)). Inputs: bf16 or fp16 [R, C] with contiguous columns, C % 4 == 0, 8-byte aligned rows,
R <= MAX_ROWS (decode and small prefill batches); anything else goes to the Triton kernel
(`Quantizer1x128.__call__` checks per call).

`quantizer_1x128(device, pow2, dtype)` compiles the kernel for that device and input dtype, compares its bytes and
scale bits with the reference on data that has outliers, zero groups, signed zeros, NaN and +-inf, and returns the
quantizer, or None after one warning naming the reason (the caller keeps the Triton kernel: same bytes).
"""

from __future__ import annotations

import logging

import torch

from ..formats import FP8_DTYPE, QuantizedTensor
from ._probe import device_key, verdict_once
from .nvrtc import DEVICE_FUNCTIONS, NvrtcKernel, compile_kernel, unavailable_reason

__all__ = ["Quantizer1x128", "quantizer_1x128", "status", "KERNEL_NAME", "GRAPH_KERNEL"]

logger = logging.getLogger(__name__)

KERNEL_NAME = "quant_1x128_rows"  # what `launch.override_launches` receives
GRAPH_KERNEL = "cuda:quant_1x128"  # how records name it beside the Triton kernel ("triton")

_SOURCE = DEVICE_FUNCTIONS + r"""
// Two 16-bit floats (lowest half = lowest column) -> fp32, exact.
template <int IN>
__device__ __forceinline__ void half2_to_f32(u32 w, float& lo, float& hi) {
    if (IN == 0) {  // bf16: the high half of an fp32
        lo = __int_as_float(w << 16);
        hi = __int_as_float(w & 0xFFFF0000u);
    } else {        // fp16
        asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;\n}"
            : "=f"(lo), "=f"(hi) : "r"(w));
    }
}

// One warp = one row x one 128-column group; a CTA = 4 rows of one group. Needs K % 4 == 0 and 8-byte aligned
// rows (ldx % 4 == 0). Columns past K (the last group of K % 128 != 0) count as zeros, as in the reference.
template <bool POW2, int IN>
__global__ void __launch_bounds__(128)
quant_1x128_rows(const unsigned short* __restrict__ x, u32* __restrict__ q, float* __restrict__ s,
                 int M, int K, int ldx, int ldq_words, int lds) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= M) return;  // whole warps: the shuffles below stay full-warp
    const int k0 = blockIdx.y * 128 + 4 * lane;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (k0 < K) {
        const uint2 w = __ldg(reinterpret_cast<const uint2*>(x + (size_t)row * ldx + k0));
        half2_to_f32<IN>(w.x, v[0], v[1]);
        half2_to_f32<IN>(w.y, v[2], v[3]);
    }
    float a = max_nan(max_nan(fabsf(v[0]), fabsf(v[1])), max_nan(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) a = max_nan(a, __shfl_xor_sync(0xffffffffu, a, off));
    const float sc = group_scale<POW2>(a);
    const float rc = __frcp_rn(sc);
    const float s_res = rc == 0.0f ? 0.0f : sc;  // scale = inf: x / inf stays a signed zero
    if (k0 < K) {
        const u32 lo = f32x2_to_fp8x2(quotient<POW2>(v[0], rc, s_res), quotient<POW2>(v[1], rc, s_res));
        const u32 hi = f32x2_to_fp8x2(quotient<POW2>(v[2], rc, s_res), quotient<POW2>(v[3], rc, s_res));
        q[(size_t)row * ldq_words + (k0 >> 2)] = lo | (hi << 16);
    }
    if (lane == 0) s[(size_t)blockIdx.y * lds + row] = sc;
}
"""

_IN_CODE = {torch.bfloat16: 0, torch.float16: 1}


# Above this many rows the Triton kernel quantizes: the launch's host time no longer matters there, and its GPU time
# was lower or equal (M = 8192, K = 4096, two H100 runs: 38.7 us against this kernel's 45.6, and 38.8 against 38.6;
# one warp per group is short work).
MAX_ROWS = 4096


class Quantizer1x128:
    """`quant.quantize_1x128(x, pow2, rows_alloc=...)` on one device with the CUDA kernel: call as
    `q(x, rows_alloc)`. Inputs it is not for (another dtype or device, strided columns, C % 4 != 0, unaligned rows,
    more than `MAX_ROWS` rows) go to the Triton kernel, which writes the same bytes."""

    def __init__(self, kern: NvrtcKernel, pow2: bool, dtype: torch.dtype, max_rows: int = MAX_ROWS) -> None:
        self.kern, self.pow2, self.dtype, self.max_rows = kern, pow2, dtype, max_rows
        self.meta = {"POW2": pow2}

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel is for x: its dtype and device, contiguous columns, C % 4 == 0, 16-byte rows, 1..MAX_ROWS rows."""
        rows, cols = x.shape
        sxr, sxc = x.stride()
        return not (x.dtype is not self.dtype or sxc != 1 or cols % 4 or sxr % 4 or x.data_ptr() % 8 or rows == 0
                    or rows > self.max_rows or x.get_device() != self.kern.device_index)

    def __call__(self, x: torch.Tensor, rows_alloc: int | None = None) -> QuantizedTensor:
        if not self.takes(x):
            from .quant import quantize_1x128

            return quantize_1x128(x, self.pow2, rows_alloc=rows_alloc)
        rows, cols = x.shape
        sxr = x.stride(0)
        alloc = rows if rows_alloc is None or rows_alloc < rows else rows_alloc
        groups = -(-cols // 128)
        q = torch.empty((alloc, cols), dtype=FP8_DTYPE, device=x.device)
        scale = torch.empty_strided((alloc, groups), (1, alloc), dtype=torch.float32, device=x.device)
        self.kern((-(-rows // 4), groups), 128, (x, q, scale), (rows, cols, sxr, cols // 4, alloc), self.meta)
        return QuantizedTensor.trusted(q, scale, (1, 128))

    def into(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> bool:
        """Quantize x [R, C] into the caller's q [A, C] (contiguous e4m3) and scale [A, ceil(C/128)] (strides (1, A)),
        A >= R, rows R.. left as they are: what `__call__(x, A)` returns, without its two allocations (an engine's
        per-shape workspace). False, with nothing written, for an input this kernel is not for."""
        if not self.takes(x):
            return False
        rows, cols = x.shape
        self.kern((-(-rows // 4), -(-cols // 128)), 128, (x, q, scale), (rows, cols, x.stride(0), cols // 4, q.shape[0]), self.meta)
        return True


_quantizers: dict[tuple[str, bool, torch.dtype], Quantizer1x128] = {}
_verdicts: dict[tuple[str, bool, torch.dtype], bool] = {}
_reasons: dict[tuple[str, bool, torch.dtype], str] = {}


def quantizer_1x128(device: torch.device | str, pow2: bool, dtype: torch.dtype) -> Quantizer1x128 | None:
    """The checked CUDA quantizer for `dtype` inputs on `device`, or None (the reason is logged once; `status`)."""
    device = torch.device(device)
    if unavailable_reason(device) is not None or dtype not in _IN_CODE:
        return None
    key = (device_key(device), pow2, dtype)

    def check() -> str:
        idx = torch.device(key[0]).index
        name = f"quant_1x128_rows<{'true' if pow2 else 'false'}, {_IN_CODE[dtype]}>"
        quant = Quantizer1x128(compile_kernel(_SOURCE, name, KERNEL_NAME, idx, 3, 5), pow2, dtype)
        bad = first_mismatch(quant, torch.device(key[0]))
        if not bad:
            _quantizers[key] = quant
        return bad

    def warn(why: str) -> None:
        logger.warning("jetrl_precision: the CUDA 1x128 quantizer (%s inputs, pow2 scales %s) is not used on %s: %s. "
                       "The Triton kernel quantizes instead: same bytes, more host time per call.", dtype, pow2, key[0], why)

    return _quantizers[key] if verdict_once(_verdicts, _reasons, key, check, warn) else None


def status(device: torch.device | str, pow2: bool = False, dtype: torch.dtype = torch.bfloat16) -> tuple[bool, str]:
    """(usable, reason) of the CUDA quantizer for `dtype` inputs on `device` (compiles and checks it once)."""
    device = torch.device(device)
    why = unavailable_reason(device)
    if why is not None:
        return False, why
    if dtype not in _IN_CODE:
        return False, f"{dtype} inputs are not handled (bf16 and fp16 are)"
    if quantizer_1x128(device, pow2, dtype) is None:
        return False, _reasons[(device_key(device), pow2, dtype)]
    return True, "ok"


def probe_inputs(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Inputs the first-use check quantizes: random rows with per-row magnitudes over many octaves and planted
    outliers, a zero group, signed zeros, NaN and +-inf, tiny values; row counts that leave partial CTAs, and a
    column count that leaves a partial group."""
    g = torch.Generator(device="cpu").manual_seed(1234)
    out = []
    for rows, cols in ((1, 4096), (3, 4096), (64, 4096), (130, 576), (257, 1024)):
        x = torch.randn(rows, cols, generator=g) * torch.exp(2.5 * torch.randn(rows, 1, generator=g))
        x[torch.rand(rows, cols, generator=g) < 2e-3] *= 300.0
        x[0, :128] = 0.0
        x[0, 128:132] = torch.tensor([-0.0, 0.0, 1e-30, -1e-30])
        if rows > 2:
            x[1, 5] = float("nan")
            x[2, 300 % cols] = float("inf")
            x[2, 7] = -float("inf")
        out.append(x.to(dtype).to(device))
    return out


def first_mismatch(quant: Quantizer1x128, device: torch.device) -> str:
    """'' when `quant` writes the reference's bytes and scale bits on every `probe_inputs` case, else the first
    difference found."""
    from ..quantize import quantize_fp8

    for x in probe_inputs(quant.dtype, device):
        ref = quantize_fp8(x, (1, 128), pow2_scale=quant.pow2, nonfinite="propagate")
        for alloc in (None, -(-x.shape[0] // 4) * 4):
            got = quant(x, alloc)
            rows = x.shape[0]
            data, scale = got.data[:rows], got.scale[:rows]
            nbad = int((data.view(torch.uint8) != ref.data.view(torch.uint8)).sum())
            sbad = int((scale.contiguous().view(torch.int32) != ref.scale.contiguous().view(torch.int32)).sum())
            if nbad or sbad:
                return f"{nbad} fp8 bytes and {sbad} scales differ from the reference at shape {tuple(x.shape)}"
    return ""
