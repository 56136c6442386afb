"""The eager engine's FP8 linear in one host call: the C++ extension of `csrc/engine_linear.cpp`, built at first use.

An eager decode step (vLLM with `enforce_eager`) is host-bound: it waits on the Python and launch time of every
projection. From Python, an FP8 projection is two launches through two Python entry points (the CUDA quantizer's
ctypes `cuLaunchKernel`, then `torch._scaled_mm`, which rebuilds cuBLASLt's descriptors and asks its heuristic on
every call). The extension does the same two launches from C++, with cuBLASLt's plan made once per shape: the same
kernel (`kernels.quant_cuda`'s NVRTC function, passed in), the same descriptors, layouts and heuristic inputs as
torch's, so the same bits, which `native_linear` checks against the Python path at first use on each device.

The extension is built at first use (`native_ext`: a C++ compiler and ninja, no CUDA toolkit; ~30 s once per source
and torch version). Where it cannot build or its bits differ, `native_linear` returns None after one warning naming why, and
the engine keeps the Python path (same bytes, more host time). `JETRL_NATIVE_LINEAR=0` turns it off (A/B runs).

Only batches of up to 512 rows (decode-sized) outside CUDA-graph capture take it; the rest run the Python path.
"""

from __future__ import annotations

import logging
import os

import torch

from ..kernels._probe import device_key, verdict_once

__all__ = ["native_linear", "status", "NATIVE_MAX_M", "ENV_SWITCH"]

logger = logging.getLogger(__name__)

ENV_SWITCH = "JETRL_NATIVE_LINEAR"
NATIVE_MAX_M = 512  # csrc/engine_linear.cpp's kMaxRows: the activation workspace is 512 x K per stream


def _asked() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


def _module():
    """The built extension (`native_ext`), or why it is not available (a string)."""
    from ..native_ext import extension

    return extension()


_runtimes: dict[str, object] = {}
_verdicts: dict[str, bool] = {}
_reasons: dict[str, str] = {}


def _runtime(device: torch.device):
    """The device's extension runtime (cuBLASLt handle, plans, workspaces), or why there is none."""
    key = device_key(device)
    if key in _runtimes:
        return _runtimes[key]
    if not _asked():
        return f"turned off ({ENV_SWITCH}=0)"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"needs a CUDA device, got {device}"
    from ..kernels import quant_cuda

    if quant_cuda.quantizer_1x128(device, False, torch.bfloat16) is None:
        return "the CUDA 1x128 quantizer is not available (" + quant_cuda.status(device)[1] + ")"

    def check() -> str:
        from ..native_ext import runtime

        rt = runtime(device)
        if isinstance(rt, str):
            return rt
        why = first_mismatch(_module(), rt, torch.device(key))
        if not why:
            _runtimes[key] = rt
        return why

    def warn(why: str) -> None:
        logger.warning("jetrl_precision: the native FP8 engine linear is not used on %s: %s. Eager engines call the Python "
                       "path (same bits, about twice F.linear's host time per projection).", key, why)

    verdict_once(_verdicts, _reasons, key, check, warn)
    return _runtimes.get(key) or _reasons[key]


def native_linear(weight: torch.Tensor, weight_scale_t: torch.Tensor, pow2: bool):
    """fn(x2, stream) -> y or None for the e4m3 weight [N, K] (contiguous; N, K multiples of 128) with its 128x128
    scales in cuBLASLt's layout (`row_major_padded_t`, the tensor the Python path passes as scale_b): None from the
    call means this batch is not for it (over 512 rows, capturing, not bf16, unaligned) and the caller runs the
    Python path. Returns None (the reason logged once, `status`) where the extension cannot run or its first-use
    check failed. pow2 scales are not handled (their quantizer is another kernel)."""
    if pow2:
        return None
    rt = _runtime(weight.device)
    if isinstance(rt, str):
        return None
    return _module().Linear(rt, weight, weight_scale_t, _quant_fn(weight.device))


def status(device: torch.device | str) -> str:
    """'native' where eager engines' decode-sized FP8 projections run the extension on `device`, else
    'python (why)': for precision graphs and logs."""
    rt = _runtime(torch.device(device))
    return "native" if not isinstance(rt, str) else f"python ({rt})"


# (M, N, K): decode-sized M (not multiples of 4 included), the largest M taken, several N and K
PROBE_SHAPES = ((1, 256, 256), (3, 384, 1024), (64, 640, 512), (130, 256, 4096), (512, 1152, 384))


def first_mismatch(mod, rt, device: torch.device) -> str:
    """'' when the extension's output equals the Python path's bit for bit on PROBE_SHAPES (random weights and
    activations with outliers; rows with a stride, and the same shape twice, which reuses a plan), else the first
    difference found."""
    from ..kernels.layout import row_major_padded_t
    from ..quantize import quantize_fp8
    from ..recipe import get_recipe
    from .engine_linear import EngineLinear

    g = torch.Generator(device="cpu").manual_seed(4321)
    stream = torch.cuda.current_stream(device).cuda_stream
    for m, n, k in PROBE_SHAPES + PROBE_SHAPES[:1]:
        w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
        wq = quantize_fp8(w.to(device), (128, 128))
        x = torch.randn(m, k + 64, generator=g) * torch.exp(2.0 * torch.randn(m, 1, generator=g))
        x[torch.rand(m, k + 64, generator=g) < 2e-3] *= 200.0
        x = x.to(torch.bfloat16).to(device)[:, :k]  # rows strided by k + 64
        ref = EngineLinear(wq.data, wq.scale, [(n, wq.scale.shape[0], 128)], 128, get_recipe("jet_fp8").rollout.input, "torch")(x)
        got = mod.Linear(rt, wq.data, row_major_padded_t(wq.scale), _quant_fn(device))(x, stream)
        if got is None:
            return f"the extension refused a supported input at M={m} N={n} K={k}"
        if got.shape != ref.shape or not got.is_contiguous():
            return f"output shape/layout {tuple(got.shape)} {tuple(got.stride())} against {tuple(ref.shape)} at M={m} N={n} K={k}"
        bad = int((got.view(torch.int16) != ref.view(torch.int16)).sum())
        if bad:
            return f"{bad} of {got.numel()} outputs differ from the Python path's bits at M={m} N={n} K={k}"
    return ""


def _quant_fn(device: torch.device) -> int:
    from ..kernels import quant_cuda

    return int(quant_cuda.quantizer_1x128(device, False, torch.bfloat16).kern.func.value)
