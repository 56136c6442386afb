"""Sample packing (`--ds.packing_samples`): a padded batch becomes one row of real tokens.

The padded layout is [left-padded prompt | right-padded response] per row. Packing keeps each
row's real tokens (attention_mask == 1, a contiguous run) and concatenates them into a single
[1, T] row whose position ids restart at 0 for every sample. transformers sees restarting
position ids with no attention mask and builds a block-diagonal causal mask (sdpa, eager and
flash attention alike), so no sample attends to another.

Numerically the FP8 flow is indifferent to packing: activations are quantized in 1x128
groups along K (the hidden dimension) of each token, so a group never spans two tokens and
a token's bytes do not depend on which tokens sit beside it (tests/rl/test_packing.py checks
this byte for byte). What packing removes is the padding tokens' compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedBatch", "pack_batch", "unpack_to_actions"]


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # [1, T] the real tokens of every row, row after row
    position_ids: torch.Tensor  # [1, T] restarting at 0 for each row
    lengths: torch.Tensor  # [B] real tokens per row
    target_index: torch.Tensor  # [N] packed positions of the response tokens
    rows: torch.Tensor  # [N] row of each response token in the [B, num_actions] layout
    cols: torch.Tensor  # [N] column of each response token in that layout
    batch_size: int
    num_actions: int

    @property
    def logit_index(self) -> torch.Tensor:
        """Packed positions whose outputs predict the response tokens (the token before each)."""
        return self.target_index - 1


def pack_batch(sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int) -> PackedBatch:
    """Pack a padded [B, L] batch; the last `num_actions` columns are the response."""
    if sequences.shape != attention_mask.shape or sequences.dim() != 2:
        raise ValueError(f"sequences {tuple(sequences.shape)} and attention_mask {tuple(attention_mask.shape)} must be the same [B, L]")
    valid = attention_mask.bool()
    lengths = valid.sum(-1)
    # Each row's real tokens must be one contiguous run (what samples_to_tensors produces).
    runs = (torch.diff(valid.int(), dim=-1, prepend=torch.zeros_like(valid[:, :1], dtype=torch.int)) == 1).sum(-1)
    if bool((runs > 1).any()):
        raise ValueError("packing needs each row's attention_mask to be one contiguous run of ones")
    position_ids = (valid.long().cumsum(-1) - 1).clamp_min(0)
    packed_index = valid.flatten().long().cumsum(0).reshape(valid.shape) - 1
    L = sequences.shape[1]
    resp_valid = valid[:, L - num_actions :]
    rows, cols = resp_valid.nonzero(as_tuple=True)
    target_index = packed_index[:, L - num_actions :][rows, cols]
    if target_index.numel() and bool((position_ids[:, L - num_actions :][rows, cols] == 0).any()):
        raise ValueError("a response token has no prompt token before it: every row needs a non-empty prompt")
    return PackedBatch(
        input_ids=sequences[valid][None],
        position_ids=position_ids[valid][None],
        lengths=lengths,
        target_index=target_index,
        rows=rows,
        cols=cols,
        batch_size=sequences.shape[0],
        num_actions=num_actions,
    )


def unpack_to_actions(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """[N] per-response-token values -> [B, num_actions], zeros where a row has no token."""
    out = values.new_zeros((packed.batch_size, packed.num_actions))
    out[packed.rows, packed.cols] = values
    return out
