"""Backend registry and the `auto` choice. Backends register themselves; unavailable ones say why."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from ..formats import QuantizedTensor

__all__ = [
    "BackendUnavailable",
    "GemmBackend",
    "available_backends",
    "gemm_nt",
    "get_backend",
    "register_backend",
    "resolve_backend",
    "resolve_decode_backend",
    "AUTO_ORDER_CUDA",
    "AUTO_ORDER_CUDA_ROLLOUT",
    "ROLLOUT_DECODE_MAX_M",
    "PreparedGemm",
    "prepare_gemm",
]

logger = logging.getLogger(__name__)

GemmFn = Callable[[QuantizedTensor, QuantizedTensor, torch.dtype], torch.Tensor]


class BackendUnavailable(RuntimeError):
    """The requested GEMM backend cannot run here; the message says why and what to use instead."""


@dataclass(frozen=True)
class GemmBackend:
    name: str
    gemm_nt: GemmFn
    # Returns None when usable on `device`, else a one-line reason.
    unavailable_reason: Callable[[torch.device], str | None]
    # Optional: the backend's `PreparedGemm` for a device (what a layer derives once); None: the generic one.
    prepare: Callable[[torch.device], "PreparedGemm"] | None = None


class PreparedGemm:
    """One backend's GEMMs on one device, for a layer that calls them every step.

    `weight(w)` derives what the backend reads from a quantized weight (scale layouts, views) once per weight
    quantization; `nt_weight(a, prepared, w, out_dtype)` is `gemm_nt(a, w, out_dtype)` with that taken out of the
    call, and `nt(a, b, out_dtype)` is `gemm_nt` for two per-call operands (WGrad). Each gives exactly the bytes of
    `gemm_nt` on the same backend: the same library call with the same operands, or `gemm_nt` itself where the
    operands do not fit the prepared form. This generic form prepares nothing.
    """

    # WGrad's K (the token count) must be a multiple of this, or `nt` pads both operands with a copy first; a layer
    # asks its transposed quantizers for operands already padded so (zero columns, written by the kernels).
    wgrad_k_multiple: int = 1

    def __init__(self, name: str) -> None:
        self.name = name
        self._gemm = _REGISTRY[name].gemm_nt

    def weight(self, w: QuantizedTensor) -> object:
        return None

    def nt_weight(self, a: QuantizedTensor, prepared: object, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        return self._gemm(a, w, out_dtype)

    def nt(self, a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        return self._gemm(a, b, out_dtype)


def prepare_gemm(name: str, device: torch.device | str) -> PreparedGemm:
    """The `PreparedGemm` of a resolved backend name on `device` (see `resolve_backend`)."""
    _ensure_registered()
    if name not in _REGISTRY:
        raise BackendUnavailable(f"unknown GEMM backend {name!r}; choose one of {['auto', *sorted(_REGISTRY)]}")
    backend = _REGISTRY[name]
    return backend.prepare(torch.device(device)) if backend.prepare is not None else PreparedGemm(name)


_REGISTRY: dict[str, GemmBackend] = {}
# Fastest first on the H200 for training shapes (thousands of tokens per GEMM; GEMM figures in docs/benchmarks.md).
AUTO_ORDER_CUDA = ("deep_gemm", "torch", "triton")
# For a rollout engine at every M above its decode sizes: cuBLASLt. DeepGEMM JIT-compiles a kernel per tiling its
# heuristic picks for an M, so an engine whose prefill batches take it compiles while it serves (the 8-layer 8B
# shape ran at 0.39x bf16 so; benchmarks/results/runs/2026-12-01_01_vllm-gpu-auto-deep-gemm.json).
AUTO_ORDER_CUDA_ROLLOUT = ("torch", "deep_gemm", "triton")
# Decode batches (M <= this: the batch sizes vLLM captures in CUDA graphs by default) are where DeepGEMM gains most
# over cuBLASLt blockwise (at M = 64: 1.3-2.1x bf16 against 0.6-1.7x, docs/benchmarks.md), and their kernels are
# compiled while the engine captures its graphs, before it serves.
ROLLOUT_DECODE_MAX_M = 512
# `triton_invariant` (batch-invariant, swap-AB for decode) is in neither order: it is chosen by name, until the
# H200 shows it faster than cuBLASLt at decode sizes (benchmarks/decode_gemm_triton.py).
_logged_choices: set[tuple[str, str]] = set()
# How the deep_gemm backend's unavailable reason starts when DeepGEMM is simply not installed.
NOT_INSTALLED = "DeepGEMM is not installed"


def register_backend(backend: GemmBackend) -> None:
    _REGISTRY[backend.name] = backend


def _placeholder(name: str, reason: str) -> GemmBackend:
    def gemm(a, b, out_dtype):  # pragma: no cover - never selected while unavailable
        raise BackendUnavailable(f"GEMM backend {name!r} is unavailable: {reason}")

    return GemmBackend(name, gemm, lambda device: f"the {name} backend is unavailable in this build ({reason})")


def available_backends(device: torch.device | str = "cpu") -> dict[str, str | None]:
    """Every known backend -> None if usable on `device`, else the reason it is not."""
    _ensure_registered()
    device = torch.device(device)
    return {name: b.unavailable_reason(device) for name, b in _REGISTRY.items()}


def resolve_backend(name: str, device: torch.device | str, role: str = "train") -> str:
    """Turn a requested backend name ('auto' included) into the concrete backend that will run.

    `role="rollout"` (an inference engine's decode-sized GEMMs) orders 'auto' differently; the choice is
    recorded in the precision graph, where a backend that differs from training's is a warning.
    """
    _ensure_registered()
    device = torch.device(device)
    if role not in ("train", "rollout"):
        raise ValueError(f"resolve_backend: role must be 'train' or 'rollout', got {role!r}")
    if name == "auto":
        order = (AUTO_ORDER_CUDA_ROLLOUT if role == "rollout" else AUTO_ORDER_CUDA) if device.type == "cuda" else ()
        reasons = {}
        for cand in order:
            reason = _REGISTRY[cand].unavailable_reason(device)
            if reason is None:
                skipped = "".join(f"; {k} skipped: {v}" for k, v in reasons.items())  # e.g. DeepGEMM not installed
                # A faster backend that would run here but is not installed (DeepGEMM on sm90) is a warning: the
                # run is slower than it could be, and the line says how to fix that.
                absent = any(v.startswith(NOT_INSTALLED) for v in reasons.values())
                _log_choice(cand, device, f"auto picked {cand!r} on {device} for {role}{skipped}", warn=absent)
                return cand
            reasons[cand] = reason
        why = "; ".join(f"{k}: {v}" for k, v in reasons.items()) or f"no FP8 tensor cores on {device.type}"
        _log_choice("emulated", device, f"auto picked 'emulated' on {device} ({why})", warn=device.type == "cuda")
        return "emulated"
    if name not in _REGISTRY:
        raise BackendUnavailable(f"unknown GEMM backend {name!r}; choose one of {['auto', *sorted(_REGISTRY)]}")
    reason = _REGISTRY[name].unavailable_reason(device)
    if reason is not None:
        raise BackendUnavailable(f"GEMM backend {name!r} cannot run on {device}: {reason}. Use --precision.gemm_backend auto")
    return name


def resolve_decode_backend(name: str, device: torch.device | str, backend: str) -> str | None:
    """The backend an inference engine runs for M <= ROLLOUT_DECODE_MAX_M, when it differs from `backend` (what
    `resolve_backend(name, device, role="rollout")` gave for every M): 'deep_gemm' where `name` is 'auto', the engine
    runs cuBLASLt and DeepGEMM imports. None otherwise: a named backend runs at every M. The caller logs its choice
    (it may still decline, e.g. an engine without CUDA graphs); a DeepGEMM that would run but is absent is logged here."""
    _ensure_registered()
    device = torch.device(device)
    if name != "auto" or backend != "torch" or device.type != "cuda":
        return None
    reason = _REGISTRY["deep_gemm"].unavailable_reason(device)
    if reason is not None:
        _log_choice("decode:torch", device, f"decode-sized GEMMs (M <= {ROLLOUT_DECODE_MAX_M}) on 'torch' on {device}, "
                    f"slower there than DeepGEMM: {reason}", warn=reason.startswith(NOT_INSTALLED))
        return None
    return "deep_gemm"


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> GemmBackend:
    return _REGISTRY[resolve_backend(name, device)]


def gemm_nt(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, backend: str = "emulated") -> torch.Tensor:
    """out = A @ B^T for block-scaled FP8 operands, on the named (already resolved) backend."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"gemm_nt: K mismatch, A is {tuple(a.shape)} and B is {tuple(b.shape)}")
    _ensure_registered()
    return _REGISTRY[backend].gemm_nt(a, b, out_dtype)


def _log_choice(name: str, device: torch.device, msg: str, warn: bool = False) -> None:
    key = (name, str(device))
    if key not in _logged_choices:
        _logged_choices.add(key)
        (logger.warning if warn else logger.info)("jetrl_precision GEMM: %s", msg)


_registered = False


def _ensure_registered() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    import importlib

    from . import emulated  # noqa: F401  (registers itself)

    # Each hardware backend module registers itself on import. A module that fails to import
    # (a broken optional dependency, say) leaves a placeholder that says why, never a crash.
    for name, module in (("torch", "torch_backend"), ("triton", "triton_backend"), ("deep_gemm", "deep_gemm_backend"),
                         ("triton_invariant", "triton_invariant_backend")):
        try:
            importlib.import_module(f"{__package__}.{module}")
        except Exception as e:  # noqa: BLE001
            logger.warning("jetrl_precision GEMM: backend %r failed to import: %s", name, e)
            register_backend(_placeholder(name, f"importing {__package__}.{module} failed: {type(e).__name__}: {e}"))
        if name not in _REGISTRY:
            register_backend(_placeholder(name, f"{__package__}.{module} did not register it"))
