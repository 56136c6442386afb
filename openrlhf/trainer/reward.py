"""Build the run's reward function from the config: remote/.py function, reward model, or math rule."""

from __future__ import annotations

from typing import Sequence

import torch

from openrlhf.rewards.math_reward import math_reward
from openrlhf.rewards.remote import load_reward_fn

from .ppo_utils.experience_maker import RewardFn

__all__ = ["build_reward_fn", "RewardModelFn"]


class RewardModelFn:
    """A sequence-classification reward model scoring prompt + response text.

    `offload` (--reward.offload): the weights stay in host memory and visit `device` only while scoring."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, offload: bool = False) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.offload = offload
        self.home = torch.device("cpu") if offload else torch.device(device)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype).to(self.home).eval()
        self.device = torch.device(device)

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str], labels: list[str | None]) -> list[float]:
        enc = self.tok([p + r for p, r in zip(prompts, responses)], return_tensors="pt", padding=True).to(self.device)
        self.model.to(self.device)
        try:
            return self.model(**enc).logits[:, 0].float().cpu().tolist()
        finally:
            self.model.to(self.home)


def build_reward_fn(
    source: str, *, remote_url: str | None, model_path: str | None, clip_range: Sequence[float], dtype: torch.dtype,
    device: torch.device, offload: bool = False,
) -> RewardFn:
    if source == "remote":
        remote = load_reward_fn(remote_url)

        def fn(prompts, responses, labels):
            return list(remote([p + r for p, r in zip(prompts, responses)], list(prompts), list(labels)))

    elif source == "model":
        fn = RewardModelFn(model_path, dtype, device, offload)
    else:

        def fn(prompts, responses, labels):
            return math_reward(list(responses), [lab if lab is not None else "" for lab in labels])

    lo, hi = clip_range

    def clipped(prompts, responses, labels):
        return [min(max(float(r), lo), hi) for r in fn(prompts, responses, labels)]

    return clipped
