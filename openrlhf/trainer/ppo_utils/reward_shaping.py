"""Reward shaping and DAPO dynamic filtering, on one rollout's grouped samples.

- Overlong penalty (DAPO; `--reward.overlong_buffer_len`, `--reward.overlong_penalty_factor`):
  a response longer than max_new_tokens - buffer loses factor * min(excess, buffer) / buffer.
- Stop-properly penalty (ProRL; `--reward.stop_properly_penalty_coef c`): a response cut off
  by the token budget has its reward scaled by c when c >= 0, or replaced by c when c < 0.
- Dynamic filtering (DAPO; `--algo.dynamic_filtering_enable`, `--algo.dynamic_filtering_range
  LOW HIGH`): a prompt's group is kept only when the mean of its scores lies strictly between
  LOW and HIGH. With 0/1 rewards and the default (0, 1), groups that are all right or all wrong,
  whose group-relative advantages are all zero, are dropped; the trainer refills the batch.
"""

from __future__ import annotations

import torch

__all__ = ["overlong_penalty", "stop_properly_penalty", "dynamic_filter_keep"]


def overlong_penalty(response_lengths: torch.Tensor, max_new_tokens: int, buffer_len: float, factor: float = 1.0) -> torch.Tensor:
    """Per-sample penalty (<= 0) to add to the reward."""
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(
            f"--reward.overlong_buffer_len ({buffer_len}) must be in (0, max_new_tokens={max_new_tokens}]: the penalty "
            f"ramps over the last buffer_len tokens of the budget"
        )
    excess = (response_lengths.float() - (max_new_tokens - buffer_len)).clamp(min=0.0, max=buffer_len)
    return -excess / buffer_len * factor


def stop_properly_penalty(rewards: torch.Tensor, truncated: torch.Tensor, coef: float) -> torch.Tensor:
    """Rewards with truncated samples scaled by `coef` (>= 0) or set to `coef` (< 0)."""
    if coef >= 0:
        return torch.where(truncated, rewards * coef, rewards)
    return torch.where(truncated, torch.full_like(rewards, coef), rewards)


def dynamic_filter_keep(scores: torch.Tensor, n_samples_per_prompt: int, low: float, high: float) -> torch.Tensor:
    """Bool [num_prompts]: keep the group of prompt i when LOW < mean(scores of its samples) < HIGH."""
    if scores.numel() % n_samples_per_prompt:
        raise ValueError(f"{scores.numel()} scores do not form groups of {n_samples_per_prompt}")
    mean = scores.float().reshape(-1, n_samples_per_prompt).mean(-1)
    return (mean > low) & (mean < high)
