"""The batch-invariant attention, registered with transformers as `jetrl_invariant`.

The kernel itself (`jetrl_precision.batch_invariant.fp64_attention`: scores, softmax and the
weighted sum in float64, rounded once) lives with the rest of the batch-invariant numerics; this
module only plugs it into transformers' attention registry, with the additive-mask builder it
expects. `--precision.bitwise` selects it for the policy and the transformers engine; it can also
be chosen on its own with `--ds.attn_implementation jetrl_invariant` (docs/precision.md, "Bitwise mode").
"""

from __future__ import annotations

from jetrl_precision.batch_invariant import INVARIANT_ATTENTION, fp64_attention

__all__ = ["INVARIANT_ATTENTION", "register_invariant_attention"]

_registered = False


def register_invariant_attention() -> str:
    """Register the attention (and its additive-mask builder) with transformers; idempotent."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

        AttentionInterface.register(INVARIANT_ATTENTION, fp64_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(INVARIANT_ATTENTION, eager_mask)
        _registered = True
    return INVARIANT_ATTENTION
