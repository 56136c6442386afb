"""Batch-invariant numerics: each row's result does not depend on how many rows run with it.

A rollout engine decodes one token per sequence against a KV cache; the trainer recomputes the
whole sequence in one forward. With ordinary kernels the two reduce in shape-dependent orders
and differ by float noise, which e4m3 rounding turns into flipped FP8 codes (docs/precision.md,
"Bitwise mode"). When every op that feeds a quantizer or the logits is batch-invariant, decode
and full forward give the same bits, and the engine's log-probs *are* the trainer's.

`make_batch_invariant(model, device=...)` converts a model for the device it will run on.

On CPU:
- `fp64_attention`: scores, softmax and the weighted sum in float64, rounded once (transformers'
  attention-function signature; `openrlhf.models.invariant_attention` registers it as
  `jetrl_invariant`);
- `InvariantLinear`: the high-precision linears (lm_head, everything under the bf16 recipe) with
  float64 accumulation, rounded once; its backward uses ordinary kernels;
- the FP8 linears need the `emulated` GEMM backend (float64 accumulation as well);
- RMSNorm stays transformers' (CPU reduces each row on its own, in one order).

On CUDA (Triton kernels, `jetrl_precision.kernels.invariant_*`; one program per row or per query tile, fixed
blocks whatever the launch):
- `triton_attention` (registered as `jetrl_invariant_triton`): causal GQA attention whose prefill row equals the
  KV-cached decode of that token, the same kernel the engine's paged path runs;
- `InvariantRMSNorm` replaces the Llama-family RMSNorm modules (same Parameter, transformers' rounding points);
- `invariant_log_probs`: log-softmax and the chosen token's log-prob in fp32, one fixed order per row;
- the high-precision linears are `InvariantLinear` (float64, as on CPU) until an M-invariant BF16 GEMM replaces
  them; the FP8 linears need the M-invariant `triton_invariant` backend. The backwards use ordinary kernels.

Float64 accumulation is invariant in practice, not by construction: two orders of a float64 sum
differ by ~1e-16 relative, which changes the value rounded to fp32/bf16 only when it lies that
close to a rounding midpoint. That is why the trainer proves equality on a sample of tokens
every step before it uses the engine's log-probs. Elementwise ops (SiLU*mul, residual adds,
rotary with the same cos/sin) are invariant by nature.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Fp8Linear

__all__ = [
    "INVARIANT_ATTENTION",
    "TRITON_ATTENTION",
    "INVARIANT_GEMM_BACKENDS",
    "CUDA_INVARIANT_GEMM_BACKENDS",
    "CUDA_MISSING_KERNELS",
    "BitwiseUnavailable",
    "InvariantLinear",
    "InvariantRMSNorm",
    "NumericsReport",
    "fp64_attention",
    "invariant_log_probs",
    "make_batch_invariant",
    "numerics_of",
    "register_triton_attention",
    "triton_attention",
    "uses_triton_kernels",
]

logger = logging.getLogger(__name__)

INVARIANT_ATTENTION = "jetrl_invariant"  # float64 attention (CPU)
TRITON_ATTENTION = "jetrl_invariant_triton"  # the Triton kernel shared with the engine (CUDA)
# FP8 GEMM backends whose per-row result does not depend on M: float64 accumulation (emulated, invariant in
# practice), and the fixed-tiling Triton GEMM (jetrl_precision/kernels/invariant_gemm.py).
INVARIANT_GEMM_BACKENDS = frozenset({"emulated", "triton_invariant"})
# On CUDA the FP8 linears must run the fixed-tiling kernel; the float64 emulation is a CPU reference.
CUDA_INVARIANT_GEMM_BACKENDS = frozenset({"triton_invariant"})
# What --precision.bitwise still lacks on CUDA (docs/precision.md, "Bitwise mode on the H200"); the preflight names
# these. The kernels exist (attention, RMSNorm, log-softmax here; the FP8/BF16 GEMM in kernels.invariant_gemm) and
# the transformers path is wired (trainer and engine); what is left is vLLM's side and proof on the hardware.
CUDA_MISSING_KERNELS = (
    "the vLLM 0.26 engine side (RMSNorm, rotary, attention backend, log-softmax and the jetrl_fp8 linear method on "
    "these kernels)",
    "a passing run of the kernels' GPU tests on the H200 (tests/gpu/test_invariant_kernels_gpu.py, "
    "test_invariant_gemm_gpu.py)",
)
_NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")  # weight * x/rms, cast first
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


_GEMM_DTYPES = (torch.bfloat16, torch.float16)  # what the batch-invariant Triton GEMM multiplies


class _InvariantLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, triton_gemm: bool) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        ctx.save_for_backward(x2, weight)
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        if triton_gemm and x2.dtype in _GEMM_DTYPES and weight.dtype == x2.dtype:
            from .kernels.invariant_gemm import linear_invariant  # fixed tiling and K order whatever M

            return linear_invariant(x2, weight, bias).reshape(*lead, weight.shape[0])
        return _fp64_linear(x2, weight, bias).reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        # The backward needs no invariance (nothing samples from it): ordinary kernels in the model dtype.
        x2, weight = ctx.saved_tensors
        gy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = (gy @ weight.to(gy.dtype)).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grad_w = (gy.t() @ x2.to(gy.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = gy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class InvariantLinear(nn.Linear):
    """nn.Linear whose forward gives each row the same bits whatever the batch.

    - `kernels="fp64"` (CPU): float64 accumulation, rounded once to the input dtype (invariant in practice);
    - `kernels="triton"` (CUDA): bf16/fp16 weights run `kernels.invariant_gemm.linear_invariant` (tiling and K
      order fixed by the weight's shape, fp32 accumulation, invariant by construction); fp32 weights keep fp64.
    `backend` names which one it runs (the precision graph records it). Build it with
    `InvariantLinear.from_linear(linear, kernels)`: it adopts the same Parameter objects (optimizers, ZeRO
    partitioning and checkpoints see no change), as `Fp8Linear` does. The backward uses ordinary kernels."""

    kernels: str = "fp64"

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernels: str = "fp64") -> "InvariantLinear":
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        new.kernels = kernels
        for key in ("ds_id", "_z3_leaf"):
            if hasattr(linear, key):
                setattr(new, key, getattr(linear, key))
        return new

    @property
    def backend(self) -> str:
        return "triton_invariant" if self.kernels == "triton" and self.weight.dtype in _GEMM_DTYPES else "fp64"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"InvariantLinear: input last dim {x.shape[-1]} != in_features {self.in_features}")
        triton_gemm = self.backend == "triton_invariant"
        if triton_gemm:
            _require_triton(x, "InvariantLinear")
        return _InvariantLinearFunction.apply(x, self.weight, self.bias, triton_gemm)


# ---- CUDA: the Triton kernels ------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_missing(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None when they can."""
    from .kernels import triton_available

    if not triton_available():
        return "Triton is not installed (pip install triton)"
    if device.type != "cuda" and not _interpreting():
        return f"the Triton kernels run on CUDA (or on CPU under TRITON_INTERPRET=1), not on {device.type}"
    return None


def _require_triton(t: torch.Tensor, what: str) -> None:
    why = _triton_missing(t.device)
    if why:
        raise BitwiseUnavailable(f"{what}: {why}")


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from .kernels.invariant_norm import rms_norm

        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        # Nothing samples from the backward: transformers' formula in torch ops, differentiated by autograd.
        from .kernels.invariant_norm import rms_norm_reference

        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xg = x.detach().requires_grad_(ctx.needs_input_grad[0])
            wg = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            y = rms_norm_reference(xg, wg, ctx.eps)
            inputs = [t for t in (xg, wg) if t.requires_grad]
            grads = iter(torch.autograd.grad(y, inputs, grad_out)) if inputs else iter(())
        return (next(grads) if ctx.needs_input_grad[0] else None), (next(grads) if ctx.needs_input_grad[1] else None), None


class InvariantRMSNorm(nn.Module):
    """A Llama-family RMSNorm whose forward is the batch-invariant Triton kernel (`kernels.invariant_norm`).

    `InvariantRMSNorm.from_norm(norm)` adopts the same weight Parameter and epsilon; the rounding points are
    transformers' (`weight * (x.float() * rsqrt(var + eps)).to(x.dtype)`), the backward is transformers' formula."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = float(eps)

    @classmethod
    def from_norm(cls, norm: nn.Module) -> "InvariantRMSNorm":
        new = cls(norm.weight, norm.variance_epsilon)
        for key in ("ds_id", "_z3_leaf"):
            if hasattr(norm, key):
                setattr(new, key, getattr(norm, key))
        return new

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        _require_triton(hidden_states, "InvariantRMSNorm")
        return _RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


@dataclass(frozen=True)
class _Segments:
    """Where each sequence's queries and keys sit in the flattened [B * T] token axes."""

    q_start: torch.Tensor
    q_len: torch.Tensor
    k_start: torch.Tensor
    k_len: torch.Tensor
    max_q_len: int


# The last layout (every layer of a forward shares it): (its mask or position ids, their version, the shapes, the
# segments). The entry holds the tensor itself, so a freed tensor's id and memory cannot be mistaken for it.
_segment_cache: list[tuple[torch.Tensor | None, int, tuple, _Segments]] = []


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs of True as (start, length)."""
    out, start = [], None
    for i, f in enumerate(flags + [False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i - start))
            start = None
    return out


def _segments(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, b: int, tq: int, tk: int,
              device: torch.device) -> _Segments:
    """Per-sequence rows for a transformers call: [B, Tq] queries against [B, Tk] keys.

    - a 2-D padding mask (1 = real token): each row's real keys must be one contiguous run (left and/or right
      padding); with Tq == Tk the queries are the same run, with Tq < Tk (cached decode) the last Tq keys;
    - no mask, Tq == Tk and position ids that restart (packed rows): one sequence per run of consecutive ids;
    - otherwise each row is one sequence whose queries are its last Tq keys.
    Reading the mask or the position ids costs one host copy per layout (cached while it stays the same)."""
    src = attention_mask if attention_mask is not None else (position_ids if tq == tk else None)
    key, version = (b, tq, tk, str(device)), -1 if src is None else src._version
    if _segment_cache:
        c_src, c_version, c_key, c_seg = _segment_cache[0]
        if c_src is src and c_version == version and c_key == key:
            return c_seg
    rows: list[tuple[int, int, int, int]] = []  # (q_start, q_len, k_start, k_len) per sequence
    if attention_mask is not None:
        mask = attention_mask.bool().cpu()
        if mask.shape != (b, tk):
            raise ValueError(f"{TRITON_ATTENTION}: expected a [batch, keys] = {(b, tk)} padding mask, got {tuple(mask.shape)}")
        for row in range(b):
            runs = _runs(mask[row].tolist())
            if len(runs) != 1:
                raise ValueError(
                    f"{TRITON_ATTENTION}: row {row} of the padding mask has {len(runs)} runs of real tokens; it needs "
                    "exactly one (left/right padding, no holes, no empty rows)"
                )
            first, count = runs[0]
            if tq == tk:
                rows.append((row * tq + first, count, row * tk + first, count))
            elif first + count != tk or count < tq:
                raise ValueError(f"{TRITON_ATTENTION}: a cached call (queries {tq} < keys {tk}) needs left padding only")
            else:
                rows.append((row * tq, tq, row * tk + first, count))
    elif tq == tk and position_ids is not None:
        pos = position_ids.expand(b, -1).cpu().tolist()
        for row in range(b):
            starts = [t for t in range(tq) if t == 0 or pos[row][t] != pos[row][t - 1] + 1] + [tq]
            rows += [(row * tq + s0, s1 - s0, row * tk + s0, s1 - s0) for s0, s1 in zip(starts[:-1], starts[1:])]
    else:
        rows = [(row * tq, tq, row * tk, tk) for row in range(b)]
    q_start, q_len, k_start, k_len = (list(c) for c in zip(*rows)) if rows else ([], [], [], [])
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    seg = _Segments(as_t(q_start), as_t(q_len), as_t(k_start), as_t(k_len), max(q_len, default=0))
    _segment_cache[:] = [(src, version, key, seg)]
    return seg


def _segment_mask(seg: _Segments, b: int, tq: int, tk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same causal pattern as a dense bool mask [B, 1, Tq, Tk], and which query rows are real [B, Tq]."""
    seq_q = torch.full((b * tq,), -1, dtype=torch.long)
    pos_q = torch.zeros(b * tq, dtype=torch.long)
    seq_k = torch.full((b * tk,), -2, dtype=torch.long)
    pos_k = torch.zeros(b * tk, dtype=torch.long)
    for i, (qs, ql, ks, kl) in enumerate(zip(*(t.tolist() for t in (seg.q_start, seg.q_len, seg.k_start, seg.k_len)))):
        seq_q[qs : qs + ql] = i
        pos_q[qs : qs + ql] = torch.arange(kl - ql, kl)
        seq_k[ks : ks + kl] = i
        pos_k[ks : ks + kl] = torch.arange(kl)
    seq_q, pos_q, seq_k, pos_k = (t.to(device) for t in (seq_q.view(b, tq), pos_q.view(b, tq), seq_k.view(b, tk), pos_k.view(b, tk)))
    allowed = (seq_q[:, :, None] == seq_k[:, None, :]) & (pos_k[:, None, :] <= pos_q[:, :, None])
    return allowed[:, None], seq_q >= 0


class _TritonAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query, key, value, seg: _Segments, scaling: float):
        from .kernels.invariant_attention import attention_segments

        b, h, tq, d = query.shape
        tk = key.shape[2]
        q = query.transpose(1, 2).reshape(b * tq, h, d)
        k = key.transpose(1, 2).reshape(b * tk, key.shape[1], d)
        v = value.transpose(1, 2).reshape(b * tk, value.shape[1], d)
        out = attention_segments(q, k, v, seg.q_start, seg.q_len, seg.k_start, seg.k_len, seg.max_q_len, scaling)
        ctx.save_for_backward(query, key, value)
        ctx.seg, ctx.scaling = seg, scaling
        return out.view(b, tq, h, d)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        # The backward needs no invariance: torch's SDPA on the same causal pattern, differentiated by autograd.
        query, key, value = ctx.saved_tensors
        b, h, tq, _ = query.shape
        allowed, real = _segment_mask(ctx.seg, b, tq, key.shape[2], query.device)
        allowed = allowed | ~real[:, None, :, None]  # padding rows attend anything; their gradient is zeroed below
        groups = h // key.shape[1]
        with torch.enable_grad():
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (query, key, value))
            out = F.scaled_dot_product_attention(
                qg, kg.repeat_interleave(groups, 1), vg.repeat_interleave(groups, 1), attn_mask=allowed, scale=ctx.scaling
            )
            g = (grad_out * real[:, :, None, None]).transpose(1, 2)
            dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), g)
        return dq, dk, dv, None, None


def triton_attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature ([B, H, Tq, D] in, [B, Tq, H, D] out) over the batch-invariant
    Triton kernel (`kernels.invariant_attention`): the trainer's full forward and a KV-cached decode of the same
    tokens give the same bits. `attention_mask` is the 2-D padding mask (registered with transformers'
    flash-attention mask builder); packed rows are read from `position_ids`."""
    if dropout:
        raise ValueError(f"{TRITON_ATTENTION}: attention dropout {dropout} is not supported (bitwise mode samples none)")
    _require_triton(query, TRITON_ATTENTION)
    b, _, tq, d = query.shape
    tk = key.shape[2]
    if tq > tk:
        raise ValueError(f"{TRITON_ATTENTION}: {tq} queries against {tk} keys")
    seg = _segments(attention_mask, kwargs.get("position_ids"), b, tq, tk, query.device)
    scale = float(scaling) if scaling is not None else d**-0.5
    return _TritonAttentionFunction.apply(query, key, value, seg, scale), None


_triton_registered: list[bool] = []


def register_triton_attention() -> str:
    """Register `triton_attention` (with the 2-D padding-mask builder it reads) with transformers; idempotent."""
    if not _triton_registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

        AttentionInterface.register(TRITON_ATTENTION, triton_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(TRITON_ATTENTION, flash_attention_mask)
        _triton_registered.append(True)
    return TRITON_ATTENTION


class _LogProbFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
        from .kernels.invariant_softmax import logprobs_of_labels

        out, lse = logprobs_of_labels(logits, labels, temperature, return_lse=True)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        # d logp[label] / d logit = (onehot - softmax) / T, with softmax from the forward's logsumexp.
        logits, labels, lse = ctx.saved_tensors
        t = ctx.temperature
        p = torch.exp(logits.float() / t - lse.unsqueeze(-1))
        g = -p * grad_out.unsqueeze(-1)
        g.scatter_add_(-1, labels.long().unsqueeze(-1), grad_out.unsqueeze(-1))
        return (g / t).to(logits.dtype), None, None


def uses_triton_kernels(model: nn.Module) -> bool:
    """Whether `make_batch_invariant` gave `model` the Triton kernels: then its log-probs must come from
    `invariant_log_probs` too (the trainer's Actor and the transformers engine both ask this)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == TRITON_ATTENTION


def invariant_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[labels] in fp32 with one fixed reduction order per row (the Triton kernel
    `kernels.invariant_softmax`): what `openrlhf.models.utils.log_probs_from_logits` computes, batch-invariant."""
    _require_triton(logits, "invariant_log_probs")
    return _LogProbFunction.apply(logits, labels, float(temperature))


# ---- the live model's numerics ------------------------------------------------------------------
@dataclass(frozen=True)
class NumericsReport:
    """Whether a live model runs batch-invariant numerics, and what says so (or not)."""

    batch_invariant: bool
    attention: str
    linear: str  # the InvariantLinear backends ("fp64", "triton_invariant") when every high-precision linear is one, else "ordinary"
    fp8_gemm: str  # the FP8 GEMM backends, or "-" when there is no FP8 linear
    norm: str = "model"  # "triton" when the RMSNorms are InvariantRMSNorm, else the model's own
    not_invariant: tuple[str, ...] = ()

    @property
    def mode(self) -> str:
        return "batch_invariant" if self.batch_invariant else "ordinary"

    def detail(self) -> str:
        s = f"attention={self.attention} linear={self.linear} fp8_gemm={self.fp8_gemm}"
        s += " norm=triton" if self.norm == "triton" else ""
        return s if self.batch_invariant else f"{s} (not batch-invariant: {', '.join(self.not_invariant)})"


def _params_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _ordinary_norms(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm") and not isinstance(m, InvariantRMSNorm)]


def numerics_of(model: nn.Module) -> NumericsReport:
    """Read the numerics a live model runs: its attention implementation (HF `config._attn_implementation`),
    its high-precision linears, its FP8 GEMM backends and, on CUDA, its RMSNorms."""
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or "unknown"
    device = _params_device(model)
    plain = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.fprop.input.is_fp8 and m.fprop.weight.is_fp8]
    # An Fp8Linear with a high-precision operand multiplies in ordinary fp32 (jetrl_precision.linear._mm).
    unconverted = [m for m in model.modules() if isinstance(m, Fp8Linear) and not (m.fprop.input.is_fp8 and m.fprop.weight.is_fp8)]
    backends = sorted({m.resolved_backend for m in fp8})
    linear = ",".join(sorted({m.backend for m in model.modules() if isinstance(m, InvariantLinear)})) or "fp64"
    bad = []
    if attn not in (INVARIANT_ATTENTION, TRITON_ATTENTION):
        bad.append(f"attention {attn}")
    elif device.type == "cuda" and attn != TRITON_ATTENTION:
        bad.append(f"attention {attn} on cuda")
    if plain or unconverted:
        bad.append(f"{len(plain) + len(unconverted)} ordinary linear(s)" + (f" (e.g. {plain[0]})" if plain else ""))
    gemm_ok = CUDA_INVARIANT_GEMM_BACKENDS if device.type == "cuda" else INVARIANT_GEMM_BACKENDS
    bad += [f"FP8 GEMM backend {b}" + (" on cuda" if device.type == "cuda" else "") for b in backends if b not in gemm_ok]
    norms = _ordinary_norms(model)
    if norms and (attn == TRITON_ATTENTION or device.type == "cuda"):  # CPU reduces a row alone; CUDA does not
        bad.append(f"{len(norms)} ordinary RMSNorm(s) (e.g. {norms[0]})")
    detail_norm = "triton" if any(isinstance(m, InvariantRMSNorm) for m in model.modules()) else "model"
    return NumericsReport(
        batch_invariant=not bad, attention=attn, linear="ordinary" if plain or unconverted else linear,
        fp8_gemm=",".join(backends) or "-", norm=detail_norm, not_invariant=tuple(bad),
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
    Converting is not the whole mode: on CUDA the preflight still refuses --precision.bitwise for
    `CUDA_MISSING_KERNELS`.

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
        why = _triton_missing(dev)
        if why:
            raise BitwiseUnavailable(f"batch-invariant numerics on {dev.type} need the Triton kernels: {why}")
        odd = sorted({type(m).__name__ for m in model.modules()
                      if type(m).__name__.endswith("RMSNorm") and type(m).__name__ not in _NORM_CLASSES and not isinstance(m, InvariantRMSNorm)})
        if odd:
            raise BitwiseUnavailable(f"no batch-invariant kernel for {', '.join(odd)} (the Triton RMSNorm covers {', '.join(_NORM_CLASSES)})")
        if not hasattr(model, "set_attn_implementation"):
            raise BitwiseUnavailable(f"{type(model).__name__} is not a transformers model: its attention cannot be switched to {TRITON_ATTENTION}")
        model.set_attn_implementation(register_triton_attention())
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, InvariantLinear.from_linear(child, kernels))
            elif kernels == "triton" and type(child).__name__ in _NORM_CLASSES:
                setattr(module, name, InvariantRMSNorm.from_norm(child))
    report = numerics_of(model)
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
