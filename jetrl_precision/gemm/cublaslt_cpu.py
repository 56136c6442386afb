"""cuBLASLt's matmul API over CPU memory: what `gemm.cublaslt` calls, computed in torch from the raw pointers.

For CPU tests and the host-cost proxy of the cuBLASLt plans. It follows the library's documented semantics, not
the plan's code: column-major layouts (rows, cols, ld), TRANSA/TRANSB applied to them, FP8 operands scaled per the
A/B scale modes (VEC128_32F: one fp32 per 128 along K for each row of op(A) / column of op(B), the outer index
fastest; BLK128x128_32F: one per 128x128 block, K blocks fastest with a row pitch of round_up(K/128, 4)), alpha = 1
and beta = 0 only. The numbers are the `emulated` GEMM backend's (operands dequantized in fp32, a float64 product
rounded once to D's type), so CPU tests can compare bit for bit. A plan that swaps operands, strides, scale pointers
or modes reads other bytes here and gets another product. Descriptors a call leaves unset or inconsistent return
CUBLAS_STATUS_INVALID_VALUE / NOT_SUPPORTED, as the library would refuse them.
"""

from __future__ import annotations

import ctypes
import itertools

import torch

__all__ = ["EmulatedLt", "VERSION"]

VERSION = 130100
_OK, _INVALID_VALUE, _NOT_SUPPORTED = 0, 7, 15
_HEURISTIC_BYTES = 96  # cublasLtMatmulHeuristicResult_t
_TYPES = {0: torch.float32, 2: torch.float16, 14: torch.bfloat16, 28: torch.float8_e4m3fn, 29: torch.float8_e5m2}
_ATTRS = {3: "transa", 4: "transb", 17: "a_scale", 18: "b_scale", 25: "fast_accum", 31: "a_mode", 32: "b_mode"}
_VEC128, _BLK128 = 4, 5


def _read(ptr: int, dtype: torch.dtype, count: int) -> torch.Tensor:
    raw = bytearray(ctypes.string_at(ptr, count * torch.empty((), dtype=dtype).element_size()))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).clone()


def _matrix(ptr: int, layout: dict) -> torch.Tensor:
    r, c, ld = layout["rows"], layout["cols"], layout["ld"]
    flat = _read(ptr, layout["type"], ld * (c - 1) + r)
    return torch.as_strided(flat, (r, c), (1, ld))


def _scales(ptr: int, mode: int, outer: int, k: int) -> torch.Tensor:
    """Per-element fp32 scales of an [outer, k] operand (op(A) as is, op(B) transposed)."""
    kb = -(-k // 128)
    if mode == _VEC128:
        s = torch.as_strided(_read(ptr, torch.float32, outer * kb), (outer, kb), (1, outer))
        return s.repeat_interleave(128, dim=1)[:, :k]
    if mode == _BLK128:
        ob, pitch = -(-outer // 128), -(-kb // 4) * 4
        s = torch.as_strided(_read(ptr, torch.float32, pitch * (ob - 1) + kb), (ob, kb), (pitch, 1))
        return s.repeat_interleave(128, dim=0)[:outer].repeat_interleave(128, dim=1)[:, :k]
    raise ValueError(f"scale mode {mode}")


class EmulatedLt:
    """The functions `gemm.cublaslt` calls, by their C names, taking and writing integer addresses like the library."""

    version = VERSION

    def __init__(self, algorithms: int = 3) -> None:
        self._objects: dict[int, dict] = {}
        self._ids = itertools.count(1)
        self.matmuls = 0
        self.algorithms = algorithms  # how many the heuristic offers at most (all compute the same product here)
        self.algos_run: list[int] = []  # the first byte of each matmul's algorithm: which one it ran

    def _new(self, addr: int, **obj) -> int:
        key = next(self._ids)
        self._objects[key] = obj
        ctypes.c_uint64.from_address(addr).value = key
        return _OK

    # -- objects --------------------------------------------------------------------------------------------------
    def cublasLtGetVersion(self) -> int:
        return VERSION

    def cublasLtCreate(self, addr: int) -> int:
        return self._new(addr, kind="handle")

    def cublasLtMatmulDescCreate(self, addr: int, compute: int, scale_type: int) -> int:
        if compute != 68 or scale_type != 0:
            return _NOT_SUPPORTED
        return self._new(addr, kind="desc", transa=0, transb=0, fast_accum=0, a_mode=0, b_mode=0, a_scale=0, b_scale=0)

    def cublasLtMatmulDescSetAttribute(self, desc: int, attr: int, addr: int, size: int) -> int:
        obj = self._objects.get(desc)
        if obj is None or obj["kind"] != "desc" or attr not in _ATTRS:
            return _INVALID_VALUE
        obj[_ATTRS[attr]] = int.from_bytes(ctypes.string_at(addr, size), "little", signed=size < 8)
        return _OK

    def cublasLtMatrixLayoutCreate(self, addr: int, dtype: int, rows: int, cols: int, ld: int) -> int:
        if dtype not in _TYPES or ld < rows:
            return _INVALID_VALUE
        return self._new(addr, kind="layout", type=_TYPES[dtype], rows=rows, cols=cols, ld=ld)

    def cublasLtMatmulPreferenceCreate(self, addr: int) -> int:
        return self._new(addr, kind="pref", max_workspace=0)

    def cublasLtMatmulPreferenceSetAttribute(self, pref: int, attr: int, addr: int, size: int) -> int:
        if attr != 1:
            return _INVALID_VALUE
        self._objects[pref]["max_workspace"] = int.from_bytes(ctypes.string_at(addr, size), "little")
        return _OK

    def _destroy(self, key: int) -> int:
        return _OK if self._objects.pop(key, None) is not None else _INVALID_VALUE

    cublasLtMatmulDescDestroy = cublasLtMatrixLayoutDestroy = cublasLtMatmulPreferenceDestroy = _destroy

    @property
    def live_objects(self) -> int:
        return sum(1 for o in self._objects.values() if o["kind"] in ("desc", "layout", "pref"))

    # -- the product ----------------------------------------------------------------------------------------------
    def _shapes(self, desc, la, lb, lc, ld):
        d, a, b, c, dd = (self._objects.get(x) for x in (desc, la, lb, lc, ld))
        if None in (d, a, b, c, dd) or d["fast_accum"] != 0 or not (d["a_mode"] and d["b_mode"]):
            return None
        m, k = (a["cols"], a["rows"]) if d["transa"] else (a["rows"], a["cols"])
        k2, n = (b["cols"], b["rows"]) if d["transb"] else (b["rows"], b["cols"])
        if k != k2 or (c["rows"], c["cols"]) != (m, n) or (dd["rows"], dd["cols"]) != (m, n) or c["type"] != dd["type"]:
            return None
        return d, a, b, dd, m, n, k

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, la, lb, lc, ld, pref, requested, result_addr, found_addr) -> int:
        ok = self._shapes(desc, la, lb, lc, ld) is not None
        found = min(requested, self.algorithms) if ok else 0
        for i in range(found):  # result i: its algorithm's first byte is i, workspace 0, waves 1 + i
            ctypes.memset(result_addr + i * _HEURISTIC_BYTES, 0, _HEURISTIC_BYTES)
            ctypes.c_uint8.from_address(result_addr + i * _HEURISTIC_BYTES).value = i
            ctypes.c_float.from_address(result_addr + i * _HEURISTIC_BYTES + 76).value = 1.0 + i
        ctypes.c_int.from_address(found_addr).value = found
        return _OK if ok else _NOT_SUPPORTED

    def cublasLtMatmul(self, handle, desc, alpha, a_ptr, la, b_ptr, lb, beta, c_ptr, lc, d_ptr, ld, algo, ws, ws_size, stream) -> int:
        self.algos_run.append(ctypes.c_uint8.from_address(algo).value)
        shapes = self._shapes(desc, la, lb, lc, ld)
        if shapes is None or ctypes.c_float.from_address(alpha).value != 1.0 or ctypes.c_float.from_address(beta).value != 0.0:
            return _INVALID_VALUE
        d, a_layout, b_layout, d_layout, m, n, k = shapes
        a = _matrix(a_ptr, a_layout)
        b = _matrix(b_ptr, b_layout)
        op_a = a.t() if d["transa"] else a  # [m, k]
        op_b_t = b if d["transb"] else b.t()  # op(B)^T: [n, k]
        deq_a = (op_a.float() * _scales(d["a_scale"], d["a_mode"], m, k)).to(torch.float64)
        deq_b_t = (op_b_t.float() * _scales(d["b_scale"], d["b_mode"], n, k)).to(torch.float64)
        if d_layout["ld"] != m:
            return _NOT_SUPPORTED
        # D is m x n column-major: in memory the row-major [n, m] = op(B)^T @ op(A)^T
        src = (deq_b_t @ deq_a.t()).to(d_layout["type"]).contiguous()
        ctypes.memmove(d_ptr, src.data_ptr(), src.numel() * src.element_size())
        self.matmuls += 1
        return _OK
