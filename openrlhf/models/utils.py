"""Per-token math shared by the experience maker and the losses.

All functions take [B, T] tensors laid out per response token; `mask` is the action
(response) mask, bool or 0/1. Results are fp32 regardless of the input dtype: the
rollout-train mismatch we measure is far below bf16 resolution, so the log-prob and KL
math must not add rounding of its own.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "KL_ESTIMATORS",
    "KLEstimator",
    "log_probs_from_logits",
    "compute_approx_kl",
    "masked_sum",
    "masked_mean",
    "masked_whiten",
]

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

# Upcast at most this many logits to fp32 at once (256 MiB): never materialise a full fp32
# copy or a log-softmax of a [B, T, V] tensor.
_FP32_CHUNK_ELEMS = 1 << 26


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[labels], computed in fp32.

    logits: [B, T, V] (any float dtype; any number of leading dims), labels: [B, T] int.
    Returns [B, T] fp32. Computes logit[label] - logsumexp(logits) over chunks of tokens.
    The temperature must match the rollout's, otherwise old and rollout log-probs disagree.
    """
    if logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match: expected logits [..., V] "
            "with labels [...]"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab = logits.shape[-1]
    chunk = max(1, _FP32_CHUNK_ELEMS // max(vocab, 1))
    parts = []
    for rows, row_labels in _row_blocks(logits, labels.long()):
        for start in range(0, row_labels.numel(), chunk):
            x = rows[start : start + chunk].float()
            if temperature != 1.0:
                x = x / temperature
            picked = x.gather(-1, row_labels[start : start + chunk].unsqueeze(-1)).squeeze(-1)
            parts.append(picked - torch.logsumexp(x, dim=-1))
    if not parts:
        return torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).reshape(labels.shape)


def _row_blocks(logits: torch.Tensor, labels: torch.Tensor):
    """(logits [n, V], labels [n]) blocks covering every position in order, as views where possible.

    The response slice of a [B, T, V] tensor (`logits[:, -A - 1 : -1]`) cannot be flattened without a copy of all its
    logits (gigabytes for long rollouts), but each of its B rows can."""
    flat = logits.view(-1, logits.shape[-1]) if _viewable(logits) else None
    if flat is not None or logits.dim() <= 2:
        yield (flat if flat is not None else logits.reshape(-1, logits.shape[-1])), labels.reshape(-1)
        return
    for i in range(logits.shape[0]):
        yield from _row_blocks(logits[i], labels[i])


def _viewable(t: torch.Tensor) -> bool:
    try:
        t.view(-1, t.shape[-1])
    except RuntimeError:
        return False
    return True


def compute_approx_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    estimator: KLEstimator = "k1",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled by pi (Schulman's k1/k2/k3).

    k1 = log pi - log ref (unbiased, can be negative), k2 = (log pi - log ref)^2 / 2,
    k3 = exp(log ref - log pi) - 1 - (log ref - log pi) (unbiased, always >= 0).
    The log-ratio is clamped to [-10, 10] so one wild token cannot produce inf/nan.
    If `mask` is given, masked-out positions are 0.
    """
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} vs ref_log_probs {tuple(ref_log_probs.shape)}")
    log_ratio = (log_probs.float() - ref_log_probs.float()).clamp(-10.0, 10.0)
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    elif estimator == "k3":
        neg = -log_ratio  # log(ref / pi)
        kl = neg.exp() - 1.0 - neg
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS} (--algo.kl.estimator)")
    if mask is not None:
        kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return kl


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over positions where mask is set (positions outside the mask may hold nan/inf)."""
    xm = torch.where(mask.bool(), x, torch.zeros_like(x))
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over masked positions; 0 where the mask is empty (instead of nan)."""
    m = mask.bool()
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, m, dim) / count.clamp_min(1).to(x.dtype if x.is_floating_point() else torch.float32)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean/var over masked positions (population variance).

    Masked-out positions are set to 0. Used for the global advantage normalisation.
    """
    m = mask.bool()
    xf = x.float()
    mean = masked_mean(xf, m)
    var = masked_mean((xf - mean).square(), m)
    out = (xf - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros_like(out))
