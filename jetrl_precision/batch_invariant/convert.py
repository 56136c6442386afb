"""Converting a model to batch-invariant numerics, and reading which numerics a live model runs."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..gemm.dispatch import resolve_backend
from ..gemm.vendor_route import route_state
from ..grouped import unfuse_projections
from ..linear import Fp8Linear
from .attention import register_triton_attention
from .common import (
    CUDA_INVARIANT_GEMM_BACKENDS, INVARIANT_ATTENTION, INVARIANT_GEMM_BACKENDS, TRITON_ATTENTION, BitwiseUnavailable,
    triton_missing,
)
from .linear import InvariantLinear
from .norm import NORM_CLASSES, InvariantRMSNorm

__all__ = ["NumericsReport", "make_batch_invariant", "numerics_of"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NumericsReport:
    """Whether a live model runs batch-invariant numerics, and what says so (or not)."""

    batch_invariant: bool
    attention: str
    linear: str  # the InvariantLinear backends ("fp64", "triton_invariant") when every high-precision linear is one, else "ordinary"
    fp8_gemm: str  # the FP8 GEMM backends, or "-" when there is no FP8 linear
    norm: str = "model"  # "triton" when the RMSNorms are InvariantRMSNorm, else the model's own
    not_invariant: tuple[str, ...] = ()
    vendor_route: str = "-"  # the invariant GEMMs' cuBLASLt route on CUDA ("on"/"off"; gemm.vendor_route), else "-"

    @property
    def mode(self) -> str:
        return "batch_invariant" if self.batch_invariant else "ordinary"

    def detail(self) -> str:
        s = f"attention={self.attention} linear={self.linear} fp8_gemm={self.fp8_gemm}"
        s += " norm=triton" if self.norm == "triton" else ""
        s += f" vendor_route={self.vendor_route}" if self.vendor_route != "-" else ""
        return s if self.batch_invariant else f"{s} (not batch-invariant: {', '.join(self.not_invariant)})"


def _params_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _own_matmul_modules(model: nn.Module) -> list[str]:
    """Modules that hold a weight matrix of their own and are none of the layers the conversion makes invariant
    (nn.Linear is reported apart): MoE experts stored as 3-D tensors, routers calling F.linear on their own
    Parameter, custom heads. Their products run on the backend's ordinary kernels, whose blocking can follow the
    row count, so a model holding one is not batch-invariant whatever else it runs."""
    # Fp8Linear and InvariantLinear subclass nn.Linear. The largest first: the example a message names.
    own = [(sum(p.numel() for p in m.parameters(recurse=False)), f"{n} ({type(m).__name__})") for n, m in model.named_modules()
           if not isinstance(m, (nn.Linear, nn.Embedding)) and any(p.dim() >= 2 for p in m.parameters(recurse=False))]
    return [name for _, name in sorted(own, key=lambda o: -o[0])]


def _ordinary_norms(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm") and not isinstance(m, InvariantRMSNorm)]


def numerics_of(model: nn.Module, device: torch.device | str | None = None) -> NumericsReport:
    """Read the numerics a live model runs: its attention implementation (HF `config._attn_implementation`),
    its high-precision linears, its FP8 GEMM backends and, on CUDA, its RMSNorms.

    `device`: where the model will run (default: where its parameters are). The trainer converts on the CPU before
    DeepSpeed moves the model, so the backends are resolved, and the checks made, for the device it names."""
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or "unknown"
    device = torch.device(device) if device is not None else _params_device(model)
    plain = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.fprop.input.is_fp8 and m.fprop.weight.is_fp8]
    # An Fp8Linear with a high-precision operand multiplies in ordinary fp32 (jetrl_precision.linear._mm).
    unconverted = [m for m in model.modules() if isinstance(m, Fp8Linear) and not (m.fprop.input.is_fp8 and m.fprop.weight.is_fp8)]
    backends = sorted({m.backend_for(device) for m in fp8})
    linear = ",".join(sorted({m.backend for m in model.modules() if isinstance(m, InvariantLinear)})) or "fp64"
    bad = []
    if attn not in (INVARIANT_ATTENTION, TRITON_ATTENTION):
        bad.append(f"attention {attn}")
    elif device.type == "cuda" and attn != TRITON_ATTENTION:
        bad.append(f"attention {attn} on cuda")
    if plain or unconverted:
        bad.append(f"{len(plain) + len(unconverted)} ordinary linear(s)" + (f" (e.g. {plain[0]})" if plain else ""))
    own = _own_matmul_modules(model)
    if own:
        bad.append(f"{len(own)} module(s) with matrix products of their own, which no invariant kernel covers (e.g. {own[0]})")
    gemm_ok = CUDA_INVARIANT_GEMM_BACKENDS if device.type == "cuda" else INVARIANT_GEMM_BACKENDS
    bad += [f"FP8 GEMM backend {b}" + (" on cuda" if device.type == "cuda" else "") for b in backends if b not in gemm_ok]
    norms = _ordinary_norms(model)
    if norms and (attn == TRITON_ATTENTION or device.type == "cuda"):  # CPU reduces a row alone; CUDA does not
        bad.append(f"{len(norms)} ordinary RMSNorm(s) (e.g. {norms[0]})")
    detail_norm = "triton" if any(isinstance(m, InvariantRMSNorm) for m in model.modules()) else "model"
    invariant_gemms = "triton_invariant" in backends or "triton_invariant" in linear
    return NumericsReport(
        batch_invariant=not bad, attention=attn, linear="ordinary" if plain or unconverted else linear,
        fp8_gemm=",".join(backends) or "-", norm=detail_norm, not_invariant=tuple(bad),
        vendor_route=route_state(device) if invariant_gemms else "-",
    )


def make_batch_invariant(
    model: nn.Module, device: torch.device | str | None = None, *, kernels: str | None = None
) -> nn.Module:
    """Convert a model in place to batch-invariant numerics (after `convert_to_fp8`, before `deepspeed.initialize`),
    then check that the whole model runs them.

    `device`: where the model will run (default: where its parameters are; the trainer passes its device, since it
    converts before DeepSpeed moves the model). `kernels`: "fp64" (CPU's, the default there) or "triton" (CUDA's,
    the default there; on CPU only under TRITON_INTERPRET=1, for tests).
    - fp64: plain nn.Linear -> InvariantLinear; the attention must already be `jetrl_invariant` and the FP8 GEMM
      `emulated`.
    - triton: the same linears, Llama-family RMSNorm -> InvariantRMSNorm, the attention switched to
      `jetrl_invariant_triton` (registered here); FP8 linears need the `triton_invariant` GEMM on CUDA.

    Raises BitwiseUnavailable, one line naming what is missing, when Triton is missing, the device has no such
    kernels, an FP8 GEMM backend or the attention is not batch-invariant, or a norm has no invariant kernel."""
    dev = torch.device(device) if device is not None else _params_device(model)
    if dev.type not in ("cpu", "cuda"):
        raise BitwiseUnavailable(f"batch-invariant numerics run on CPU and CUDA, not on {dev.type}")
    kernels = kernels or ("triton" if dev.type == "cuda" else "fp64")
    if kernels not in ("fp64", "triton"):
        raise ValueError(f"make_batch_invariant: kernels must be 'fp64' or 'triton', got {kernels!r}")
    if kernels == "fp64" and dev.type == "cuda":
        raise BitwiseUnavailable("on cuda the batch-invariant numerics are the Triton kernels (kernels='triton'), not fp64")
    if kernels == "triton":
        why = triton_missing(dev)
        if why:
            raise BitwiseUnavailable(f"batch-invariant numerics on {dev.type} need the Triton kernels: {why}")
        odd = sorted({type(m).__name__ for m in model.modules()
                      if type(m).__name__.endswith("RMSNorm") and type(m).__name__ not in NORM_CLASSES and not isinstance(m, InvariantRMSNorm)})
        if odd:
            raise BitwiseUnavailable(f"no batch-invariant kernel for {', '.join(odd)} (the Triton RMSNorm covers {', '.join(NORM_CLASSES)})")
        softcap = getattr(getattr(model, "config", None), "attn_logit_softcapping", None)
        if softcap:
            raise BitwiseUnavailable(f"no batch-invariant Triton kernel for attention logit soft-capping "
                                     f"(attn_logit_softcapping={softcap}, Gemma2)")
        if not hasattr(model, "set_attn_implementation"):
            raise BitwiseUnavailable(f"{type(model).__name__} is not a transformers model: its attention cannot be switched to {TRITON_ATTENTION}")
        model.set_attn_implementation(register_triton_attention())
    # The invariance proofs (and the cuBLASLt route's probes) are per layer shape: each projection runs its own GEMM.
    if unfuse_projections(model):
        logger.info("batch-invariant numerics: stacked q/k/v and gate/up GEMMs off; each projection runs its own")
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in fp8:  # only the forward feeds the engine's bits: DGrad and WGrad take the fastest backend
        if m.backward_gemm_backend is None:
            m.backward_gemm_backend = "auto"
    if fp8:
        logger.info("batch-invariant numerics: %d FP8 linears run their forward GEMMs on %s and their backward on %s",
                    len(fp8), fp8[0].gemm_backend, resolve_backend("auto", dev))
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, InvariantLinear.from_linear(child, kernels))
            elif kernels == "triton" and type(child).__name__ in NORM_CLASSES:
                setattr(module, name, InvariantRMSNorm.from_norm(child))
    own = _own_matmul_modules(model)
    if own:
        raise BitwiseUnavailable(
            f"no batch-invariant kernel for {len(own)} module(s) with matrix products of their own (e.g. {own[0]}): "
            "bitwise numerics cover nn.Linear, the FP8 linears, embeddings, RMSNorm and attention (not MoE experts or routers)"
        )
    report = numerics_of(model, dev)
    if kernels == "fp64" and not report.batch_invariant:
        raise BitwiseUnavailable(
            f"the model is not batch-invariant after conversion: {', '.join(report.not_invariant)}; load it with "
            f"attn_implementation={INVARIANT_ATTENTION!r} and use the emulated FP8 GEMM backend"
        )
    gemm_ok = CUDA_INVARIANT_GEMM_BACKENDS if dev.type == "cuda" else INVARIANT_GEMM_BACKENDS
    fp8_bad = [b for b in report.fp8_gemm.split(",") if b != "-" and b not in gemm_ok]
    if fp8_bad:
        raise BitwiseUnavailable(
            f"the FP8 linears run the {', '.join(fp8_bad)} GEMM, whose tiling depends on the row count; batch-invariant "
            f"numerics on {dev.type} need --precision.gemm_backend "
            f"{' or '.join(sorted(gemm_ok))} (recipe field gemm_backend)"
        )
    if not report.batch_invariant:
        raise BitwiseUnavailable(f"the model is not batch-invariant after conversion: {', '.join(report.not_invariant)}")
    if dev.type == "cuda" and "fp64" in report.linear:
        logger.info("batch-invariant numerics on cuda: fp32 high-precision linears accumulate in float64 (InvariantLinear)")
    return model
