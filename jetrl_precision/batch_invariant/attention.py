"""Batch-invariant attention in transformers' attention-function signature.

- `fp64_attention` (CPU, registered by openrlhf as `jetrl_invariant`): float64 scores, softmax and sum, rounded once;
- `triton_attention` (CUDA, `jetrl_invariant_triton`): the Triton kernel (`kernels.invariant_attention`) whose
  prefill row equals the KV-cached decode of that token. The batch's layout (padding, packed rows, a cache) is
  turned into per-sequence segments, read once per layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .common import INVARIANT_ATTENTION, TRITON_ATTENTION, require_triton

__all__ = ["fp64_attention", "triton_attention", "register_triton_attention"]


def _refuse_sinks(kwargs: dict, name: str) -> None:
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{name}: attention sinks (s_aux) have no batch-invariant kernel")


def fp64_attention(module: nn.Module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention in float64, rounded once to the query dtype ([B, H, T, D] in, [B, T, H, D] out).

    Masked keys get exp(min) == 0 exactly in float64, so padding and cache length do not change a row."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.double(), k.transpose(2, 3)) * scaling
    _refuse_sinks(kwargs, INVARIANT_ATTENTION)
    softcap = kwargs.get("softcap")
    if softcap is not None:  # logit soft-capping (Gemma2), where transformers' eager attention applies it
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:  # additive mask; a sliding window arrives in it
        scores = scores + attention_mask[:, :, :, : k.shape[-2]].double()
    probs = torch.softmax(scores, dim=-1)
    if dropout and module.training:
        probs = F.dropout(probs, p=dropout)
    out = torch.matmul(probs, v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


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
        from ..kernels.invariant_attention import attention_segments

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
    b, _, tq, d = query.shape
    tk = key.shape[2]
    if tq > tk:
        raise ValueError(f"{TRITON_ATTENTION}: {tq} queries against {tk} keys")
    # What the kernel does not compute is refused, not skipped: the trainer would run another model than the engine.
    _refuse_sinks(kwargs, TRITON_ATTENTION)
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{TRITON_ATTENTION}: attention logit soft-capping ({kwargs['softcap']}) has no batch-invariant kernel")
    window = kwargs.get("sliding_window")
    if window is not None and tk > window:
        raise ValueError(f"{TRITON_ATTENTION}: {tk} keys exceed the layer's sliding window of {window}, which the "
                         "batch-invariant kernel does not apply; keep prompt + generation within the window")
    require_triton(query, TRITON_ATTENTION)
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
