"""The training step's blockwise FP8 GEMMs from C++, cuBLASLt's plan made once per shape (opt-in: JETRL_NATIVE_GEMM=1).

`torch._scaled_mm` builds cuBLASLt's descriptors and asks its heuristic on every call; an `Fp8Linear` training step
makes three such calls (fprop, DGrad, WGrad), and a decoder layer's forward, recomputation and backward sixteen.
`Runtime.gemm` in `csrc/engine_linear.cpp` makes the call torch makes (the same descriptors, layouts and heuristic
inputs, so the same algorithm and bits) with the plan kept per (M, N, K, output dtype, scale mode), and only the
two scale pointers set per call. The Python plans of `gemm.cublaslt` do the same through ctypes, whose per-call
cost ate the saving at decode size; this is their C++ counterpart.

Opt-in: on an H100 host a call costs 16-18 us against torch's 27.5 at M = 8,192 (`benchmarks/host_probe_train_gemm.py`),
which shows only where the update micro-step leaves the GPU idle (1-3 ms less per 8-layer micro-step at 64-token
prompts, nothing at 256; docs/precision.md): too little, on too few samples, to change the default. Where asked for, `blockwise_gemm` checks the extension's bits against F.scaled_mm at first use on each device
(`cublaslt.PROBE_SHAPES`, bf16 and fp32 outputs) and returns None, after one warning naming why, where it cannot
build or differs; the torch backend then keeps torch's call. Inputs the extension hands back (a capturing stream,
another layout, the plan table full) run torch's call too: same bits either way.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from ..kernels._probe import device_key, verdict_once
from .cublaslt import SCALE_MODES

__all__ = ["NativeBlockwiseGemm", "blockwise_gemm", "unavailable_reason", "ENV_SWITCH"]

logger = logging.getLogger(__name__)

ENV_SWITCH = "JETRL_NATIVE_GEMM"
_OUT_TYPES = {torch.bfloat16: 14, torch.float32: 0}  # cudaDataType_t of the outputs the extension takes

ScaledMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


def _asked() -> bool:
    return os.environ.get(ENV_SWITCH, "0").strip() == "1"


class NativeBlockwiseGemm:
    """fn(a, b_t, sa, sb, out_dtype) -> a @ b_t, the signature of the torch backend's prepared scaled_mm calls
    (`torch_backend.prepared_scaled_mm`), run by the extension; `fallback` (torch's call) takes what it hands back."""

    __slots__ = ("_gemm", "_mode", "_index", "_fallback", "block_a", "block_b")

    def __init__(self, runtime, device: torch.device, block_a: str, block_b: str, fallback: ScaledMM) -> None:
        self._gemm = runtime.gemm
        self._mode = SCALE_MODES[block_b]
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._fallback = fallback
        self.block_a, self.block_b = block_a, block_b

    def __call__(self, a: torch.Tensor, b_t: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        code = _OUT_TYPES.get(out_dtype)
        if code is not None:
            y = self._gemm(a, b_t, sa, sb, self._mode, code, torch._C._cuda_getCurrentRawStream(self._index))
            if y is not None:
                return y
        return self._fallback(a, b_t, sa, sb, out_dtype)


_verdicts: dict[tuple, bool] = {}
_reasons: dict[tuple, str] = {}


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why the native GEMMs cannot run on `device` (None: they may; `blockwise_gemm` still checks their bits)."""
    device = torch.device(device)
    if not _asked():
        return f"not asked for ({ENV_SWITCH}=1 turns it on)"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"needs a CUDA device, got {device}"
    return None


def _runtime(device: torch.device):
    """The device's extension runtime (`native_ext.runtime`, shared with the eager engine's linear)."""
    from ..native_ext import runtime

    rt = runtime(device)
    if isinstance(rt, str):
        raise RuntimeError(rt)
    return rt


def blockwise_gemm(device: torch.device | str, block_a: str, block_b: str, fallback: ScaledMM) -> NativeBlockwiseGemm | None:
    """The extension's GEMM for `block_a` x `block_b` on `device`, or None: not asked for (silently), or no CUDA, or
    the extension could not build, or its first-use check found other bits than F.scaled_mm's (each warned once)."""
    if not _asked():
        return None
    device = torch.device(device)
    key = (device_key(device), block_a, block_b)

    def check() -> str:
        reason = unavailable_reason(device)
        if reason:
            return reason
        rt = _runtime(device)
        return _first_mismatch(NativeBlockwiseGemm(rt, torch.device(key[0]), block_a, block_b, _refused), device, block_a, block_b)

    def warn(why: str) -> None:
        logger.warning("jetrl_precision: native cuBLASLt GEMMs not used on %s for %s x %s (%s); torch's scaled_mm entry point "
                       "is used (same bits, more host time per call)", device, block_a, block_b, why)

    if not verdict_once(_verdicts, _reasons, key, check, warn):
        return None
    return NativeBlockwiseGemm(_runtime(device), torch.device(key[0]), block_a, block_b, fallback)


def _refused(a, b_t, sa, sb, out_dtype):
    raise RuntimeError(f"the extension handed back a supported input (M={a.shape[0]} N={b_t.shape[1]} K={a.shape[1]}, {out_dtype})")


def _first_mismatch(gemm: NativeBlockwiseGemm, device: torch.device, block_a: str, block_b: str) -> str:
    """"" when the extension gives F.scaled_mm's bits on `cublaslt.PROBE_SHAPES` (bf16 and fp32 outputs; every call
    must run in the extension: its fallback raises), else what differed."""
    from .cublaslt import _compare_with_torch

    try:
        return _compare_with_torch(gemm, device, block_a, block_b)
    except RuntimeError as e:
        return str(e)
