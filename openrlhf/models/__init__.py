"""Model-side math: log-probs, KL estimators, masked reductions, RL losses."""

from .loss import ISCorrection, PolicyLoss, PolicyLossOutput, ValueLoss, aggregate_loss, kl_loss
from .utils import (
    KL_ESTIMATORS,
    compute_approx_kl,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    masked_whiten,
)

__all__ = [
    "ISCorrection",
    "PolicyLoss",
    "PolicyLossOutput",
    "ValueLoss",
    "aggregate_loss",
    "kl_loss",
    "KL_ESTIMATORS",
    "compute_approx_kl",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
]
