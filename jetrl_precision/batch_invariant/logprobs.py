"""`invariant_log_probs`: the chosen tokens' log-probs with one fixed reduction order per row (Triton)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .common import TRITON_ATTENTION, require_triton

__all__ = ["invariant_log_probs", "uses_triton_kernels"]


class _LogProbFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
        from ..kernels.invariant_softmax import logprobs_of_labels

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
    require_triton(logits, "invariant_log_probs")
    return _LogProbFunction.apply(logits, labels, float(temperature))
