"""A batch-invariant attention for verifying the unified FP8 flow bit for bit.

Why: a rollout engine decodes token by token against a KV cache; the trainer recomputes the
whole sequence at once. Ordinary kernels reduce in shape-dependent orders, so the two paths
differ by float noise (~1e-7 in fp32). With e4m3 that noise is not harmless: a value near a
rounding boundary lands on the next code (a 6-12% change of that element), and through a deep
model these flips cascade until rollout and training disagree as much as two independent
quantizations (SmolLM2 figures in docs/benchmarks.md).

This attention computes scores, softmax and the weighted sum in float64 and rounds once to
the input dtype. A float64 result differs by ~1e-16 between the two paths, which almost never
changes the rounded value, so decode and full forward produce the same activations, hence the
same FP8 bytes. Together with the `emulated` GEMM backend (float64 accumulation) it makes the
transformers engine and the trainer agree to the last bit on CPU. It is a verification mode:
float64 is slow, and on GPU batch-invariant kernels are the production route.

Select it with `--ds.attn_implementation jetrl_invariant` (trainer, reference and the
transformers engine all load with the same implementation).
"""

from __future__ import annotations

import torch

__all__ = ["INVARIANT_ATTENTION", "register_invariant_attention"]

INVARIANT_ATTENTION = "jetrl_invariant"


def _fp64_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.double(), k.transpose(2, 3)) * scaling
    if attention_mask is not None:  # additive mask; masked keys get exp(min) == 0 exactly in float64
        scores = scores + attention_mask[:, :, :, : k.shape[-2]].double()
    probs = torch.softmax(scores, dim=-1)
    if dropout and module.training:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    out = torch.matmul(probs, v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register_invariant_attention() -> str:
    """Register the attention (and its additive-mask builder) with transformers; idempotent."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

        AttentionInterface.register(INVARIANT_ATTENTION, _fp64_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(INVARIANT_ATTENTION, eager_mask)
        _registered = True
    return INVARIANT_ATTENTION
