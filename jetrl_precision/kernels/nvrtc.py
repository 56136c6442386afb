"""CUDA kernels compiled at first use with NVRTC, and a launcher with little host time per call.

Shared by the CUDA quantizers (`cast_transpose`: the WGrad requantizer; `quant_cuda`: the 1x128 activation
quantizer). `DEVICE_FUNCTIONS` is the reference quantizer's arithmetic in CUDA, step for step (see `_common.py` for
the Triton twin): NaN-propagating amax floored at 1e-10, scale = amax / 448 (IEEE division), optional pow2
rounding, the quotient as RN(1/scale) plus one FMA correction (none under pow2), and the satfinite e4m3
conversion.

Compilation goes through `torch.cuda._compile_kernel` (NVRTC, shipped with CUDA torch; it reads the CUDA headers'
folder, so a toolkit must be findable). `unavailable_reason` names what is missing.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from .launch import launch_override

__all__ = ["DEVICE_FUNCTIONS", "NvrtcKernel", "unavailable_reason", "compile_kernel", "make_primary_context_current"]

DEVICE_FUNCTIONS = r"""
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
"""

_CUDA_ERROR_INVALID_CONTEXT = 201


def unavailable_reason(device: torch.device) -> str | None:
    """Why NVRTC kernels cannot run on `device`, or None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(idx) < (8, 9):
        return "needs sm89+ (e4m3 conversion instructions)"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC); needs torch >= 2.8"
    return None


def compile_kernel(source: str, name: str, launch_name: str, device_index: int, n_ptrs: int, n_ints: int) -> "NvrtcKernel":
    """Compile `name` (a kernel of `source`, template arguments included) for `device_index`."""
    with torch.cuda.device(device_index):
        return NvrtcKernel(torch.cuda._compile_kernel(source, name), launch_name, device_index, n_ptrs, n_ints)


class NvrtcKernel:
    """A compiled kernel with a lean launcher: torch's `_CudaKernel.__call__` re-opens libcuda and converts
    every argument on each call, which doubles the host time per launch. Here each thread keeps one ctypes
    argument block per kernel and refills it (cuLaunchKernel copies the arguments before it returns).

    `kern(grid, threads, tensors, ints)`: `n_ptrs` tensors (their data pointers) then `n_ints` 32-bit ints. While
    `launch.override_launches` is active the launch goes to its function under `name` instead (CPU host-cost
    measurements)."""

    _launch = None

    def __init__(self, compiled, name: str, device_index: int, n_ptrs: int, n_ints: int) -> None:
        self.compiled = compiled  # keeps torch's handle (and its module) alive
        self.func = compiled.func
        self.name = name
        self.device_index = device_index
        self.n_ptrs, self.n_ints = n_ptrs, n_ints
        self._local = threading.local()
        if NvrtcKernel._launch is None:
            fn = _libcuda().cuLaunchKernel
            fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            NvrtcKernel._launch = fn

    def _args(self):
        block = getattr(self._local, "block", None)
        if block is None:
            ptrs = (ctypes.c_void_p * self.n_ptrs)()
            ints = (ctypes.c_int * self.n_ints)()
            argv = (ctypes.c_void_p * (self.n_ptrs + self.n_ints))(
                *[ctypes.addressof(ptrs) + i * ctypes.sizeof(ctypes.c_void_p) for i in range(self.n_ptrs)],
                *[ctypes.addressof(ints) + i * ctypes.sizeof(ctypes.c_int) for i in range(self.n_ints)],
            )
            block = self._local.block = (ptrs, ints, argv, ctypes.addressof(argv))
        return block

    def __call__(self, grid: tuple[int, int], threads: int, tensors: tuple[torch.Tensor, ...], ints: tuple[int, ...],
                 meta: dict | None = None) -> None:
        override = launch_override()
        if override is not None:
            override(self.name, grid, (*tensors, *ints), {"threads": threads, **(meta or {})})
            return
        ptr_block, int_block, _, argv = self._args()
        for i, t in enumerate(tensors):
            ptr_block[i] = t.data_ptr()
        for i, v in enumerate(ints):
            int_block[i] = v
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        rc = NvrtcKernel._launch(self.func, grid[0], grid[1], 1, threads, 1, 1, 0, stream, argv, None)
        if rc == _CUDA_ERROR_INVALID_CONTEXT:
            # A thread with no current context yet (autograd's backward threads start so; the driver API does not
            # pick the primary context by itself the way the runtime does): make it current, launch again.
            make_primary_context_current(self.device_index)
            rc = NvrtcKernel._launch(self.func, grid[0], grid[1], 1, threads, 1, 1, 0, stream, argv, None)
        if rc != 0:
            raise RuntimeError(f"jetrl_precision: cuLaunchKernel of {self.name} failed (CUresult {rc})")


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def make_primary_context_current(device_index: int) -> None:
    """Make the device's primary context current on this thread (the driver API does not pick it by itself)."""
    lib = _libcuda()
    dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
    rc = lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(device_index))
    rc = rc or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    rc = rc or lib.cuCtxSetCurrent(ctx)
    if rc != 0:
        raise RuntimeError(f"jetrl_precision: could not make the primary CUDA context current (CUresult {rc})")
