"""Integrations of jetrl_precision with inference engines.

`vllm_plugin` registers the `jetrl_fp8` quantization method with vLLM (entry point group
`vllm.general_plugins`); `vllm_worker` holds the helpers that run inside a vLLM worker
(FP8 weight install, digests, the in-engine precision graph). Neither imports vLLM at
module import time unless vLLM is installed, so `import jetrl_precision.integrations`
is always safe.
"""

from __future__ import annotations

__all__ = ["vllm_available"]


def vllm_available() -> bool:
    """True when vLLM can be imported in this environment."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None
