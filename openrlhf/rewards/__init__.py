"""Rewards: rule-based math verification and user-supplied (file or HTTP) reward functions."""

from .math_reward import extract_final_number, math_reward
from .remote import load_reward_fn

__all__ = ["extract_final_number", "math_reward", "load_reward_fn"]
