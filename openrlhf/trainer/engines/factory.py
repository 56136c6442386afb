"""Which rollout engine a run uses, and building it from the run's config sections.

Both launch modes go through here: the SPMD trainer builds its colocated engine with
`build_engine`, and Ray mode's engine actors do the same in their own processes.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from jetrl_precision import PrecisionRecipe
from openrlhf.config import PPOConfig, RolloutConfig

from .base import RolloutEngine, SamplingConfig

__all__ = ["EngineKind", "engine_kind", "default_sampling", "build_engine"]

logger = logging.getLogger(__name__)

EngineKind = Literal["vllm", "hf"]


def engine_kind(choice: str, bitwise: bool = False, cuda: bool | None = None) -> EngineKind:
    """vllm or hf, as `--rollout.engine` asks (auto: vllm when it and our vLLM engine import). With
    --precision.bitwise, auto picks vLLM's bitwise mode where the engines run on CUDA (`cuda`; default: this
    process sees a GPU) and the transformers engine elsewhere: it is the only bitwise engine on CPU."""
    if choice != "auto":
        return choice  # type: ignore[return-value]  # validated: vllm or hf (and hf with --precision.bitwise)
    if bitwise and not (torch.cuda.is_available() if cuda is None else cuda):
        logger.info("--rollout.engine auto with --precision.bitwise and no CUDA: the transformers engine")
        return "hf"
    try:
        import vllm  # noqa: F401

        from . import vllm_engine  # noqa: F401
    except ImportError:
        return "hf"
    return "vllm"


def default_sampling(rollout: RolloutConfig, max_len: int) -> SamplingConfig:
    """The engine's default sampling (`--rollout.*`); the trainer passes its own per call."""
    return SamplingConfig(
        max_new_tokens=rollout.max_new_tokens or max_len, temperature=rollout.temperature, top_p=rollout.top_p,
        top_k=rollout.top_k, n=rollout.n_samples_per_prompt, ignore_eos=rollout.ignore_eos,
    )


def build_engine(
    cfg: PPOConfig,
    kind: EngineKind,
    recipe: PrecisionRecipe,
    *,
    rank: int,
    dtype: torch.dtype,
    device: torch.device | str,
    vllm_engine_kwargs: dict[str, Any] | None = None,
) -> RolloutEngine:
    """One rollout engine of `kind` for engine/trainer rank `rank`; `dtype`/`device` are the
    transformers engine's (vLLM picks its own from `--vllm.dtype` and `--ds.param_dtype`)."""
    if kind == "vllm":
        from .vllm_engine import VLLMEngine

        return VLLMEngine.from_config(
            cfg.vllm, recipe, model_path=cfg.actor.model_name_or_path, sampling=default_sampling(cfg.rollout, cfg.data.max_len),
            max_model_len=cfg.data.max_len, param_dtype=cfg.ds.param_dtype, seed=cfg.train.seed + rank,
            engine_kwargs=vllm_engine_kwargs, bitwise=cfg.precision.bitwise,
        )
    from .hf_engine import HFEngine

    return HFEngine(
        cfg.actor.model_name_or_path, recipe, dtype=dtype, device=device, attn_implementation=cfg.policy_attn_implementation,
        batch_invariant=cfg.precision.bitwise, fuse_rmsnorm=not cfg.precision.plain_norms,
    )
