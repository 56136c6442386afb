"""Liger's Triton kernels in the training forwards (`--ds.use_liger_kernel`, OpenRLHF's `--use_liger_kernel`).

In eager training, transformers' RMSNorm and rotary embedding run as chains of small elementwise kernels with
float32 intermediates; together with the residual adds they are a third of a Llama micro-step's GPU time for BF16
and FP8 alike. Liger replaces them with one fused kernel each (forward and backward).

What is replaced, and why not more:
- RMSNorm and rotary: everywhere. The FP8 flow does not touch them (they run in BF16 in the engine too).
- SwiGLU: only where the MLP stays BF16 (bf16 and fp8_rollout training). An FP8 MLP keeps the precision flow's own
  fused SwiGLU (`jetrl_precision.swiglu`), which also quantizes the product for the down projection.
- Fused linear cross-entropy: never. The trainer needs per-token log-probs, not a loss over labels.

Only this model's modules are patched: Liger's apply functions also swap the classes in transformers' modeling
module (a later model of the family would be built from Liger's classes, and an FP8 conversion would no longer
recognize its MLP); those are put back. The rotary function stays patched at module level, the only place it can
be: every model of that family in the process uses it. The bitwise mode runs its own batch-invariant norm and
rotary kernels (the engine's) and refuses Liger.

    kernels = apply_liger_kernels(model)   # after convert_to_fp8 / Fp8Converter.convert
"""

from __future__ import annotations

import importlib.util
import logging
import sys

import torch
from torch import nn

__all__ = ["LIGER_PIN", "liger_missing", "apply_liger_kernels"]

logger = logging.getLogger(__name__)

LIGER_PIN = "liger-kernel==0.8.5"  # the version the GPU tests ran


def liger_missing(cuda: bool | None = None) -> str | None:
    """Why Liger cannot run here (one phrase), or None."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        return "no CUDA device (Liger's kernels are Triton GPU kernels)"
    for module, pkg in (("triton", "triton"), ("liger_kernel", LIGER_PIN)):
        if importlib.util.find_spec(module) is None:
            return f"the {module} package is not installed (pip install {pkg})"
    return None


def _has_fp8_linears(model: nn.Module) -> bool:
    from jetrl_precision.linear import Fp8Linear

    return any(isinstance(m, Fp8Linear) for m in model.modules())


def _liger_norms(model: nn.Module) -> int:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    return sum(1 for m in model.modules() if getattr(m.forward, "__func__", None) is LigerRMSNorm.forward)


def apply_liger_kernels(model: nn.Module) -> tuple[str, ...]:
    """Patch `model` (a transformers causal LM or base model) in place; returns the kernels applied.

    Raises ValueError naming the model type when Liger has no kernels for it (rather than training unpatched)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(
            f"--ds.use_liger_kernel: Liger has no kernels for model type {model_type!r}; drop the flag for this model"
        )
    swiglu = not _has_fp8_linears(model)
    modeling = sys.modules[type(model).__module__]
    classes = {k: v for k, v in vars(modeling).items() if isinstance(v, type)}
    try:
        _apply_liger_kernel_to_instance(
            model=model, rope=True, rms_norm=True, swiglu=swiglu, cross_entropy=False, fused_linear_cross_entropy=False
        )
    finally:
        for k, v in classes.items():
            if getattr(modeling, k) is not v:
                setattr(modeling, k, v)
    if _liger_norms(model) == 0:  # an apply function that found no norm modules: say so rather than run unpatched
        raise ValueError(f"--ds.use_liger_kernel: Liger patched no RMSNorm in this {model_type} model; drop the flag")
    kernels = ("rms_norm", "rope", *(("swiglu",) if swiglu else ()))
    logger.info("Liger kernels in the %s forward: %s", model_type, ", ".join(kernels))
    return kernels
