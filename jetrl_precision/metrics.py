"""Rollout-train mismatch metrics (logged every step under `rollout_train_mismatch/*`).

With log r = logp_train - logp_rollout on tokens sampled by the rollout policy:
- |Δlogp| per token (mean, max),
- KL(rollout || train) estimators k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r,
- importance-ratio r quantiles and the fraction of tokens with r outside [0.8, 1.25],
- all of it bucketed by position in the response (mismatch grows with length).
"""

from __future__ import annotations

import math

import torch

__all__ = ["mismatch_metrics", "QUANTILES", "RATIO_BAND"]

QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)
RATIO_BAND = (0.8, 1.25)


def _token_stats(log_r: torch.Tensor) -> dict[str, float]:
    if log_r.numel() == 0:
        return {}
    r = log_r.exp()
    out = {
        "abs_logp_diff_mean": log_r.abs().mean().item(),
        "abs_logp_diff_max": log_r.abs().max().item(),
        "kl_k1": (-log_r).mean().item(),
        "kl_k2": (0.5 * log_r.square()).mean().item(),
        "kl_k3": (r - 1 - log_r).mean().item(),
        "ratio_outside_0.8_1.25": ((r < RATIO_BAND[0]) | (r > RATIO_BAND[1])).float().mean().item(),
    }
    return out


def mismatch_metrics(
    rollout_logprobs: torch.Tensor,
    train_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bucket_size: int = 256,
    max_buckets: int = 16,
) -> dict[str, float]:
    """Metrics of the rollout-vs-train logprob gap over masked tokens.

    Tensors are [batch, seq] (or 1-D) per-token logprobs of the *sampled* tokens; `mask`
    marks response tokens. Positions are counted within each row (column index). Returns a
    flat dict of floats; keys ``pos_{lo}-{hi}/...`` hold the per-bucket values.
    """
    if rollout_logprobs.shape != train_logprobs.shape:
        raise ValueError(f"logprob shapes differ: rollout {tuple(rollout_logprobs.shape)} vs train {tuple(train_logprobs.shape)}")
    if mask is None:
        mask = torch.ones_like(rollout_logprobs, dtype=torch.bool)
    if mask.shape != rollout_logprobs.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logprob shape {tuple(rollout_logprobs.shape)}")
    lr, lt, m = rollout_logprobs.detach().float(), train_logprobs.detach().float(), mask.bool()
    if lr.dim() == 1:
        lr, lt, m = lr[None], lt[None], m[None]
    log_r = (lt - lr)[m]
    if not torch.isfinite(log_r).all():
        raise ValueError("mismatch_metrics: non-finite logprob difference on masked tokens (a -inf logprob?)")
    out = {"num_tokens": float(log_r.numel())}
    if log_r.numel() == 0:
        return out
    out.update(_token_stats(log_r))
    r = log_r.exp()
    qs = torch.quantile(r, torch.tensor(QUANTILES, dtype=r.dtype)) if r.numel() > 1 else r.repeat(len(QUANTILES))
    for q, v in zip(QUANTILES, qs.tolist()):
        out[f"ratio_q{int(q * 100):02d}"] = v
    # Position buckets: fixed width, capped in number (the last one absorbs the tail).
    pos = torch.arange(lr.shape[1]).expand_as(lr)[m]
    seq_len = int(pos.max().item()) + 1
    width = max(bucket_size, math.ceil(seq_len / max_buckets))
    for start in range(0, seq_len, width):
        sel = (pos >= start) & (pos < start + width)
        stats = _token_stats(log_r[sel])
        for k in ("abs_logp_diff_mean", "abs_logp_diff_max", "kl_k3", "ratio_outside_0.8_1.25"):
            if k in stats:
                out[f"pos_{start}-{start + width - 1}/{k}"] = stats[k]
    return out
