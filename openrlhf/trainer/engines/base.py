"""The rollout-engine interface. The trainer core talks only to this; vLLM and the
transformers-based engine implement it, colocated (SPMD) or as Ray actors.

Weights move as `SyncTensor`s (see `jetrl_precision.weight_sync`): FP8 layers travel as
their e4m3 bytes plus fp32 block scales, exactly the bytes the trainer's forward uses, and
the engine installs them without re-quantizing.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

__all__ = ["SamplingConfig", "RolloutSample", "RolloutEngine"]


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1  # samples per prompt
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # sample to max_new_tokens whatever the model emits (rollout-length studies)


@dataclass
class RolloutSample:
    """One sampled response. `logprobs[i]` is the engine's own logprob of `response_ids[i]`
    under the sampling distribution's underlying model (temperature-scaled, full vocab)."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "length"  # "stop" when an EOS/stop token ended it
    extra: dict[str, Any] = field(default_factory=dict)
    # Which response tokens the policy chose (None: all). Multi-turn agent episodes interleave
    # the model's turns with environment feedback, which is context, not action.
    action_mask: list[bool] | None = None


class RolloutEngine(abc.ABC):
    """What the trainer needs from a rollout engine."""

    name: str = "engine"
    # How synced high-precision tensors are named and laid out (jetrl_precision.weight_sync.iter_sync_tensors):
    # "checkpoint" for engines that load through a checkpoint loader (vLLM), "model" for a transformers model.
    sync_layout: str = "checkpoint"
    # Whether generation runs in the calling process, on its GPU: only then do the generate phase's host and GPU
    # figures (`perf/generate_*`, openrlhf.utils.telemetry) describe the engine.
    in_process: bool = True

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[list[RolloutSample]]:
        """For each prompt (token ids), `sampling.n` samples."""

    @abc.abstractmethod
    def update_weights(self, tensors: Iterable[Any]) -> None:
        """Install synced weights (`jetrl_precision.weight_sync.SyncTensor`s) without re-quantizing."""

    @abc.abstractmethod
    def weight_digests(self, names: Sequence[str]) -> dict[str, str]:
        """Digest of the bytes the engine holds for each named synced tensor (for the post-sync check)."""

    @abc.abstractmethod
    def precision_graph(self) -> dict:
        """The rollout precision graph built from what the engine instantiated (PrecisionGraph.to_dict())."""

    def sleep(self) -> None:  # free accelerator memory while training runs (colocated GPU)
        pass

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
