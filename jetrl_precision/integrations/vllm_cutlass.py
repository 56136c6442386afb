"""vLLM's CUTLASS blockwise FP8 GEMM as an eager engine's decode GEMM.

An engine that captures no CUDA graphs (eager) waits on the host time of every launch of a decode step. There
cuBLASLt's blockwise scaled_mm costs ~28-30 us of host time per call through torch (it sets the matmul up on every
call), more than a whole BF16 `F.linear`; vLLM's CUTLASS kernel for the same
operands (1x128 activation scales, 128x128 weight scales, the layout vLLM's own block-FP8 linear feeds it) is one
C++ op (~21 us of host time against ~30 us for the scaled_mm, on an H100 host). It accumulates differently from
cuBLASLt, the trainer's GEMM, as any two backends do, so an eager engine runs it only when asked
(JETRL_EAGER_CUTLASS=1; `vllm_quant.JetFp8LinearMethod._eager_decode_backend`), under the gemm backend `auto`, never
in the bitwise mode (which runs its own GEMM), and only after a first-use check on the device: finite outputs within
the GEMM backends' bound of a float64 reference, and of cuBLASLt's output.

`decode_gemm(device)` returns fn(out, a_data, a_scale, w_t, w_scale_t) or None (the reason logged once,
and `unusable_reason(device)`).
"""

from __future__ import annotations

import logging

import torch

from ..kernels._probe import device_key, verdict_once

__all__ = ["decode_gemm", "unavailable_reason", "unusable_reason", "first_failure", "NAME", "REL_TOL"]

logger = logging.getLogger(__name__)

NAME = "vllm_cutlass"
# bf16 output against a float64 product of the same FP8 operands (the GEMM backends' bound in tests/gpu)
REL_TOL = 2e-3

_verdicts: dict[str, bool] = {}
_reasons: dict[str, str] = {}


def unavailable_reason(device: torch.device | str) -> str | None:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "vLLM's blockwise CUTLASS kernel needs sm90+"
    try:
        import vllm._custom_ops  # noqa: F401 - registers torch.ops._C
        torch.ops._C.cutlass_scaled_mm  # noqa: B018 - raises where this vLLM build lacks the op
    except Exception as e:  # noqa: BLE001 - no vLLM, or one built without the op
        return f"vLLM's cutlass_scaled_mm is not importable ({type(e).__name__}: {str(e)[:120]})"
    supported = getattr(torch.ops._C, "cutlass_scaled_mm_supports_block_fp8", None)
    cap = torch.cuda.get_device_capability(device)
    if supported is not None and not supported(cap[0] * 10 + cap[1]):
        return "this vLLM build has no blockwise FP8 CUTLASS kernel for this GPU"
    return None


def _call(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, w_t: torch.Tensor, w_scale_t: torch.Tensor) -> None:
    torch.ops._C.cutlass_scaled_mm(out, a, w_t, a_scale, w_scale_t, None)


def decode_gemm(device: torch.device | str):
    """fn(out [Mp, N], a [Mp, K] e4m3, a_scale (Mp, K/128) MN-major, w_t [K, N] (W^T, column-major),
    w_scale_t (K/128, N/128) (the row-major weight scale, transposed)) where the kernel runs here and passed its check,
    else None."""
    device = torch.device(device)

    def warn(why: str) -> None:
        logger.warning("jetrl_fp8: vLLM's CUTLASS blockwise GEMM is not used for eager decode batches on %s: %s. "
                       "cuBLASLt runs them (more host time per call).", device_key(device), why)

    check = lambda: unavailable_reason(device) or first_failure(device)  # noqa: E731
    return _call if verdict_once(_verdicts, _reasons, device_key(device), check, warn) else None


def unusable_reason(device: torch.device | str) -> str:
    """'' where `decode_gemm(device)` gives the kernel, else why not (checks once per device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "not a CUDA device"
    return "" if decode_gemm(device) is not None else _reasons[device_key(device)]


def first_failure(device: torch.device) -> str:
    """'' when the kernel's output is finite and within REL_TOL of a float64 reference (and of cuBLASLt's output)
    on decode-sized products with outliers, else what failed."""
    from ..gemm import torch_backend
    from ..kernels.layout import row_major_padded_t
    from ..quantize import quantize_fp8

    g = torch.Generator(device="cpu").manual_seed(7)
    mm = torch_backend.prepared_scaled_mm(device)
    for m, n, k in ((1, 512, 1024), (3, 1536, 1024), (64, 1024, 4096), (130, 768, 512)):
        mp = -(-m // 4) * 4
        x = torch.randn(mp, k, generator=g) * torch.exp(torch.randn(mp, 1, generator=g))
        x[torch.rand(mp, k, generator=g) < 2e-3] *= 100.0
        w = torch.randn(n, k, generator=g) * 0.02
        xq = quantize_fp8(x.to(torch.bfloat16).to(device), (1, 128))
        wq = quantize_fp8(w.to(torch.bfloat16).to(device), (128, 128))
        a_scale = torch.empty_strided((mp, k // 128), (1, mp), dtype=torch.float32, device=device)
        a_scale.copy_(xq.scale)
        out = torch.empty((mp, n), dtype=torch.bfloat16, device=device)
        _call(out, xq.data, a_scale, wq.data.t(), wq.scale.t())
        ref = xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).t()
        cublas = mm(xq.data, wq.data.t(), a_scale, row_major_padded_t(wq.scale), torch.bfloat16)
        got = out[:m].double()
        if not torch.isfinite(got).all():
            return f"non-finite output at M={m}, N={n}, K={k}"
        err = float((got - ref[:m]).norm() / ref[:m].norm())
        agree = float((got - cublas[:m].double()).norm() / cublas[:m].double().norm())
        if err > REL_TOL or agree > 2 * REL_TOL:
            return f"relative error {err:.2e} against float64 ({agree:.2e} against cuBLASLt) at M={m}, N={n}, K={k}"
    return ""
