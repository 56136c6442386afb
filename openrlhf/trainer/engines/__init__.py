"""Rollout engines behind one interface (`base.RolloutEngine`).

`hf_engine.HFEngine` runs anywhere transformers runs; `vllm_engine.VLLMEngine` needs vLLM
(`pip install -e .[cpu]` or `.[gpu]`). Engines are imported lazily so this package imports
without either backend's heavy dependencies.
"""

from __future__ import annotations

from typing import Any

from .base import RolloutEngine, RolloutSample, SamplingConfig

__all__ = ["RolloutEngine", "RolloutSample", "SamplingConfig", "VLLMEngine", "HFEngine"]


def __getattr__(name: str) -> Any:
    if name == "VLLMEngine":
        from .vllm_engine import VLLMEngine

        return VLLMEngine
    if name == "HFEngine":
        from .hf_engine import HFEngine

        return HFEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
