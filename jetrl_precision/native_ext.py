"""The C++ extension of `csrc/engine_linear.cpp`, built at first use: cuBLASLt plans made once per shape.

Two users, each with its own switch and first-use check: the eager engine's one-call FP8 linear
(`integrations.engine_native`) and the training step's blockwise GEMMs (`gemm.cublaslt_native`). The extension is
built by `torch.utils.cpp_extension` (a C++ compiler and ninja; no CUDA toolkit: libcuda and the libcublasLt torch
loaded are opened at run time) into torch's extension cache, once per source and torch version (~30 s).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import torch

__all__ = ["extension", "runtime"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parent / "csrc" / "engine_linear.cpp"


@functools.cache
def extension():
    """The built extension module, or why it is not available (a string)."""
    try:
        from torch.utils import cpp_extension
    except ImportError as e:  # pragma: no cover - torch always has it
        return f"torch.utils.cpp_extension is unavailable ({e})"
    src = _SOURCE.read_bytes()
    name = "jetrl_engine_linear_" + hashlib.sha256(src + torch.__version__.encode()).hexdigest()[:12]
    t0 = time.perf_counter()
    logger.info("jetrl_precision: loading the native cuBLASLt extension %s (built once per source and torch version, ~30 s)", name)
    try:
        mod = cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=["-O2"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a build error: the Python paths run instead
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        return f"the extension did not build ({type(e).__name__}: {lines[-1] if lines else ''})"
    logger.info("jetrl_precision: native cuBLASLt extension ready in %.1f s", time.perf_counter() - t0)
    return mod


_runtimes: dict[str, object] = {}


def runtime(device: torch.device):
    """The device's extension runtime (one cuBLASLt handle, its plans and workspaces, for both users), or why there is
    none (a string). Each user still checks the runtime's bits for its own calls before taking it."""
    from .gemm import cublaslt
    from .kernels._probe import device_key

    key = device_key(device)
    if key not in _runtimes:
        mod = extension()
        if isinstance(mod, str):
            return mod
        lib = cublaslt._library()
        if isinstance(lib, str):
            return lib
        _runtimes[key] = mod.Runtime(cublaslt._loaded_path() or "libcublasLt.so.13", torch.device(key).index,
                                     cublaslt.lt_workspace_bytes(device))
    return _runtimes[key]
