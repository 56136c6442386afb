"""RL losses, per token. Every loss returns a [B, T] `token_loss` that is 0 outside the
mask; `aggregate_loss` turns it into the scalar that is backpropagated, so that the token
mean is exact across micro-batches and data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .utils import KLEstimator, compute_approx_kl, masked_mean

__all__ = [
    "ISCorrection",
    "PolicyLoss",
    "PolicyLossOutput",
    "ValueLoss",
    "kl_loss",
    "aggregate_loss",
    "sequence_mean_weights",
]

_RATIO_LOG_CLAMP = 20.0  # exp(20) ~ 5e8: large enough to never bind in a sane run, finite in fp32


@dataclass(frozen=True)
class ISCorrection:
    """Token-level importance-sampling correction for rollout/train mismatch.

    The rollout engine samples from pi_rollout, but PPO treats the samples as drawn from
    pi_old (the trainer's recomputation). The weight w = pi_old / pi_rollout =
    exp(old_logp - rollout_logp) re-weights each token's loss.
    - ``tis``: truncated IS, w clamped to [low, high].
    - ``icepop``: w kept where low <= w <= high, tokens outside get weight 0 (masked out).
    - ``seq-mask-tis``: truncated token weights as tis, and every token of a sequence whose
      geometric-mean weight exp(mean log w) falls outside [low, high] gets weight 0.
    The weight is a constant (detached): it corrects the sampling distribution, it is not optimised.
    """

    kind: Literal["tis", "icepop", "seq-mask-tis"]
    low: float = 0.5
    high: float = 5.0

    def __post_init__(self) -> None:
        if self.kind not in ("tis", "icepop", "seq-mask-tis"):
            raise ValueError(
                f"unknown IS correction {self.kind!r}; choose tis, icepop or seq-mask-tis (--algo.advantage.is_correction_type)"
            )
        if not (0.0 <= self.low < self.high):
            raise ValueError(
                f"IS correction thresholds need 0 <= low < high, got low={self.low}, high={self.high} "
                "(--algo.advantage.is_correction_threshold)"
            )

    def weights(
        self, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(w, outside): the detached fp32 token weights, and a bool map of tokens whose weight
        fell outside [low, high] (truncated for tis, dropped for icepop, the whole sequence for
        seq-mask-tis, which needs `mask`)."""
        log_w = (old_log_probs.detach().float() - rollout_log_probs.detach().float()).clamp(
            -_RATIO_LOG_CLAMP, _RATIO_LOG_CLAMP
        )
        raw = log_w.exp()
        outside = (raw < self.low) | (raw > self.high)
        if self.kind == "tis":
            w = raw.clamp(self.low, self.high)
        elif self.kind == "icepop":
            w = torch.where(outside, torch.zeros_like(raw), raw)
        else:
            if mask is None:
                raise ValueError("seq-mask-tis needs the action mask to average log-weights per sequence")
            seq_w = masked_mean(log_w, mask, dim=-1).exp()
            seq_out = ((seq_w < self.low) | (seq_w > self.high))[:, None].expand_as(raw)
            w = torch.where(seq_out, torch.zeros_like(raw), raw.clamp(self.low, self.high))
            outside = seq_out
        return w, outside


@dataclass
class PolicyLossOutput:
    token_loss: torch.Tensor  # [B, T], 0 outside the mask, IS weight already applied
    clip_frac: torch.Tensor  # scalar: fraction of masked tokens where the clipped term was taken
    approx_ratio_mean: torch.Tensor  # scalar: masked mean of pi / pi_old (detached)
    is_weight_mean: torch.Tensor | None = None  # scalar: masked mean IS weight; None without IS
    is_outside_frac: torch.Tensor | None = None  # scalar: fraction of tokens truncated (tis) / dropped (icepop)
    dual_clip_frac: torch.Tensor | None = None  # scalar: fraction of masked tokens where dual clip bound


class PolicyLoss(nn.Module):
    """PPO clipped surrogate, per token.

    ratio = exp(clamp(logp - old_logp, +-20)); loss = -min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A).
    ``clip_eps_high > clip_eps_low`` is DAPO's clip-higher. ``dual_clip = c > 1`` (Ye et al., 2020)
    additionally bounds the loss of negative-advantage tokens at -c*A, so a huge ratio on a bad
    token cannot produce an unbounded update: loss = min(loss, -c*A) where A < 0.
    """

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        is_correction: ISCorrection | None = None,
        loss_type: Literal["ppo", "gspo"] = "ppo",
    ) -> None:
        super().__init__()
        if loss_type not in ("ppo", "gspo"):
            raise ValueError(f"unknown policy loss {loss_type!r}; choose ppo or gspo (--actor.policy_loss_type)")
        self.loss_type = loss_type
        if not (0.0 <= clip_eps_low < 1.0) or clip_eps_high < 0.0:
            raise ValueError(
                f"clip range needs 0 <= eps_low < 1 and eps_high >= 0, got ({clip_eps_low}, {clip_eps_high}) "
                "(--actor.eps_clip / --actor.eps_clip_low_high)"
            )
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1.0 (it bounds the loss at -c*A for A<0), got {dual_clip} (--actor.dual_clip)")
        self.clip_eps_low = float(clip_eps_low)
        self.clip_eps_high = float(clip_eps_high)
        self.dual_clip = dual_clip
        self.is_correction = is_correction

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        rollout_log_probs: torch.Tensor | None = None,
    ) -> PolicyLossOutput:
        if not (log_probs.shape == old_log_probs.shape == advantages.shape == mask.shape):
            raise ValueError(
                "PolicyLoss inputs must share one [B, T] shape: "
                f"log_probs {tuple(log_probs.shape)}, old {tuple(old_log_probs.shape)}, "
                f"advantages {tuple(advantages.shape)}, mask {tuple(mask.shape)}"
            )
        if self.is_correction is not None and rollout_log_probs is None:
            raise ValueError(
                f"IS correction '{self.is_correction.kind}' needs the rollout engine's log-probs: pass rollout_log_probs "
                "(or disable --algo.advantage.is_correction_enable)"
            )
        m = mask.bool()
        adv = advantages.detach().float()
        log_ratio = (log_probs.float() - old_log_probs.detach().float()).clamp(-_RATIO_LOG_CLAMP, _RATIO_LOG_CLAMP)
        if self.loss_type == "gspo":  # one length-normalized ratio per sequence, broadcast to its tokens
            log_ratio = masked_mean(log_ratio, m, dim=-1)[:, None].expand_as(log_ratio)
        ratio = log_ratio.exp()
        surr1 = ratio * adv
        surr2 = ratio.clamp(1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high) * adv
        loss = -torch.min(surr1, surr2)
        clipped = surr2 < surr1

        dual_frac = None
        if self.dual_clip is not None:
            bound = -self.dual_clip * adv
            dual_hit = (adv < 0) & (loss > bound)
            loss = torch.where(adv < 0, torch.min(loss, bound), loss)
            dual_frac = masked_mean(dual_hit.float(), m).detach()

        is_mean = is_out = None
        if self.is_correction is not None:
            if rollout_log_probs.shape != log_probs.shape:
                raise ValueError(f"rollout_log_probs {tuple(rollout_log_probs.shape)} vs log_probs {tuple(log_probs.shape)}")
            w, outside = self.is_correction.weights(old_log_probs, rollout_log_probs, m)
            loss = loss * w
            is_mean = masked_mean(w, m)
            is_out = masked_mean(outside.float(), m)

        token_loss = torch.where(m, loss, torch.zeros_like(loss))
        return PolicyLossOutput(
            token_loss=token_loss,
            clip_frac=masked_mean(clipped.float(), m).detach(),
            approx_ratio_mean=masked_mean(ratio.detach(), m),
            is_weight_mean=is_mean,
            is_outside_frac=is_out,
            dual_clip_frac=dual_frac,
        )


class ValueLoss(nn.Module):
    """Critic loss per token: 0.5 * max((v - R)^2, (v_clip - R)^2) with
    v_clip = old_v + clamp(v - old_v, +-clip_eps) (PPO value clipping); unclipped if clip_eps is None."""

    def __init__(self, clip_eps: float | None = 0.5) -> None:
        super().__init__()
        if clip_eps is not None and not clip_eps > 0:
            raise ValueError(f"value clip must be > 0 or None, got {clip_eps} (--critic.value_clip)")
        self.clip_eps = clip_eps

    def forward(
        self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        if not (values.shape == old_values.shape == returns.shape == mask.shape):
            raise ValueError(
                f"ValueLoss shapes differ: values {tuple(values.shape)}, old {tuple(old_values.shape)}, "
                f"returns {tuple(returns.shape)}, mask {tuple(mask.shape)}"
            )
        v = values.float()
        ret = returns.detach().float()
        loss = (v - ret).square()
        if self.clip_eps is not None:
            old = old_values.detach().float()
            v_clip = old + (v - old).clamp(-self.clip_eps, self.clip_eps)
            loss = torch.max(loss, (v_clip - ret).square())
        loss = 0.5 * loss
        return torch.where(mask.bool(), loss, torch.zeros_like(loss))


def kl_loss(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """KL(pi || ref) as a per-token loss term (--algo.kl.use_loss); gradients flow into log_probs only.
    k3 is the usual choice (GRPO): unbiased, non-negative, and its gradient pulls pi towards ref."""
    return compute_approx_kl(log_probs, ref_log_probs.detach(), estimator, mask=mask)


def sequence_mean_weights(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] token weights 1/len(sequence): with `aggregate_loss(token_loss * w, mask, n_sequences)`
    each sequence's tokens are averaged first, then sequences (GSPO's sequence-level loss)."""
    m = mask.bool()
    return m.float() / m.sum(-1, keepdim=True).clamp_min(1).float()


def aggregate_loss(
    token_loss: torch.Tensor, mask: torch.Tensor, global_num_tokens: float, scale: float = 1.0
) -> torch.Tensor:
    """Scalar loss for one micro-batch: sum(token_loss * mask) * scale / global_num_tokens.

    Goal: the gradient of one optimizer step equals the gradient of the token mean over the
    *whole* step batch (all micro-batches on all ranks), whatever the token counts per
    micro-batch. A per-micro-batch mean would over-weight tokens of short micro-batches.

    How the trainer calls it:
    - ``global_num_tokens`` = number of response (mask) tokens in the whole optimizer-step
      batch, summed over all gradient-accumulation micro-batches and all data-parallel ranks
      (an all-reduce of the local count before the step's first backward).
    - ``scale`` = world_size * grad_accum_steps, because DeepSpeed averages gradients over
      ranks (divides by world_size) and scales each micro-batch loss by 1/grad_accum_steps.
    Then  sum_ranks sum_micro [sum(token_loss) * scale / N] / (world * gas) = sum(all token_loss) / N,
    the exact global token mean.
    """
    if not global_num_tokens > 0:
        raise ValueError(
            f"global_num_tokens must be > 0 (the response-token count of the whole step batch), got {global_num_tokens}"
        )
    if token_loss.shape != mask.shape:
        raise ValueError(f"token_loss {tuple(token_loss.shape)} vs mask {tuple(mask.shape)}")
    total = torch.where(mask.bool(), token_loss, torch.zeros_like(token_loss)).sum()
    return total * (float(scale) / float(global_num_tokens))
