"""Batch-invariant numerics: each row's result does not depend on how many rows run with it.

A rollout engine decodes one token per sequence against a KV cache; the trainer recomputes the
whole sequence in one forward. With ordinary kernels the two reduce in shape-dependent orders
and differ by float noise, which e4m3 rounding turns into flipped FP8 codes (docs/precision.md,
"Bitwise mode"). When every op that feeds a quantizer or the logits is batch-invariant, decode
and full forward give the same bits, and the engine's log-probs *are* the trainer's.

What this module provides, on CPU:
- `fp64_attention`: scores, softmax and the weighted sum in float64, rounded once (transformers'
  attention-function signature; `openrlhf.models.invariant_attention` registers it as
  `jetrl_invariant`);
- `InvariantLinear`: the high-precision linears (lm_head, everything under the bf16 recipe) with
  float64 accumulation, rounded once; its backward uses ordinary kernels;
- the FP8 linears need the `emulated` GEMM backend (float64 accumulation as well).

Float64 accumulation is invariant in practice, not by construction: two orders of a float64 sum
differ by ~1e-16 relative, which changes the value rounded to fp32/bf16 only when it lies that
close to a rounding midpoint. That is why the trainer proves equality on a sample of tokens
every step before it uses the engine's log-probs. Elementwise ops (SiLU*mul, residual adds,
rotary with the same cos/sin) are invariant by nature; RMSNorm's per-row reduction on CPU runs
one row at a time. On CUDA none of this holds for the ordinary kernels: `make_batch_invariant`
refuses there and names what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Fp8Linear

__all__ = [
    "INVARIANT_ATTENTION",
    "INVARIANT_GEMM_BACKENDS",
    "CUDA_MISSING_KERNELS",
    "BitwiseUnavailable",
    "InvariantLinear",
    "NumericsReport",
    "fp64_attention",
    "make_batch_invariant",
    "numerics_of",
]

INVARIANT_ATTENTION = "jetrl_invariant"
# FP8 GEMM backends whose per-row result does not depend on M (float64 accumulation).
INVARIANT_GEMM_BACKENDS = frozenset({"emulated"})
# What a CUDA device would need before the mode can run there (docs/precision.md, "Plan for the H200").
CUDA_MISSING_KERNELS = (
    "RMSNorm (+residual)",
    "attention with prefill = KV-cached decode",
    "FP8 block GEMM with an M-independent tiling",
    "lm_head GEMM and log-softmax",
)
# Rows per float64 block in InvariantLinear: bounds the float64 output to ~64 MiB whatever the batch.
_FP64_OUT_ELEMS = 1 << 23


class BitwiseUnavailable(RuntimeError):
    """Batch-invariant numerics cannot run here; the message names what is missing."""


# ---- attention --------------------------------------------------------------------------------
def fp64_attention(module: nn.Module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention in float64, rounded once to the query dtype ([B, H, T, D] in, [B, T, H, D] out).

    Masked keys get exp(min) == 0 exactly in float64, so padding and cache length do not change a row."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.double(), k.transpose(2, 3)) * scaling
    if attention_mask is not None:  # additive mask
        scores = scores + attention_mask[:, :, :, : k.shape[-2]].double()
    probs = torch.softmax(scores, dim=-1)
    if dropout and module.training:
        probs = F.dropout(probs, p=dropout)
    out = torch.matmul(probs, v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


# ---- linear -----------------------------------------------------------------------------------
def _fp64_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    w = weight.double().t()
    b = None if bias is None else bias.double()
    rows = max(1, _FP64_OUT_ELEMS // max(weight.shape[0], 1))
    out = x2.new_empty(x2.shape[0], weight.shape[0])
    for start in range(0, x2.shape[0], rows):  # row blocks: a row's result is the same in any block
        y = x2[start : start + rows].double() @ w
        out[start : start + rows] = (y if b is None else y + b).to(x2.dtype)
    return out


class _InvariantLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        ctx.save_for_backward(x2, weight)
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return _fp64_linear(x2, weight, bias).reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        # The backward needs no invariance (nothing samples from it): ordinary kernels in the model dtype.
        x2, weight = ctx.saved_tensors
        gy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = (gy @ weight.to(gy.dtype)).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grad_w = (gy.t() @ x2.to(gy.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = gy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class InvariantLinear(nn.Linear):
    """nn.Linear with a float64-accumulated forward, rounded once to the input dtype.

    Build it with `InvariantLinear.from_linear(linear)`: it adopts the same Parameter objects
    (optimizers, ZeRO partitioning and checkpoints see no change), as `Fp8Linear` does."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "InvariantLinear":
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        for key in ("ds_id", "_z3_leaf"):
            if hasattr(linear, key):
                setattr(new, key, getattr(linear, key))
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"InvariantLinear: input last dim {x.shape[-1]} != in_features {self.in_features}")
        return _InvariantLinearFunction.apply(x, self.weight, self.bias)


# ---- the live model's numerics ------------------------------------------------------------------
@dataclass(frozen=True)
class NumericsReport:
    """Whether a live model runs batch-invariant numerics, and what says so (or not)."""

    batch_invariant: bool
    attention: str
    linear: str  # "fp64" when every high-precision linear is an InvariantLinear, else "ordinary"
    fp8_gemm: str  # the FP8 GEMM backends, or "-" when there is no FP8 linear
    not_invariant: tuple[str, ...] = ()

    @property
    def mode(self) -> str:
        return "batch_invariant" if self.batch_invariant else "ordinary"

    def detail(self) -> str:
        s = f"attention={self.attention} linear={self.linear} fp8_gemm={self.fp8_gemm}"
        return s if self.batch_invariant else f"{s} (not batch-invariant: {', '.join(self.not_invariant)})"


def _params_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def numerics_of(model: nn.Module) -> NumericsReport:
    """Read the numerics a live model runs: its attention implementation (HF `config._attn_implementation`),
    its high-precision linears and its FP8 GEMM backends."""
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or "unknown"
    plain = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.fprop.input.is_fp8 and m.fprop.weight.is_fp8]
    # An Fp8Linear with a high-precision operand multiplies in ordinary fp32 (jetrl_precision.linear._mm).
    unconverted = [m for m in model.modules() if isinstance(m, Fp8Linear) and not (m.fprop.input.is_fp8 and m.fprop.weight.is_fp8)]
    backends = sorted({m.resolved_backend for m in fp8})
    bad = []
    if attn != INVARIANT_ATTENTION:
        bad.append(f"attention {attn}")
    if plain or unconverted:
        bad.append(f"{len(plain) + len(unconverted)} ordinary linear(s)" + (f" (e.g. {plain[0]})" if plain else ""))
    bad += [f"FP8 GEMM backend {b}" for b in backends if b not in INVARIANT_GEMM_BACKENDS]
    return NumericsReport(
        batch_invariant=not bad, attention=attn, linear="ordinary" if plain or unconverted else "fp64",
        fp8_gemm=",".join(backends) or "-", not_invariant=tuple(bad),
    )


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Swap the model's plain nn.Linear layers for InvariantLinear in place (after `convert_to_fp8`, before
    `deepspeed.initialize`), then check that the whole model now runs batch-invariant numerics.

    Raises BitwiseUnavailable, naming what is missing, on a device without batch-invariant kernels
    (CUDA today), or when the attention or an FP8 GEMM backend is not batch-invariant."""
    device = _params_device(model)
    if device.type != "cpu":
        raise BitwiseUnavailable(
            f"batch-invariant numerics run on CPU only; {device.type} lacks batch-invariant kernels for "
            f"{', '.join(CUDA_MISSING_KERNELS)}"
        )
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, InvariantLinear.from_linear(child))
    report = numerics_of(model)
    if not report.batch_invariant:
        raise BitwiseUnavailable(
            f"the model is not batch-invariant after conversion: {', '.join(report.not_invariant)}; load it with "
            f"attn_implementation={INVARIANT_ATTENTION!r} and use the emulated FP8 GEMM backend"
        )
    return model
