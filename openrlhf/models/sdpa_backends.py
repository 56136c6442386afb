"""The trainer's attention keeps torch's SDPA backends, whatever an in-process vLLM set.

Importing vLLM's CUDA platform (`vllm/platforms/cuda.py`) calls `torch.backends.cuda.enable_cudnn_sdp(False)` for
the whole process. A trainer that runs a colocated engine shares that process, and transformers' `sdpa` attention
then falls back from cuDNN's fused attention to the memory-efficient kernel: 2.5x its time in an 8B-shaped
update on the H200 (`benchmarks/update_profile.py`), for every recipe. vLLM's own decoder attention does not go
through torch SDPA, so the trainer turns cuDNN attention back on before its forwards, and says so once.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["restore_cudnn_sdpa"]

logger = logging.getLogger(__name__)
_said: list[bool] = []


def restore_cudnn_sdpa() -> bool:
    """Turn torch's cuDNN SDPA backend back on if something switched it off; True when it did so."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(True)
    if not _said:
        _said.append(True)
        logger.warning(
            "cuDNN attention was switched off process-wide (vLLM does this when its CUDA platform is imported); "
            "turned back on for the trainer's sdpa attention, which otherwise falls back to the slower "
            "memory-efficient kernel. vLLM's decoder attention does not use torch SDPA."
        )
    return True
