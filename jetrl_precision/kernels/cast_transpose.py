"""CUDA requantizer 1x128 -> 128x1, written transposed (the WGrad input), compiled at first use with NVRTC.

Why CUDA and not Triton: the requantizer reads 1 byte and writes 1 byte per element, transposed. Triton
moves its FP8 tile between the load and the transposed-store layouts through shared memory, and no tile
setting of the sweep brings it near the copy bandwidth on the H200. Here each thread owns
32 consecutive tokens x 4 consecutive columns and loads one 32-bit word (4 columns) per token, so a warp
reads whole 128-byte rows and the amax along tokens needs no shuffle, only one cross-warp step in shared
memory. The e4m3x2 conversion packs the same column of two tokens into one 16-bit pair, so the transpose
costs no byte shuffling; the finished 16-token chunks are staged in shared memory (XOR-swizzled, free of
bank conflicts) so that each warp stores whole 128-byte output rows.

Arithmetic is the reference's step for step (see `_common.py`): x = fp32(q) * s in one plain multiply,
NaN-propagating amax floored at 1e-10, scale = amax / 448 (IEEE division), optional pow2 rounding, the
quotient as RN(1/scale) plus one FMA correction (none under pow2), and the satfinite e4m3 conversion.

Compilation goes through `torch.cuda._compile_kernel` (NVRTC, shipped with CUDA torch; it reads the CUDA
headers' folder, so a toolkit must be findable). Where it is missing or fails, `status()` says why and the
caller uses the Triton kernel (same bytes) after one warning.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import torch

from ..formats import FP8_DTYPE, QuantizedTensor
from .launch import launch_override

__all__ = ["requantize_1x128_to_128x1_t", "kernel_for", "launch", "supported_shape", "supported_layout", "status", "usable", "GRAPH_KERNEL",
           "KERNEL_NAME"]

logger = logging.getLogger(__name__)


_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float max_nan(float a, float b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

// Four e4m3 bytes (lowest byte = lowest column) -> four floats, exact (e4m3 is a subset of f16).
__device__ __forceinline__ void fp8x4_to_f32(u32 w, float v[4]) {
    u32 lo, hi;
    asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}"
        : "=r"(lo), "=r"(hi) : "r"(w));
    asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;\n}"
        : "=f"(v[0]), "=f"(v[1]) : "r"(lo));
    asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;\n}"
        : "=f"(v[2]), "=f"(v[3]) : "r"(hi));
}

// e4m3 of two floats, saturating (+-inf and |v| > 448 -> +-448, NaN stays NaN); `lo` lands in the low byte.
__device__ __forceinline__ u16 f32x2_to_fp8x2(float lo, float hi) {
    u16 d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}

template <bool POW2>
__device__ __forceinline__ float group_scale(float amax) {
    float scale = __fdiv_rn(max_nan(amax, 1e-10f), 448.0f);
    if (POW2) {
        int bits = __float_as_int(scale);
        int expo = bits & 0x7F800000;
        int up = (bits & 0x7FFFFF) ? expo + 0x800000 : expo;
        scale = expo != 0x7F800000 ? __int_as_float(up) : 1.0f;
    }
    return scale;
}

template <bool POW2>
__device__ __forceinline__ float quotient(float x, float recip, float s_res) {
    float q = __fmul_rn(x, recip);
    if (!POW2) q = __fmaf_rn(-__fmaf_rn(q, s_res, -x), recip, q);  // one correction: RN(x / scale) (Markstein)
    return q;
}

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
_kernels: dict[tuple[int, bool], "_Kernel"] = {}
_failed: dict[int, str] = {}


class _Kernel:
    """A compiled kernel with a lean launcher: torch's `_CudaKernel.__call__` re-opens libcuda and converts
    every argument on each call, which doubles the host time per launch. Here each thread keeps one ctypes
    argument block per kernel and refills it (cuLaunchKernel copies the arguments before it returns)."""

    _launch = None
    N_PTRS, N_INTS = 4, 7

    def __init__(self, compiled, name: str, device_index: int) -> None:
        self.compiled = compiled  # keeps torch's handle (and its module) alive
        self.func = compiled.func
        self.name = name
        self.device_index = device_index
        self._local = threading.local()
        if _Kernel._launch is None:
            fn = _libcuda().cuLaunchKernel
            fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _Kernel._launch = fn

    def _args(self):
        block = getattr(self._local, "block", None)
        if block is None:
            ptrs = (ctypes.c_void_p * self.N_PTRS)()
            ints = (ctypes.c_int * self.N_INTS)()
            argv = (ctypes.c_void_p * (self.N_PTRS + self.N_INTS))(
                *[ctypes.addressof(ptrs) + i * ctypes.sizeof(ctypes.c_void_p) for i in range(self.N_PTRS)],
                *[ctypes.addressof(ints) + i * ctypes.sizeof(ctypes.c_int) for i in range(self.N_INTS)],
            )
            block = self._local.block = (ptrs, ints, argv, ctypes.addressof(argv))
        return block

    def __call__(self, grid: tuple[int, int], threads: int, tensors: tuple[torch.Tensor, ...], ints: tuple[int, ...]) -> None:
        override = launch_override()
        if override is not None:
            override(self.name, grid, (*tensors, *ints), {"threads": threads})
            return
        ptr_block, int_block, _, argv = self._args()
        for i, t in enumerate(tensors):
            ptr_block[i] = t.data_ptr()
        for i, v in enumerate(ints):
            int_block[i] = v
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        rc = _Kernel._launch(self.func, grid[0], grid[1], 1, threads, 1, 1, 0, stream, argv, None)
        if rc == _CUDA_ERROR_INVALID_CONTEXT:
            # A thread with no current context yet (autograd's backward threads start so; the driver API does not
            # pick the primary context by itself the way the runtime does): make it current, launch again.
            _make_primary_context_current()
            rc = _Kernel._launch(self.func, grid[0], grid[1], 1, threads, 1, 1, 0, stream, argv, None)
        if rc != 0:
            raise RuntimeError(f"jetrl_precision: cuLaunchKernel of the CUDA requantizer failed (CUresult {rc})")


_CUDA_ERROR_INVALID_CONTEXT = 201


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _make_primary_context_current() -> None:
    lib = _libcuda()
    dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
    rc = lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(torch.cuda.current_device()))
    rc = rc or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    rc = rc or lib.cuCtxSetCurrent(ctx)
    if rc != 0:
        raise RuntimeError(f"jetrl_precision: could not make the primary CUDA context current (CUresult {rc})")


def _compile(device_index: int, pow2: bool) -> _Kernel:
    key = (device_index, pow2)
    with _lock:
        if key not in _kernels:
            with torch.cuda.device(device_index):
                name = f"requant_1x128_to_128x1_t<{'true' if pow2 else 'false'}>"
                _kernels[key] = _Kernel(torch.cuda._compile_kernel(_SOURCE, name), KERNEL_NAME, device_index)
        return _kernels[key]


def status(device: torch.device) -> tuple[bool, str]:
    """(usable, reason): compiles both kernels (plain and pow2 scales) once per device; the reason names what
    is missing."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "not a CUDA device"
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(idx) < (8, 9):
        return False, "needs sm89+ (e4m3 conversion instructions)"
    if idx in _failed:
        return False, _failed[idx]
    if not hasattr(torch.cuda, "_compile_kernel"):
        _failed[idx] = f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC); needs torch >= 2.8"
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


def kernel_for(device: torch.device, pow2_scale: bool) -> _Kernel:
    """The compiled kernel for `device` (compiled at first use); `status(device)` says whether that can work."""
    return _compile(device.index if device.index is not None else torch.cuda.current_device(), pow2_scale)


def launch(qt: QuantizedTensor, kern: _Kernel, pad_to: int = 0) -> QuantizedTensor:
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
