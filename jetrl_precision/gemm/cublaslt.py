"""cuBLASLt's blockwise FP8 GEMM with its descriptors, layouts and algorithm chosen once per shape.

torch's scaled_mm rebuilds everything on each call (`scaled_gemm` in ATen's CUDABlas.cpp): a matmul descriptor
(compute 32F, scale 32F), TRANSA/TRANSB, both scale pointers, FAST_ACCUM = 0, both scale modes, four matrix
layouts (C typed like D), a preference capped at torch's cuBLASLt workspace size, one heuristic query, then
`cublasLtMatmul`. An `LtBlockwiseGemm` builds the same
objects with the same values once per (M, N, K, output dtype) and per call only sets the two scale pointers and
calls `cublasLtMatmul`, in the library torch loaded: same descriptors, same heuristic inputs, so the same algorithm
and the same bits. `blockwise_gemm(device, ...)` checks that bit for bit against `F.scaled_mm` at first use
(`_probe.verdict_once`) and returns None otherwise; callers then keep torch's entry point.

Opt-in (`JETRL_CUBLASLT_PLAN=1`), because it did not pay (benchmarks/host_probe_engine.py, M = 64, N = K = 4096,
calls queued behind a sleep kernel, H100 and H200 hosts): a plan's call costs what `torch._scaled_mm` costs (min /
median 25.6 / 35.9 us against 24.2 / 36.3 on one H100 host), and `cublasLtMatmul` alone, every descriptor made and
the output preallocated, 12.0 / 17.9 us of it: the library's own host work, not torch's descriptor building, is the
bulk of an FP8 GEMM call's host time.

Operands are those of torch's row-major product out[M, N] = a[M, K] @ b_t[K, N], with a contiguous and b_t the
transpose of a contiguous [N, K]: torch (`cublasCommonArgs`) runs it column-major as out^T = b_t^T @ a^T, so
cuBLAS's A is b (transposed), its B is a, and the scale pointers and modes swap with them.

The enum values below are cublasLt.h's (CUDA 12.9-13.1); a library older than 12.9 has no blockwise scale modes and
is refused.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from typing import Callable

import torch

from ..kernels._probe import device_key, verdict_once

__all__ = ["LtBlockwiseGemm", "blockwise_gemm", "call_status", "unavailable_reason", "lt_workspace_bytes", "SCALE_MODES"]

logger = logging.getLogger(__name__)

# cublasLtMatmulMatrixScale_t for the two block recipes (operand's groups along K)
SCALE_MODES = {"1x128": 4, "128x128": 5}  # VEC128_32F, BLK128x128_32F
# cudaDataType_t
_CUDA_TYPE = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}
_E4M3, _E5M2 = 28, 29
_COMPUTE_32F, _R_32F = 68, 0  # cublasComputeType_t, cudaDataType_t of alpha/beta
_OP_N, _OP_T = 0, 1
# cublasLtMatmulDescAttributes_t
_TRANSA, _TRANSB, _A_SCALE_POINTER, _B_SCALE_POINTER, _FAST_ACCUM, _A_SCALE_MODE, _B_SCALE_MODE = 3, 4, 17, 18, 25, 31, 32
_PREF_MAX_WORKSPACE_BYTES = 1
_MIN_VERSION = 120900  # blockwise scale modes
_EXECUTION_FAILED = 13  # CUBLAS_STATUS_EXECUTION_FAILED: what a launch from a thread with no current context returns
_HEURISTIC_BYTES = 96  # cublasLtMatmulHeuristicResult_t: algo (64 B), workspaceSize, state, wavesCount, reserved[4]
_MAX_PLANS = 1024  # per GEMM object; packed batches vary M, so the table is bounded


def _fp8_type(dtype: torch.dtype) -> int:
    return _E5M2 if dtype == torch.float8_e5m2 else _E4M3


def lt_workspace_bytes(device: torch.device) -> int:
    """The workspace cap torch gives cuBLASLt's heuristic (`getCUDABlasLtWorkspaceSize`, torch 2.6-2.13):
    CUBLASLT_WORKSPACE_SIZE KiB (default 1024), capped at the cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG, default
    32 MiB on sm90, 8.125 MiB elsewhere) unless TORCH_CUBLASLT_UNIFIED_WORKSPACE is off. The heuristic's choice
    depends on it, so the plan must ask with the same cap to get torch's algorithm."""
    try:
        lt = int(os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    except ValueError:
        lt = 1024 * 1024  # torch warns and uses its default too
    unified = os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1").strip().lower() not in ("0", "false", "off", "no")
    if unified:
        lt = min(lt, _cublas_workspace_bytes(device))
    return lt


def _cublas_workspace_bytes(device: torch.device) -> int:
    cfg = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if cfg:
        total, parts = 0, [p for p in cfg.split(":") if p]
        for size_kib, count in zip(parts[::2], parts[1::2]):
            try:
                total += int(size_kib) * 1024 * int(count)
            except ValueError:
                total = 0
                break
        if total:
            return total
    major_minor = torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)
    return 4096 * 8 * 1024 if major_minor == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


# -- the library -----------------------------------------------------------------------------------------------
_SIGNATURES = {
    # name: (argtypes, all returning cublasStatus_t); pointers and out-parameters are passed as integer addresses
    "cublasLtGetVersion": ([],),
    "cublasLtCreate": ([ctypes.c_void_p],),
    "cublasLtMatmulDescCreate": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int],),
    "cublasLtMatmulDescDestroy": ([ctypes.c_void_p],),
    "cublasLtMatmulDescSetAttribute": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t],),
    "cublasLtMatrixLayoutCreate": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],),
    "cublasLtMatrixLayoutDestroy": ([ctypes.c_void_p],),
    "cublasLtMatmulPreferenceCreate": ([ctypes.c_void_p],),
    "cublasLtMatmulPreferenceDestroy": ([ctypes.c_void_p],),
    "cublasLtMatmulPreferenceSetAttribute": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t],),
    "cublasLtMatmulAlgoGetHeuristic": ([ctypes.c_void_p] * 7 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p],),
    "cublasLtMatmul": ([ctypes.c_void_p] * 14 + [ctypes.c_size_t, ctypes.c_void_p],),
}


def _loaded_path() -> str | None:
    """The libcublasLt torch loaded: its heuristic and kernels are what F.scaled_mm runs."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcublasLt.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None


@functools.cache
def _library():
    """(the library's functions, its version) or the reason it cannot be used."""
    path = _loaded_path()
    names = [path] if path else ["libcublasLt.so.13", "libcublasLt.so.12"]
    lib, err = None, ""
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError as e:
            err = str(e)
    if lib is None:
        return f"libcublasLt could not be loaded ({err})"
    fns = {}
    for name, (argtypes,) in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            return f"{path or names[0]} has no {name}"
        fn.argtypes = argtypes
        fn.restype = ctypes.c_size_t if name == "cublasLtGetVersion" else ctypes.c_int
        fns[name] = fn
    version = int(fns["cublasLtGetVersion"]())
    if version < _MIN_VERSION:
        return f"cuBLASLt {version} has no blockwise scale modes (needs >= {_MIN_VERSION})"
    return _Lib(fns, version)


class _Lib:
    """The C functions by name (`lib.cublasLtMatmul(...)`): the real library's, or an emulation's on CPU."""

    def __init__(self, fns: dict[str, Callable], version: int) -> None:
        self.__dict__.update(fns)
        self.version = version


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"jetrl_precision: {what} failed (cublasStatus_t {rc})")


def _out(ctype=ctypes.c_void_p):
    v = ctype()
    return v, ctypes.addressof(v)


class _Plan:
    """One shape's descriptor, layouts and algorithm, with the scale-pointer cells the descriptor is set from.
    `result` holds the heuristic's `found` results back to back; `algo` is the address of the one the plan runs."""

    __slots__ = ("desc", "layouts", "result", "found", "algo", "ptr_a", "ptr_b", "addr_a", "addr_b", "lock")

    def __init__(self) -> None:
        self.desc, self.layouts, self.result, self.found, self.algo = 0, (), None, 0, 0
        self.ptr_a, self.addr_a = _out(ctypes.c_uint64)
        self.ptr_b, self.addr_b = _out(ctypes.c_uint64)
        self.lock = threading.Lock()  # the descriptor holds this call's scale pointers until cublasLtMatmul returns


class LtBlockwiseGemm:
    """fn(a, b_t, sa, sb, out_dtype) -> a @ b_t for FP8 `a` [M, K] (contiguous) with groups `block_a` along K and
    `b_t` [K, N] (the transpose of a contiguous [N, K]) with groups `block_b`, the scales in the layouts torch's
    scaled_mm takes for those recipes (sa MN-major; sb MN-major for 1x128, `row_major_padded_t` for 128x128).

    The plan of a shape is made by its first call from that call's operands; later calls of the shape must pass
    the same layouts (the prepared paths that use this always do)."""

    def __init__(self, device: torch.device, block_a: str, block_b: str, lib=None, stream: Callable[[], int] | None = None,
                 workspace_bytes: int | None = None) -> None:
        self.device = torch.device(device)
        self.block_a, self.block_b = block_a, block_b
        self.lib = lib if lib is not None else _library()
        if isinstance(self.lib, str):
            raise RuntimeError(f"jetrl_precision: cuBLASLt plans are unavailable: {self.lib}")
        index = self.device.index if self.device.index is not None else (torch.cuda.current_device() if self.device.type == "cuda" else -1)
        self._stream = stream or functools.partial(torch._C._cuda_getCurrentRawStream, index)
        self.ws_bytes = lt_workspace_bytes(self.device) if workspace_bytes is None else int(workspace_bytes)
        self._plans: dict[tuple, _Plan] = {}
        self._workspaces: dict[int, torch.Tensor] = {}  # stream -> workspace
        self._ws_ptrs: dict[int, int] = {}  # stream -> its address
        self._lock = threading.Lock()
        self._threads = threading.local()
        handle, addr = _out()
        _check(self.lib.cublasLtCreate(addr), "cublasLtCreate")
        self.handle = handle.value
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._alpha_addr, self._beta_addr = ctypes.addressof(self._alpha), ctypes.addressof(self._beta)

    def __call__(self, a: torch.Tensor, b_t: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        m, k = a.shape
        n = b_t.shape[1]
        plan = self._plans.get((m, n, k, out_dtype)) or self._plan(a, b_t, sa, sb, out_dtype)
        out = torch.empty((m, n), dtype=out_dtype, device=self.device)
        out_ptr = out.data_ptr()
        stream = self._stream()
        ws = self._ws_ptrs.get(stream) or self._workspace(stream)
        lib = self.lib
        with plan.lock:
            # cuBLAS's A is b (its scales sb), its B is a (see the module docstring)
            plan.ptr_a.value = sb.data_ptr()
            plan.ptr_b.value = sa.data_ptr()
            lib.cublasLtMatmulDescSetAttribute(plan.desc, _A_SCALE_POINTER, plan.addr_a, 8)
            lib.cublasLtMatmulDescSetAttribute(plan.desc, _B_SCALE_POINTER, plan.addr_b, 8)
            la, lb, lc, ld = plan.layouts
            rc = lib.cublasLtMatmul(self.handle, plan.desc, self._alpha_addr, b_t.data_ptr(), la, a.data_ptr(), lb, self._beta_addr,
                                    out_ptr, lc, out_ptr, ld, plan.algo, ws, self.ws_bytes, stream)
        if rc == _EXECUTION_FAILED and not self._thread_ready():
            # A thread without a current CUDA context (a plain Python thread; torch's own threads set the device)
            # fails the launch: make the primary context current, then run the call again.
            return self(a, b_t, sa, sb, out_dtype)
        if rc != 0:
            raise RuntimeError(f"jetrl_precision: cublasLtMatmul failed (cublasStatus_t {rc}) for M={m} N={n} K={k} "
                               f"{self.block_a} x {self.block_b} -> {out_dtype}")
        return out

    def _thread_ready(self) -> bool:
        """False once per thread that had no current context, after making the primary context current."""
        if getattr(self._threads, "ready", False) or self.device.type != "cuda":
            return True
        self._threads.ready = True
        from ..kernels.nvrtc import make_primary_context_current

        make_primary_context_current(self.device.index if self.device.index is not None else torch.cuda.current_device())
        return False

    # -- plans ------------------------------------------------------------------------------------------------
    def _plan(self, a, b_t, sa, sb, out_dtype, count: int = 1) -> _Plan:
        m, k = a.shape
        n = b_t.shape[1]
        if not a.is_contiguous() or b_t.stride(0) != 1 or b_t.stride(1) != k:
            raise ValueError(f"LtBlockwiseGemm: a must be contiguous [M, K] and b_t the transpose of a contiguous [N, K]; got strides "
                             f"{tuple(a.stride())} and {tuple(b_t.stride())}")
        if out_dtype not in _CUDA_TYPE:
            raise ValueError(f"LtBlockwiseGemm: output dtype {out_dtype} is not supported; use bfloat16, float16 or float32")
        plan = _Plan()
        try:
            plan.result, plan.found = self._build(plan, m, n, k, a.dtype, b_t.dtype, sa, sb, out_dtype, count)
        except BaseException:
            self._destroy(plan)
            raise
        # the algorithm is the heuristic result's first 64 bytes: the plan keeps the buffer and passes its address
        plan.algo = ctypes.addressof(plan.result)
        with self._lock:
            replaced = self._plans.pop((m, n, k, out_dtype), None)  # `offer_algorithms` re-plans a shape
            self._plans[(m, n, k, out_dtype)] = plan
            while len(self._plans) > _MAX_PLANS:
                self._retire(self._plans.pop(next(iter(self._plans))))
            if replaced is not None:
                self._retire(replaced)
        return plan

    def _retire(self, plan: _Plan) -> None:
        """Destroy a plan dropped from the table once a call running it has returned (it holds the plan's lock)."""
        with plan.lock:
            self._destroy(plan)

    def _build(self, plan: _Plan, m: int, n: int, k: int, a_dtype, b_dtype, sa, sb, out_dtype, count: int = 1):
        """Descriptor, layouts and the heuristic's algorithms (its first `count`; torch asks for one), as torch's
        scaled_gemm makes them; returns the results buffer and how many the heuristic filled."""
        lib = self.lib
        desc, addr = _out()
        _check(lib.cublasLtMatmulDescCreate(addr, _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
        plan.desc = desc.value
        plan.ptr_a.value, plan.ptr_b.value = sb.data_ptr(), sa.data_ptr()
        for attr, cell in (
            (_TRANSA, ctypes.c_int32(_OP_T)), (_TRANSB, ctypes.c_int32(_OP_N)),
            (_A_SCALE_POINTER, plan.ptr_a), (_B_SCALE_POINTER, plan.ptr_b),
            (_FAST_ACCUM, ctypes.c_int8(0)),
            (_A_SCALE_MODE, ctypes.c_int32(SCALE_MODES[self.block_b])), (_B_SCALE_MODE, ctypes.c_int32(SCALE_MODES[self.block_a])),
        ):
            _check(lib.cublasLtMatmulDescSetAttribute(plan.desc, attr, ctypes.addressof(cell), ctypes.sizeof(cell)),
                   "cublasLtMatmulDescSetAttribute")
        # column-major: A = b stored K x N (ld K, op T), B = a stored K x M (ld K), C and D N x M (ld N); C typed as D
        # (torch types C as the bias dtype, which is the output dtype when there is no bias)
        for dtype, rows, cols, ld in ((_fp8_type(b_dtype), k, n, k), (_fp8_type(a_dtype), k, m, k),
                                      (_CUDA_TYPE[out_dtype], n, m, n), (_CUDA_TYPE[out_dtype], n, m, n)):
            layout, addr = _out()
            _check(lib.cublasLtMatrixLayoutCreate(addr, dtype, rows, cols, ld), "cublasLtMatrixLayoutCreate")
            plan.layouts += (layout.value,)
        pref, addr = _out()
        _check(lib.cublasLtMatmulPreferenceCreate(addr), "cublasLtMatmulPreferenceCreate")
        try:
            cap = ctypes.c_uint64(self.ws_bytes)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref.value, _PREF_MAX_WORKSPACE_BYTES, ctypes.addressof(cap), 8),
                   "cublasLtMatmulPreferenceSetAttribute")
            result = (ctypes.c_uint8 * (_HEURISTIC_BYTES * count))()
            found, found_addr = _out(ctypes.c_int)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, plan.desc, *plan.layouts, pref.value, count,
                                                      ctypes.addressof(result), found_addr), "cublasLtMatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref.value)
        if found.value < 1:
            raise RuntimeError(f"jetrl_precision: cuBLASLt has no algorithm for M={m} N={n} K={k} {self.block_a} x {self.block_b}")
        return result, found.value

    # -- algorithm choice (benchmarks/cublaslt_algos_gpu.py) ------------------------------------------------------
    def offer_algorithms(self, a, b_t, sa, sb, out_dtype: torch.dtype, count: int = 16) -> list[dict]:
        """Re-plan this call's shape with the heuristic's first `count` algorithms (the plan keeps running the first,
        the one torch would pick) and describe each: its index, workspace bytes and the heuristic's waves count.
        The shape's old plan is destroyed: call it before other threads run the shape, as a benchmark does."""
        if count < 1:
            raise ValueError(f"LtBlockwiseGemm.offer_algorithms: count must be >= 1, got {count}")
        plan = self._plan(a, b_t, sa, sb, out_dtype, count)
        base = ctypes.addressof(plan.result)
        return [{"index": i, "workspace_bytes": ctypes.c_uint64.from_address(base + i * _HEURISTIC_BYTES + 64).value,
                 "waves": round(ctypes.c_float.from_address(base + i * _HEURISTIC_BYTES + 76).value, 3)}
                for i in range(plan.found)]

    def use_algorithm(self, m: int, n: int, k: int, out_dtype: torch.dtype, index: int) -> None:
        """Run the shape's `index`-th offered algorithm from now on (`offer_algorithms` first)."""
        plan = self._plans.get((m, n, k, out_dtype))
        if plan is None or not 0 <= index < plan.found:
            offered = 0 if plan is None else plan.found
            raise ValueError(f"LtBlockwiseGemm.use_algorithm: M={m} N={n} K={k} {out_dtype} has {offered} offered algorithms, "
                             f"no index {index}; call offer_algorithms for the shape first")
        with plan.lock:
            plan.algo = ctypes.addressof(plan.result) + index * _HEURISTIC_BYTES

    def _destroy(self, plan: _Plan) -> None:
        for layout in plan.layouts:
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        if plan.desc:
            self.lib.cublasLtMatmulDescDestroy(plan.desc)
        plan.layouts, plan.desc = (), 0

    def _workspace(self, stream: int) -> int:
        # one per stream, as torch keeps one per (handle, stream): kernels on two streams must not share it
        with self._lock:
            if stream not in self._ws_ptrs:
                ws = self._workspaces[stream] = torch.empty(max(self.ws_bytes, 256), dtype=torch.uint8, device=self.device)
                self._ws_ptrs[stream] = ws.data_ptr()
        return self._ws_ptrs[stream]

    @property
    def plan_count(self) -> int:
        return len(self._plans)


# -- availability ---------------------------------------------------------------------------------------------
_verdicts: dict[tuple, bool] = {}
_reasons: dict[tuple, str] = {}
_gemms: dict[tuple, LtBlockwiseGemm] = {}


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why plans cannot run on `device` (None: they may; `blockwise_gemm` still checks their bits)."""
    device = torch.device(device)
    if not _asked():
        return "not asked for (JETRL_CUBLASLT_PLAN=1 turns the plans on)"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"needs a CUDA device, got {device}"
    lib = _library()
    return lib if isinstance(lib, str) else None


def blockwise_gemm(device: torch.device | str, block_a: str, block_b: str) -> LtBlockwiseGemm | None:
    """The per-shape-plan GEMM for `block_a` x `block_b` on `device`, or None: not asked for (silently), or no CUDA or
    library, or its first-use check found other bits than F.scaled_mm's (each warned once)."""
    if not _asked():
        return None
    device = torch.device(device)
    key = (device_key(device), block_a, block_b)
    gemm = _gemms.get(key)
    if gemm is not None:
        return gemm

    def check() -> str:
        reason = unavailable_reason(device)
        if reason:
            return reason
        gemm = LtBlockwiseGemm(device, block_a, block_b)
        why = _compare_with_torch(gemm, device, block_a, block_b)
        if not why:
            _gemms[key] = gemm
        return why

    def warn(why: str) -> None:
        logger.warning("jetrl_precision: cuBLASLt GEMM plans not used on %s for %s x %s (%s); torch's scaled_mm entry point is "
                       "used (same bits, more host time per call)", device, block_a, block_b, why)

    verdict_once(_verdicts, _reasons, key, check, warn)
    return _gemms.get(key)


def _asked() -> bool:
    return os.environ.get("JETRL_CUBLASLT_PLAN", "0").strip() == "1"


def call_status(device: torch.device | str) -> str:
    """What the torch backend's prepared GEMMs call on `device`, for precision graphs and logs: 'torch.scaled_mm'
    (the default), 'native_plan' (the C++ extension's, JETRL_NATIVE_GEMM=1, asked for and checked), 'cublaslt_plan'
    (asked for and checked), or 'torch.scaled_mm (why the plans asked for are not used)'. Same bits either way."""
    from . import cublaslt_native

    device = torch.device(device)
    why: list[str | None] = []
    for status, asked, gemm_for, reasons, unavailable in (
        ("native_plan", cublaslt_native._asked(), lambda b: cublaslt_native.blockwise_gemm(device, "1x128", b, _unused),
         cublaslt_native._reasons, cublaslt_native.unavailable_reason),
        ("cublaslt_plan", _asked(), lambda b: blockwise_gemm(device, "1x128", b), _reasons, unavailable_reason),
    ):
        if not asked:
            continue
        missing = [b for b in ("128x128", "1x128") if gemm_for(b) is None]
        if not missing:
            return status
        why += [reasons.get((device_key(device), "1x128", b)) or unavailable(device) for b in missing]
    return f"torch.scaled_mm ({'; '.join(sorted({w for w in why if w}))})" if why else "torch.scaled_mm"


def _unused(*args):  # call_status asks only whether the native GEMM is there, it never calls it
    raise AssertionError("not called")


# (M, N, K): decode-sized and prefill-sized M, K long enough for split-K algorithms, N and K not powers of two
PROBE_SHAPES = ((4, 256, 256), (64, 384, 1024), (200, 640, 512), (8, 256, 8192), (1024, 1152, 384), (4096, 512, 768))


def _compare_with_torch(gemm: LtBlockwiseGemm, device: torch.device, block_a: str, block_b: str) -> str:
    """"" when the plans give F.scaled_mm's bits on PROBE_SHAPES for bf16 and fp32 outputs, else what differed."""
    from ..kernels.layout import mn_major, row_major_padded_t
    from ..quantize import quantize_fp8
    from .torch_backend import scaling_types

    types = scaling_types()
    if types is None:
        return f"torch {torch.__version__} has no F.scaled_mm to compare with"
    one, block = types
    rec_b = block if block_b == "128x128" else one
    g = torch.Generator(device="cpu").manual_seed(11)
    for m, n, k in PROBE_SHAPES:
        x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, 1, generator=g))
        x[:, :: 97] *= 300.0  # outlier columns
        w = torch.randn(n, k, generator=g) * 0.05
        aq = quantize_fp8(x.to(device), (1, 128))
        wq = quantize_fp8(w.to(device), (128, 128) if block_b == "128x128" else (1, 128))
        sa = mn_major(aq.scale)
        sb = row_major_padded_t(wq.scale) if block_b == "128x128" else mn_major(wq.scale)
        for out_dtype in (torch.bfloat16, torch.float32):
            ref = torch.nn.functional.scaled_mm(aq.data, wq.data.t(), sa, one, sb, rec_b, output_dtype=out_dtype)
            got = gemm(aq.data, wq.data.t(), sa, sb, out_dtype)
            if not torch.equal(ref, got):
                diff = int((ref != got).sum())
                return f"{diff} of {ref.numel()} outputs differ from F.scaled_mm at M={m} N={n} K={k} ({out_dtype})"
    return ""
