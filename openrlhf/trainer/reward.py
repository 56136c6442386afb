"""Build the run's reward function from the config: remote/.py function, reward model, or math rule."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from openrlhf.models.sdpa_backends import restore_cudnn_sdpa
from openrlhf.rewards.math_reward import math_reward
from openrlhf.rewards.remote import load_reward_fn

from .ppo_utils.experience_maker import RewardFn

__all__ = ["build_reward_fn", "RewardModelFn"]


class RewardModelFn:
    """A sequence-classification reward model scoring prompt + response text.

    `offload` (--reward.offload): the weights stay in host memory and visit `device` only while scoring.
    `value_head_prefix` (--ds.value_head_prefix): the checkpoint's name for the one-output head; a checkpoint
    without it is refused, since transformers would score with a freshly initialized (random) head."""

    def __init__(
        self, path: str, dtype: torch.dtype, device: torch.device, offload: bool = False, value_head_prefix: str = "score"
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from openrlhf.config import ConfigError
        from openrlhf.models.actor import read_checkpoint_tensor

        self.tok = AutoTokenizer.from_pretrained(path)
        self.offload = offload
        self.home = torch.device("cpu") if offload else torch.device(device)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype).eval()
        if Path(path).is_dir():
            head = read_checkpoint_tensor(path, f"{value_head_prefix}.weight")
            if head is None or tuple(head.shape) != tuple(self.model.score.weight.shape):
                raise ConfigError(
                    f"--reward.model_name_or_path {path} has no one-output value head named {value_head_prefix}.weight "
                    f"(found {'none' if head is None else tuple(head.shape)}): its rewards would come from a random head. "
                    f"Pass the head's name with --ds.value_head_prefix, or a trained reward model"
                )
            with torch.no_grad():
                self.model.score.weight.copy_(head)
        self.model.to(self.home)
        self.device = torch.device(device)

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str], labels: list[str | None]) -> list[float]:
        enc = self.tok([p + r for p, r in zip(prompts, responses)], return_tensors="pt", padding=True).to(self.device)
        self.model.to(self.device)
        restore_cudnn_sdpa()
        try:
            return self.model(**enc).logits[:, 0].float().cpu().tolist()
        finally:
            self.model.to(self.home)


def build_reward_fn(
    source: str, *, remote_url: str | None, model_path: str | None, clip_range: Sequence[float], dtype: torch.dtype,
    device: torch.device, offload: bool = False, value_head_prefix: str = "score",
) -> RewardFn:
    if source == "remote":
        remote = load_reward_fn(remote_url)

        def fn(prompts, responses, labels):
            return list(remote([p + r for p, r in zip(prompts, responses)], list(prompts), list(labels)))

    elif source == "model":
        fn = RewardModelFn(model_path, dtype, device, offload, value_head_prefix)
    else:

        def fn(prompts, responses, labels):
            return math_reward(list(responses), [lab if lab is not None else "" for lab in labels])

    lo, hi = clip_range

    def clipped(prompts, responses, labels):
        return [min(max(float(r), lo), hi) for r in fn(prompts, responses, labels)]

    return clipped
