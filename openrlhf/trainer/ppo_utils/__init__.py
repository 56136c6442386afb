"""PPO utilities: advantage estimators (the experience maker lives next to them)."""

from .advantages import ESTIMATORS, GROUP_ESTIMATORS, compute_advantages, compute_token_rewards

__all__ = ["ESTIMATORS", "GROUP_ESTIMATORS", "compute_advantages", "compute_token_rewards"]
