"""Where cuBLASLt computes the invariant kernel's bits: a probe per weight shape, and the route it opens.

`triton_invariant` promises that row m of A @ B^T has the same bits whatever M is. Its kernel keeps that promise
by construction (a K order fixed by K alone) and runs at about half cuBLASLt's speed from M = 256 up. cuBLASLt's
blockwise FP8 GEMM promotes once per 128-wide K group with one FMA, as the kernel does, and on an H200 it gave the
kernel's exact bits for the Llama-3.1-8B qkv, o and gate_up projections and every SmolLM2-135M projection at every
M from 1 to 16384, but not for down (K = 14336) (`benchmarks/gemm_equivalence_gpu.py`, run record
`2026-12-02_08_gemm-equivalence.json`). That is one library version's behaviour on one device, not a contract.

So the route is per shape and proven where it runs: the first time a weight shape [N, K] (128x128-scaled, the
forward's and DGrad's B operand) reaches `triton_invariant` on a CUDA device, both GEMMs run on random operands with
outliers at every M of `PROBE_MS`, and the shape goes to cuBLASLt only if every output bit agreed. Each verdict is
logged once. Between the probed M the agreement is inferred, not shown; the trainer's per-step bitwise proof (digests
and a sample of log-probs, `--precision.bitwise`) is what catches a miss, and falls back loudly. A shape first seen
while a CUDA graph is being captured is not probed then: that call runs the kernel.

The route is on by default: the bitwise proofs hold with it on the H200, and it is what brings the bitwise rollout
near plain jet_fp8's speed (`docs/precision.md`). `JETRL_INVARIANT_VENDOR_GEMM=off` keeps every GEMM on the
invariant kernels (the strict mode: bits by construction, nothing inferred).

The BF16 twin (`linear_invariant`, the lm_head and other high-precision linears) is routed the same way to
`F.linear`, which gave `bf16_gemm_nt_invariant`'s bits at every M in the same run (`routed_linear`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from ..formats import QuantizedTensor

__all__ = [
    "VENDOR_ROUTE_ENV",
    "PROBE_MS",
    "ROUTE_MIN_M",
    "ProbeResult",
    "bit_differences",
    "outlier_operands",
    "route_enabled",
    "route_setting",
    "route_state",
    "probe_shape",
    "probe_linear_shape",
    "routed",
    "routed_linear",
    "routes",
    "reset",
]

logger = logging.getLogger(__name__)

VENDOR_ROUTE_ENV = "JETRL_INVARIANT_VENDOR_GEMM"
# Below this many rows the invariant kernel is the faster of the two on the H200 (swap-AB streams the weight at
# decode sizes: 8B o_proj 10.7 against 13.6 us at M = 64, qkv 10.4 against 13.8 at M = 32; cuBLASLt wins from
# M = 128 up; `2026-12-02_03_decode-gemm-invariant.json`), so smaller batches are neither routed nor probed.
ROUTE_MIN_M = 128
# Every decode batch from ROUTE_MIN_M a CUDA graph is captured for by default (steps of 8 to 512), a few odd ones
# (partial tiles), and training-sized M.
PROBE_MS: tuple[int, ...] = (*range(ROUTE_MIN_M, 513, 8), 129, 255, 257, 511, 1000, 1024, 2048, 3001, 4096, 8192)
# The probe runs inside engines and trainers that hold most of the GPU: an M is probed only while one output stays
# under this many elements (1 GiB in BF16), so a 128k-vocabulary lm_head stops at M = 4096.
_MAX_OUT_ELEMENTS = 1 << 29

GemmFn = Callable[[QuantizedTensor, QuantizedTensor, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class ProbeResult:
    """One weight shape's verdict: whether the vendor GEMM gave the invariant kernel's bits at every probed M."""

    n: int
    k: int
    b_block: tuple[int, int]
    out_dtype: str
    ms: tuple[int, ...]
    passed: bool
    first_difference: tuple[int, int] | None = None  # (M, elements whose bits differ) at the first M that differed
    reason: str = ""  # why the probe did not run (no vendor GEMM on the device), else empty
    seconds: float = 0.0


_lock = threading.Lock()
_state: dict[str, object] = {"enabled": None}
_results: dict[tuple, ProbeResult] = {}


_ON, _OFF = ("", "1", "on", "probe"), ("0", "off")


def route_setting(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `JETRL_INVARIANT_VENDOR_GEMM` in `environ` turns the route on: unset, 'probe', 'on' or '1' (the default
    is on); '0' or 'off' turn it off. Anything else is a ValueError naming the accepted values."""
    raw = environ.get(VENDOR_ROUTE_ENV, "").strip().lower()
    if raw not in _ON + _OFF:
        raise ValueError(f"{VENDOR_ROUTE_ENV}={raw!r}: use 'probe' (the default: route shapes proven equal to cuBLASLt) "
                         f"or 'off' (every GEMM on the invariant kernels)")
    return raw in _ON


def route_enabled() -> bool:
    """`route_setting()` of this process's environment, read once (`reset()` reads it again)."""
    on = _state["enabled"]
    if on is None:
        on = _state["enabled"] = route_setting()
    return bool(on)


def route_state(device: torch.device | str) -> str:
    """What the precision graph records for invariant GEMMs on `device`: 'on' or 'off' on CUDA, '-' elsewhere (no
    vendor GEMM to route to)."""
    if torch.device(device).type != "cuda":
        return "-"
    return "on" if route_enabled() else "off"


def reset() -> None:
    """Forget every verdict and re-read the environment (tests; a process that changed the variable)."""
    with _lock:
        _results.clear()
        _state.clear()  # the one-time warning too
        _state["enabled"] = None


def routes() -> dict[str, ProbeResult]:
    """The verdicts so far, keyed "N x K block out_dtype device", for logs and run records."""
    return {f"{n} x {k} {blk[0]}x{blk[1]} {dt} {dev}": r for (n, k, blk, dt, dev), r in list(_results.items())}


def bit_differences(x: torch.Tensor, y: torch.Tensor) -> int:
    """How many elements differ in their bits (every element, where shapes or dtypes differ)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return max(x.numel(), y.numel())
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return int((x.contiguous().view(view) != y.contiguous().view(view)).sum())


def outlier_operands(n: int, k: int, m_max: int, device: torch.device | str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight with a few heavy columns and activations whose rows differ in norm by orders of magnitude.

    Drawn on `device` itself: an 8B lm_head's operands are 2 GB in fp32, seconds of host time at every engine start."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, device=device, generator=g) * 0.02
    w[:, torch.randperm(k, device=device, generator=g)[: max(1, k // 64)]] *= 20.0
    x = torch.randn(m_max, k, device=device, generator=g) * torch.exp(torch.randn(m_max, 1, device=device, generator=g))
    x[torch.rand(m_max, k, device=device, generator=g) < 1e-3] *= 50.0
    return w.bfloat16(), x.bfloat16()


def probe_shape(n: int, k: int, *, b_block: tuple[int, int] = (128, 128), out_dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cuda", ms: tuple[int, ...] = PROBE_MS, invariant: GemmFn | None = None,
                vendor: GemmFn | None = None, seed: int = 0) -> ProbeResult:
    """Run the invariant GEMM and the vendor GEMM on the same operands at every M of `ms`; passed when every output
    bit agrees. `invariant` / `vendor` default to `triton_invariant` and cuBLASLt (`torch`); the tests pass others."""
    from ..quantize import quantize_fp8

    if invariant is None:
        from .triton_invariant_backend import invariant_kernel_gemm_nt as invariant
    if vendor is None:
        from .torch_backend import torch_gemm_nt as vendor
    device = torch.device(device)
    t0 = time.perf_counter()
    w, x = outlier_operands(n, k, max(ms), device, seed)
    b = quantize_fp8(w, b_block)

    def both(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = quantize_fp8(x[:m], (1, 128))
        return invariant(a, b, out_dtype), vendor(a, b, out_dtype)

    first = _first_difference(ms, both)
    return ProbeResult(n, k, tuple(b_block), _dtype_name(out_dtype), tuple(ms), first is None, first,
                       seconds=round(time.perf_counter() - t0, 3))


def probe_linear_shape(n: int, k: int, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
                       ms: tuple[int, ...] = PROBE_MS, invariant: Callable | None = None, vendor: Callable | None = None,
                       seed: int = 0) -> ProbeResult:
    """The same for a high-precision weight [N, K]: `linear_invariant`'s GEMM against `F.linear`, no bias."""
    if invariant is None:
        from ..kernels.invariant_gemm import bf16_gemm_nt_invariant

        def invariant(x, w):
            return bf16_gemm_nt_invariant(x, w, x.dtype)
    if vendor is None:
        vendor = torch.nn.functional.linear
    device = torch.device(device)
    t0 = time.perf_counter()
    w, x = (t.to(dtype) for t in outlier_operands(n, k, max(ms), device, seed))
    first = _first_difference(ms, lambda m: (invariant(x[:m], w), vendor(x[:m], w)))
    return ProbeResult(n, k, (1, 1), _dtype_name(dtype), tuple(ms), first is None, first,
                       seconds=round(time.perf_counter() - t0, 3))


def _first_difference(ms: tuple[int, ...], both: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int] | None:
    """(M, elements whose bits differ) at the first M of `ms` where the two results differ, else None."""
    for m in ms:
        diff = bit_differences(*both(m))
        if diff:
            return m, diff
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def routed(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> bool:
    """Whether `triton_invariant` may hand this GEMM to cuBLASLt: the route is on, A has at least `ROUTE_MIN_M` rows,
    and B's shape passed its probe on this device (probed here on first sight). Only 128x128-scaled B operands
    (weights) are routed: WGrad's operands change shape with the token count and would be probed at every new one."""
    if b.block != (128, 128) or a.shape[0] < ROUTE_MIN_M or not route_enabled():
        return False
    dev = b.data.device
    key = (int(b.shape[0]), int(b.shape[1]), (128, 128), _dtype_name(out_dtype), str(dev))
    return _verdict(key, lambda: _probe_fp8(key, dev, out_dtype))


def routed_linear(weight: torch.Tensor, out_dtype: torch.dtype, m: int) -> bool:
    """Whether `linear_invariant` may run this bias-free product of `m` rows on `F.linear`: the route is on and the
    weight's shape and dtype passed their probe on this device (probed here on first sight)."""
    if weight.dtype != out_dtype or weight.device.type != "cuda" or m < ROUTE_MIN_M or not route_enabled():
        return False
    key = (int(weight.shape[0]), int(weight.shape[1]), (1, 1), _dtype_name(weight.dtype), str(weight.device))
    return _verdict(key, lambda: _probe_bf16(key, weight.device, weight.dtype))


def _verdict(key: tuple, probe: Callable[[], ProbeResult]) -> bool:
    hit = _results.get(key)
    if hit is not None:
        return hit.passed
    if _capturing():
        return False  # no probe inside a capture (it compares on the host); this call runs the kernel
    with _lock:
        hit = _results.get(key)
        if hit is None:
            hit = _results[key] = probe()
    return hit.passed


def _probe_fp8(key: tuple, dev: torch.device, out_dtype: torch.dtype) -> ProbeResult:
    n, k = key[0], key[1]
    from .torch_backend import unavailable_reason

    reason = unavailable_reason(dev)
    if reason is not None:
        result = ProbeResult(n, k, (128, 128), key[3], (), False, reason=f"cuBLASLt blockwise FP8 cannot run: {reason}")
        log = logger.warning if not _state.get("warned_unavailable") else logger.debug  # once per process
        _state["warned_unavailable"] = True
        log("triton_invariant: the cuBLASLt route is on, but %s; [%d x %d] (and every shape after it) stays on the "
            "invariant kernel", result.reason, n, k)
        return result
    return _logged(probe_shape(n, k, out_dtype=out_dtype, device=dev, ms=_ms_for(n)), "cuBLASLt")


def _probe_bf16(key: tuple, dev: torch.device, dtype: torch.dtype) -> ProbeResult:
    return _logged(probe_linear_shape(key[0], key[1], dtype=dtype, device=dev, ms=_ms_for(key[0])), "F.linear")


def _ms_for(n: int) -> tuple[int, ...]:
    """PROBE_MS up to the largest M whose [M, N] output stays under `_MAX_OUT_ELEMENTS` (at least M = 1)."""
    return tuple(m for m in PROBE_MS if m * n <= _MAX_OUT_ELEMENTS) or (1,)


def _logged(result: ProbeResult, vendor: str) -> ProbeResult:
    n, k = result.n, result.k
    if result.passed:
        logger.info("triton_invariant: %s gave the invariant kernel's bits for [%d x %d] %s at all %d probed M "
                    "(%.2f s): routed to %s", vendor, n, k, result.out_dtype, len(result.ms), result.seconds, vendor)
    else:
        m, diff = result.first_difference
        logger.warning("triton_invariant: %s differs from the invariant kernel for [%d x %d] %s (%d elements at M=%d): "
                       "this shape stays on the invariant kernel", vendor, n, k, result.out_dtype, diff, m)
    return result
