"""Batch-invariant log-softmax over the vocabulary, and the log-prob of a chosen token, in fp32.

The engine scores one token per sequence per step; the trainer scores every position of a batch at once. torch's
CUDA `logsumexp` picks its reduction split from the shape (a few long rows are split across blocks and combined
through global memory), so the same row can give other bits in another batch. Here one program owns one row and
reads it in fixed chunks of `VOCAB_BLOCK` logits in ascending order, whatever the number of rows:
    z   = logits.float() / temperature                  IEEE division (x / 1.0 is x), as `log_probs_from_logits`
    m   = max(z)                                        exact in any order
    s   = sum(exp(z - m))                               a VOCAB_BLOCK-wide fp32 vector accumulates the chunks in
                                                        order, then a fixed pairwise tree (`_tree.pairwise_sum`)
    lse = m + log(s)
    out = z[label] - lse   (or z - lse for every column)
The final sum is not `tl.sum`: its order follows the register layout, which Triton picks from the load's dtype
and alignment (bf16 logits get 8 elements per thread, fp32 logits 4), so the engine's fp32 logits and the
trainer's bf16 logits of the same values would get other bits. Each level of the pairwise tree adds two
named elements, which commute exactly, so any layout gives the same sum.
exp and log are libdevice's on the GPU (within 2 ulps), not the approximate hardware instructions, so the result
stays within the worst-case bound of torch's CPU log-softmax (docs/testing.md, `log_softmax_bound`); Triton's CPU
interpreter has no libdevice and evaluates tl.exp/tl.log instead.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._tree import pairwise_sum

try:  # Triton >= 3.2 spells the CUDA libdevice module like this
    from triton.language.extra import libdevice as _libdevice
except ImportError:  # pragma: no cover
    from triton.language.extra.cuda import libdevice as _libdevice


@triton.jit
def _exp_libdevice(x):
    return _libdevice.exp(x)


@triton.jit
def _log_libdevice(x):
    return _libdevice.log(x)


@triton.jit
def _exp_interp(x):
    return tl.exp(x)


@triton.jit
def _log_interp(x):
    return tl.log(x)


# Triton's CPU interpreter has no libdevice; it evaluates tl.exp/tl.log with numpy (correctly rounded or close).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_exp = _exp_interp if _INTERPRET else _exp_libdevice
_log = _log_interp if _INTERPRET else _log_libdevice

__all__ = ["VOCAB_BLOCK", "NUM_WARPS", "log_softmax", "logprobs_of_labels"]

VOCAB_BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _row_lse(x_ptr, row, sx, V, temperature, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    m_vec = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):  # the max: exact whatever the order
        c = start + cols
        z = tl.math.div_rn(tl.load(x_ptr + row * sx + c, mask=c < V, other=float("-inf")).to(tl.float32), temperature)
        m_vec = tl.maximum(m_vec, z)
    m = tl.max(m_vec, axis=0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, V, BLOCK):  # the sum of exponentials: chunks in ascending order, one fixed tree at the end
        c = start + cols
        z = tl.math.div_rn(tl.load(x_ptr + row * sx + c, mask=c < V, other=float("-inf")).to(tl.float32), temperature)
        acc += tl.where(c < V, _exp(z - m), 0.0)
    return m + _log(pairwise_sum(acc, LEVELS=BLOCK.bit_length() - 1))


@triton.jit
def _logprob_kernel(x_ptr, label_ptr, out_ptr, lse_ptr, V, sx, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = _row_lse(x_ptr, row, sx, V, temperature, BLOCK)
    label = tl.load(label_ptr + row).to(tl.int64)
    z = tl.math.div_rn(tl.load(x_ptr + row * sx + label).to(tl.float32), temperature)
    tl.store(out_ptr + row, z - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, V, sx, so, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = _row_lse(x_ptr, row, sx, V, temperature, BLOCK)
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        c = start + cols
        z = tl.math.div_rn(tl.load(x_ptr + row * sx + c, mask=c < V, other=0.0).to(tl.float32), temperature)
        tl.store(out_ptr + row * so + c, z - lse, mask=c < V)


def _flat(logits: torch.Tensor, what: str) -> torch.Tensor:
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"{what}: logits [..., V] with V > 0 needed, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"{what}: floating-point logits needed, got {logits.dtype}")
    x = logits.reshape(-1, logits.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _temperature(temperature: float, what: str) -> float:
    if not temperature > 0:
        raise ValueError(f"{what}: temperature must be > 0, got {temperature}")
    return float(temperature)


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits.float() / temperature, -1) in fp32, each row reduced in one fixed order."""
    t = _temperature(temperature, "log_softmax")
    x = _flat(logits, "log_softmax")
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _log_softmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0), t, BLOCK=VOCAB_BLOCK, num_warps=NUM_WARPS)
    return out.reshape(logits.shape)


def logprobs_of_labels(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, return_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits.float() / temperature)[labels]: logits [..., V], labels [...] int; fp32 [...] out.

    `return_lse` also returns the rows' logsumexp (fp32), which a backward needs."""
    t = _temperature(temperature, "logprobs_of_labels")
    if logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(f"logprobs_of_labels: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    x = _flat(logits, "logprobs_of_labels")
    lab = labels.reshape(-1).to(torch.int64).contiguous()
    if lab.numel() and (int(lab.min()) < 0 or int(lab.max()) >= x.shape[1]):
        raise ValueError(f"logprobs_of_labels: labels must lie in [0, {x.shape[1]}), got [{int(lab.min())}, {int(lab.max())}]")
    out = torch.empty(lab.shape, dtype=torch.float32, device=x.device)
    lse = torch.empty(lab.shape, dtype=torch.float32, device=x.device)
    if lab.numel():
        _logprob_kernel[(lab.numel(),)](x, lab, out, lse, x.shape[1], x.stride(0), t, BLOCK=VOCAB_BLOCK, num_warps=NUM_WARPS)
    out, lse = out.reshape(labels.shape), lse.reshape(labels.shape)
    return (out, lse) if return_lse else out
