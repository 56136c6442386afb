"""CUDA requantizer 1x128 -> 128x1, written transposed (the WGrad input), compiled at first use with NVRTC.

Why CUDA and not Triton: the requantizer reads 1 byte and writes 1 byte per element, transposed. Triton
moves its FP8 tile between the load and the transposed-store layouts through shared memory, and no tile
setting of the sweep brings it near the copy bandwidth on the H200. Here each thread owns
32 consecutive tokens x 4 consecutive columns and loads one 32-bit word (4 columns) per token, so a warp
reads whole 128-byte rows and the amax along tokens needs no shuffle, only one cross-warp step in shared
memory. The e4m3x2 conversion packs the same column of two tokens into one 16-bit pair, so the transpose
costs no byte shuffling; the finished 16-token chunks are staged in shared memory (XOR-swizzled, free of
bank conflicts) so that each warp stores whole 128-byte output rows.

Arithmetic is the reference's step for step: x = fp32(q) * s in one plain multiply, then `nvrtc.DEVICE_FUNCTIONS`
(NaN-propagating amax, IEEE scale, the corrected quotient, the satfinite e4m3 conversion).

Compiled with NVRTC at first use (`nvrtc`). Where that is missing or fails, `status()` says why and the caller
uses the Triton kernel (same bytes) after one warning.
"""

from __future__ import annotations

import logging
import threading

import torch

from ..formats import FP8_DTYPE, QuantizedTensor
from .nvrtc import DEVICE_FUNCTIONS, NvrtcKernel, compile_kernel, unavailable_reason

__all__ = ["requantize_1x128_to_128x1_t", "kernel_for", "launch", "supported_shape", "supported_layout", "status", "usable", "GRAPH_KERNEL",
           "KERNEL_NAME"]

logger = logging.getLogger(__name__)


_SOURCE = DEVICE_FUNCTIONS + r"""
// One CTA = 128 tokens x 128 columns (one input 1x128 group wide), 4 warps. Warp w owns tokens [32w, 32w+32),
// lane l columns [4l, 4l+4): 32 words in flight per thread. Needs K % 4 == 0, a 4-byte-aligned input row stride
// and M % 16 == 0. (Slower on the H200: 16 tokens per thread, keeping the dequantized floats in registers
// instead of converting twice, a persistent cp.async-pipelined variant, and a row stride fixed at compile time
// under pow2 scales.)
template <bool POW2>
__global__ void __launch_bounds__(128)
requant_1x128_to_128x1_t(const u32* __restrict__ x, const float* __restrict__ s_in, u32* __restrict__ q,
                          float* __restrict__ s_out, int M, int K, int ldx_words, int s_row, int s_grp, int ldq,
                          int M_out) {
    constexpr int ROWS = 32, WARPS = 4, THREADS = 128;
    __shared__ float4 red[WARPS][32];
    __shared__ __align__(16) float fin[2][THREADS];  // per column: 1/scale, and the scale for the correction
    __shared__ uint4 tile[128][8];  // the output tile: 128 columns x 128 tokens of e4m3, 16-byte chunks
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Token blocks fastest: consecutive CTAs write neighbouring 128-byte pieces of the same output rows
    // (faster than column blocks fastest on the H200).
    const int tm = blockIdx.x * 128, tk = blockIdx.y * 128;
    const int k0 = tk + 4 * lane, m0 = tm + warp * ROWS;
    const bool col_ok = k0 < K;
    const u32* xp = x + (size_t)m0 * ldx_words + (k0 >> 2);
    const float* sp = s_in + (size_t)(tk >> 7) * s_grp + (size_t)m0 * s_row;

    u32 w[ROWS];
    float s[ROWS];
    if (m0 + ROWS <= M && col_ok) {  // interior: no predicates, all loads first
#pragma unroll
        for (int i = 0; i < ROWS; ++i) w[i] = __ldg(xp + (size_t)i * ldx_words);
    } else {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) w[i] = (m0 + i < M && col_ok) ? __ldg(xp + (size_t)i * ldx_words) : 0u;
    }
    if (s_row == 1 && m0 + ROWS <= M && ((size_t)sp & 15) == 0) {  // MN-major scales: 8 vector loads
#pragma unroll
        for (int i = 0; i < ROWS; i += 4) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(sp + i));
            s[i] = v.x; s[i + 1] = v.y; s[i + 2] = v.z; s[i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) s[i] = m0 + i < M ? __ldg(sp + (size_t)i * s_row) : 0.0f;
    }

    float amax[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        float v[4];
        fp8x4_to_f32(w[i], v);
#pragma unroll
        for (int j = 0; j < 4; ++j)  // the reference's dequantization: one plain fp32 multiply
            amax[j] = max_nan(amax[j], fabsf(__fmul_rn(v[j], s[i])));
    }
    red[warp][lane] = make_float4(amax[0], amax[1], amax[2], amax[3]);
    __syncthreads();
    {   // Thread t finishes column t alone (amax over the 4 warps, the scale, its reciprocal): once per column
        // instead of once per warp, since the IEEE division and reciprocal cost ~25 instructions each time.
        const float* redf = reinterpret_cast<const float*>(red);  // column c of warp r at [r * 128 + c]
        float a = redf[threadIdx.x];
#pragma unroll
        for (int r = 1; r < WARPS; ++r) a = max_nan(a, redf[r * THREADS + threadIdx.x]);
        const float sc = group_scale<POW2>(a);
        const float rc = __frcp_rn(sc);
        fin[0][threadIdx.x] = rc;
        fin[1][threadIdx.x] = rc == 0.0f ? 0.0f : sc;  // scale = inf: x / inf stays a signed zero
        if (tk + (int)threadIdx.x < K) s_out[(size_t)blockIdx.x * K + tk + threadIdx.x] = sc;
    }
    __syncthreads();
    float recip[4], s_res[4];
    {
        const float4 r4 = reinterpret_cast<const float4*>(fin[0])[lane];
        const float4 s4 = reinterpret_cast<const float4*>(fin[1])[lane];
        recip[0] = r4.x; recip[1] = r4.y; recip[2] = r4.z; recip[3] = r4.w;
        s_res[0] = s4.x; s_res[1] = s4.y; s_res[2] = s4.z; s_res[3] = s4.w;
    }

    // Column j of 16 tokens -> one 16-byte chunk (the e4m3x2 conversion packs two tokens of one column, so the
    // transpose costs no byte shuffling), staged in shared memory as soon as it is complete so that each warp
    // then stores whole 128-byte output rows: straight from registers a warp's 16-byte stores land in 32
    // different rows, which is much slower. Chunk c of row k sits at c ^ ((k >> 2) & 7): conflict-free
    // both ways (k >> 2 == lane when writing). The FP8 words are converted again rather than kept as floats.
#pragma unroll
    for (int c = 0; c < ROWS / 16; ++c) {
        u32 out[4][4];
#pragma unroll
        for (int i = 16 * c; i < 16 * c + 16; i += 2) {
            float a[4], b[4];
            fp8x4_to_f32(w[i], a);
            fp8x4_to_f32(w[i + 1], b);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 pair = f32x2_to_fp8x2(quotient<POW2>(__fmul_rn(a[j], s[i]), recip[j], s_res[j]),
                                                quotient<POW2>(__fmul_rn(b[j], s[i + 1]), recip[j], s_res[j]));
                if (i % 4 == 0) out[j][(i % 16) / 4] = pair;
                else out[j][(i % 16) / 4] |= pair << 16;
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
            tile[4 * lane + j][(warp * (ROWS / 16) + c) ^ (lane & 7)] = make_uint4(out[j][0], out[j][1], out[j][2], out[j][3]);
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < 1024 / THREADS; ++p) {
        const int idx = p * THREADS + threadIdx.x, row = idx >> 3, chunk = idx & 7;
        const int m = tm + 16 * chunk;
        // M % 16 == 0: a 16-token chunk is all in or all out. Tokens M..M_out-1 (output rows ldq long, padded for
        // the WGrad GEMM) store zeros: their tile entries are 0 / scale, NaN in a column whose scale is NaN.
        if (tk + row < K && m < M_out)
            *reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(q) + (size_t)(tk + row) * ldq + m) =
                m < M ? tile[row][chunk ^ ((row >> 2) & 7)] : make_uint4(0u, 0u, 0u, 0u);
    }
}
"""

# How the precision graph names this kernel on the WGrad input edge. A batch whose token count is not a multiple
# of 16 takes the Triton kernel instead (same bytes), which the graph, built from the modules, cannot know.
GRAPH_KERNEL = "cuda:cast_transpose"
KERNEL_NAME = "requant_1x128_to_128x1_t"  # what `launch.override_launches` receives

_lock = threading.Lock()
_usable: dict[str, bool] = {}
_kernels: dict[tuple[int, bool], NvrtcKernel] = {}
_failed: dict[int, str] = {}


def _compile(device_index: int, pow2: bool) -> NvrtcKernel:
    key = (device_index, pow2)
    with _lock:
        if key not in _kernels:
            name = f"requant_1x128_to_128x1_t<{'true' if pow2 else 'false'}>"
            _kernels[key] = compile_kernel(_SOURCE, name, KERNEL_NAME, device_index, 4, 7)
        return _kernels[key]


def status(device: torch.device) -> tuple[bool, str]:
    """(usable, reason): compiles both kernels (plain and pow2 scales) once per device; the reason names what
    is missing."""
    why = unavailable_reason(device)
    if why is not None:
        return False, why
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _failed:
        return False, _failed[idx]
    try:
        for pow2 in (False, True):
            _compile(idx, pow2)
    except Exception as e:  # noqa: BLE001 - any compile/load failure means "use Triton", reported once
        _failed[idx] = f"NVRTC compile failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        return False, _failed[idx]
    return True, "ok"


def usable(device: torch.device) -> bool:
    """`status(device)[0]`, cached; the first "no" on a CUDA device is logged as a warning with its reason."""
    key = str(device)
    if key not in _usable:
        device = torch.device(device)
        ok, why = status(device)
        _usable[key] = ok
        if not ok and device.type == "cuda":
            logger.warning(
                "jetrl_precision: the CUDA requantizer (1x128 -> 128x1^T, the WGrad input) is unavailable on %s: %s. "
                "Using the Triton requantizer instead: same bytes, slower.", device, why,
            )
    return _usable[key]


def supported_shape(qt: QuantizedTensor) -> bool:
    """The inputs the kernel handles: a CUDA tensor whose layout `supported_layout` accepts."""
    return qt.data.is_cuda and supported_layout(qt)


def supported_layout(qt: QuantizedTensor) -> bool:
    """The layouts the kernel handles (any device): 1x128 groups, contiguous columns, 4-byte rows, M % 16 == 0
    (16-byte stores), sizes and strides that fit the kernel's 32-bit int arguments."""
    d = qt.data
    rows, cols = d.shape
    ints = (rows, cols, d.stride(0), *qt.scale.stride())
    return (
        qt.block == (1, 128) and d.stride(1) == 1 and cols % 4 == 0 and d.stride(0) % 4 == 0
        and d.data_ptr() % 4 == 0 and rows % 16 == 0 and rows > 0 and cols > 0 and qt.scale.dtype == torch.float32
        and qt.scale.device == d.device and max(ints) < 2**31 and cols <= 65535 * 128  # grid.y = column blocks
    )


def requantize_1x128_to_128x1_t(qt: QuantizedTensor, pow2_scale: bool = False, pad_to: int = 0) -> QuantizedTensor:
    """requantize_fp8(qt, (128, 1)).t(): data [K, M] e4m3, scales (K, ceil(M/128)) with strides (1, K); `pad_to`
    (a multiple of 128) zero-pads the data's columns to a multiple of it in the same pass."""
    if not supported_shape(qt):
        raise ValueError(
            f"the CUDA requantizer needs a 1x128 CUDA input with contiguous columns, K % 4 == 0 and M % 16 == 0; "
            f"got block {qt.block}, shape {tuple(qt.shape)}, strides {qt.data.stride()} "
            f"(quant.requantize_1x128_to_128x1 takes any shape and falls back to Triton)"
        )
    if pad_to > 1 and pad_to % 128:
        raise ValueError(f"pad_to must be a multiple of 128, got {pad_to}")
    return launch(qt, kernel_for(qt.data.device, pow2_scale), pad_to)


def kernel_for(device: torch.device, pow2_scale: bool) -> NvrtcKernel:
    """The compiled kernel for `device` (compiled at first use); `status(device)` says whether that can work."""
    return _compile(device.index if device.index is not None else torch.cuda.current_device(), pow2_scale)


def launch(qt: QuantizedTensor, kern: NvrtcKernel, pad_to: int = 0) -> QuantizedTensor:
    """`requantize_1x128_to_128x1_t` without its checks, for callers that checked `supported_shape` already
    (a layer's step plan, once per input layout)."""
    data, s_in = qt.data, qt.scale
    rows, cols = data.shape
    dev = data.device
    nrb = -(-rows // 128)
    rows_out = -(-rows // pad_to) * pad_to if pad_to > 1 else rows  # within the last 128-token block
    q = torch.empty((cols, rows_out), dtype=FP8_DTYPE, device=dev)
    # The kernel writes a row-major (nrb, K) buffer: the logical (K, nrb) scale with strides (1, K).
    scale = torch.empty_strided((cols, nrb), (1, cols), dtype=torch.float32, device=dev)
    kern((nrb, -(-cols // 128)), 128, (data, s_in, q, scale), (rows, cols, data.stride(0) // 4, *s_in.stride(), rows_out, rows_out))
    return QuantizedTensor.trusted(q, scale, (1, 128))
