"""Policy (actor) and value (critic) wrappers around a HF causal LM.

Sequences are laid out as [left-padded prompt | right-padded response]; the last
`num_actions` columns are the response. Position ids come from the attention mask, the same
way HF `generate` computes them, so a rollout's logprobs and the trainer's recompute see
identical positions.
"""

from __future__ import annotations

import torch
from torch import nn

from .packing import pack_batch, unpack_to_actions
from .utils import log_probs_from_logits

__all__ = ["Actor", "Critic", "position_ids_from_mask", "load_causal_lm"]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def load_causal_lm(path: str, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    if attn_implementation == "jetrl_invariant":
        from .invariant_attention import register_invariant_attention

        register_invariant_attention()

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    except OSError as e:
        raise FileNotFoundError(
            f"could not load a model from {path!r}: {e}. Pass a local folder saved with save_pretrained "
            "(there is no model hub on this machine)"
        ) from None


class Actor(nn.Module):
    """`packing`: run each batch as one packed row of real tokens (`--ds.packing_samples`,
    openrlhf.models.packing); inputs and outputs keep the padded [B, ...] layout either way."""

    def __init__(self, model: nn.Module, packing: bool = False) -> None:
        super().__init__()
        self.model = model
        self.packing = packing

    def forward(
        self, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int, temperature: float = 1.0, return_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs [B, num_actions] of the response tokens under the (temperature-scaled) policy;
        with `return_entropy`, also the policy's entropy at each of those positions."""
        if self.packing:
            packed = pack_batch(sequences, attention_mask, num_actions)
            out = self.model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
            logits = out.logits[0, packed.logit_index]
            labels = packed.input_ids[0, packed.target_index]
            logp = unpack_to_actions(log_probs_from_logits(logits, labels, temperature=temperature), packed)
        else:
            out = self.model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask), use_cache=False)
            logits = out.logits[:, -num_actions - 1 : -1]
            logp = log_probs_from_logits(logits, sequences[:, -num_actions:], temperature=temperature)
        if not return_entropy:
            return logp
        # logp stays the function the old/rollout log-probs were computed with (not a gather from logz),
        # so the PPO ratio starts at exactly 1 whether or not the entropy term is on.
        logz = torch.log_softmax(logits.float() / temperature, dim=-1)
        entropy = -(logz.exp() * logz).sum(-1)
        return logp, unpack_to_actions(entropy, packed) if self.packing else entropy

    def gradient_checkpointing_enable(self, reentrant: bool = False) -> None:
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


class Critic(nn.Module):
    """Backbone of the causal LM plus a scalar value head (`score`, kept high precision by the recipe filter)."""

    def __init__(self, backbone: nn.Module, hidden_size: int, packing: bool = False) -> None:
        super().__init__()
        self.model = backbone
        self.score = nn.Linear(hidden_size, 1, bias=False)
        nn.init.zeros_(self.score.weight)
        self.packing = packing

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype, attn_implementation: str = "sdpa", packing: bool = False) -> "Critic":
        lm = load_causal_lm(path, dtype, attn_implementation)
        backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
        critic = cls(backbone, lm.config.hidden_size, packing=packing)
        critic.score.to(dtype)
        return critic

    def forward(self, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int) -> torch.Tensor:
        """Values [B, num_actions]: V(state before each response token)."""
        if self.packing:
            packed = pack_batch(sequences, attention_mask, num_actions)
            out = self.model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
            values = self.score(out.last_hidden_state[0, packed.logit_index]).squeeze(-1)
            return unpack_to_actions(values.float(), packed)
        out = self.model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        values = self.score(out.last_hidden_state).squeeze(-1)
        return values[:, -num_actions - 1 : -1].float()
