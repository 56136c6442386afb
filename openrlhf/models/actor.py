"""Policy (actor) and value (critic) wrappers around a HF causal LM.

Sequences are laid out as [left-padded prompt | right-padded response]; the last
`num_actions` columns are the response. Position ids come from the attention mask, the same
way HF `generate` computes them, so a rollout's logprobs and the trainer's recompute see
identical positions.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
from pathlib import Path

import torch
from torch import nn

from jetrl_precision.batch_invariant import invariant_log_probs, uses_triton_kernels

from .packing import pack_batch, unpack_to_actions
from .sdpa_backends import restore_cudnn_sdpa
from .utils import log_probs_from_logits

__all__ = ["Actor", "Critic", "position_ids_from_mask", "load_causal_lm", "read_checkpoint_tensor"]

logger = logging.getLogger(__name__)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def load_causal_lm(path: str, dtype: torch.dtype, attn_implementation: str = "sdpa", experts_implementation: str | None = None):
    """`experts_implementation` (--ds.experts_implementation) picks transformers' kernel for MoE expert layers
    (eager, batched_mm, grouped_mm, deepgemm); None keeps transformers' choice. Dense models ignore it."""
    from transformers import AutoModelForCausalLM

    if attn_implementation == "jetrl_invariant":
        from .invariant_attention import register_invariant_attention

        register_invariant_attention()

    extra = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **extra)
    except OSError as e:
        raise FileNotFoundError(
            f"could not load a model from {path!r}: {e}. Pass a local folder saved with save_pretrained "
            "(there is no model hub on this machine)"
        ) from None
    _check_attention_covers(model, attn_implementation)
    return model


def _check_attention_covers(model: nn.Module, attn_implementation: str) -> None:
    """Refuse an attention implementation that drops part of the model's attention: transformers' sdpa path skips
    logit soft-capping (Gemma2) without a word, so the trainer would score tokens with another model than the
    pretrained one, and than a vLLM engine, which applies it."""
    softcap = getattr(getattr(model, "config", None), "attn_logit_softcapping", None)
    if softcap and "sdpa" in attn_implementation:
        raise ValueError(
            f"{type(model).__name__} soft-caps its attention logits (attn_logit_softcapping={softcap}), which the "
            f"{attn_implementation} attention skips; use --ds.attn_implementation eager or flash_attention_2"
        )


class Actor(nn.Module):
    """`packing`: run each batch as one packed row of real tokens (`--ds.packing_samples`,
    openrlhf.models.packing); inputs and outputs keep the padded [B, ...] layout either way."""

    def __init__(self, model: nn.Module, packing: bool = False) -> None:
        super().__init__()
        self.model = model
        self.packing = packing
        # Models that take `logits_to_keep` (transformers' causal LMs) run the lm_head on the response positions only:
        # the prompt's logits over the whole vocabulary are never used.
        self._logits_to_keep = "logits_to_keep" in inspect.signature(type(model).forward).parameters
        # A model on the batch-invariant Triton kernels scores tokens with their log-softmax, as its engine does.
        self._log_probs = invariant_log_probs if uses_triton_kernels(model) else log_probs_from_logits

    def forward(
        self, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int, temperature: float = 1.0, return_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs [B, num_actions] of the response tokens under the (temperature-scaled) policy;
        with `return_entropy`, also the policy's entropy at each of those positions."""
        restore_cudnn_sdpa()  # an in-process vLLM switches it off for everyone
        if self.packing:
            packed = pack_batch(sequences, attention_mask, num_actions)
            out = self.model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
            logits = out.logits[0, packed.logit_index]
            labels = packed.input_ids[0, packed.target_index]
            logp = unpack_to_actions(self._log_probs(logits, labels, temperature=temperature), packed)
        else:
            keep = {"logits_to_keep": num_actions + 1} if self._logits_to_keep else {}
            out = self.model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
                             use_cache=False, **keep)
            logits = out.logits[:, -num_actions - 1 : -1]
            logp = self._log_probs(logits, sequences[:, -num_actions:], temperature=temperature)
        if not return_entropy:
            return logp
        # logp stays the function the old/rollout log-probs were computed with (not a gather from logz),
        # so the PPO ratio starts at exactly 1 whether or not the entropy term is on.
        logz = torch.log_softmax(logits.float() / temperature, dim=-1)
        entropy = -(logz.exp() * logz).sum(-1)
        return logp, unpack_to_actions(entropy, packed) if self.packing else entropy

    def gradient_checkpointing_enable(self, reentrant: bool = False) -> None:
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def read_checkpoint_tensor(path: str, key: str) -> torch.Tensor | None:
    """One tensor of a local safetensors checkpoint folder (single file or sharded), or None when absent."""
    from safetensors import safe_open

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shard = json.loads(index.read_text()).get("weight_map", {}).get(key)
        files = [folder / shard] if shard else []
    else:
        files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            if key in st.keys():
                return st.get_tensor(key)
    return None


class Critic(nn.Module):
    """Backbone of the causal LM plus a scalar value head (`score`, kept high precision by the recipe filter).

    Its state dict is laid out like transformers' `<Model>ForSequenceClassification` with one label
    (`model.*` and `score.weight`): `save_pretrained` exports it in that format, and `from_pretrained` takes
    the head from a checkpoint that has one (a reward model, or an exported critic) under
    `<value_head_prefix>.weight` (--ds.value_head_prefix).
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, packing: bool = False) -> None:
        super().__init__()
        self.model = backbone
        self.score = nn.Linear(hidden_size, 1, bias=False)
        nn.init.zeros_(self.score.weight)
        self.packing = packing

    @classmethod
    def from_pretrained(
        cls, path: str, dtype: torch.dtype, attn_implementation: str = "sdpa", packing: bool = False,
        value_head_prefix: str = "score", experts_implementation: str | None = None,
    ) -> "Critic":
        lm = load_causal_lm(path, dtype, attn_implementation, experts_implementation)
        backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
        critic = cls(backbone, lm.config.hidden_size, packing=packing)
        head = read_checkpoint_tensor(path, f"{value_head_prefix}.weight") if Path(path).is_dir() else None
        if head is not None and tuple(head.shape) == tuple(critic.score.weight.shape):
            with torch.no_grad():
                critic.score.weight.copy_(head)
            logger.info("critic: value head %s.weight loaded from %s", value_head_prefix, path)
        else:
            why = "has no" if head is None else f"has a {tuple(head.shape)} (not a one-output)"
            logger.info("critic: %s %s %s.weight; the value head starts at zero", path, why, value_head_prefix)
        critic.score.to(dtype)
        return critic

    def gradient_checkpointing_enable(self, reentrant: bool = False) -> None:
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})

    def save_pretrained(self, out_dir: str | Path, state_dict: dict[str, torch.Tensor], value_head_prefix: str = "score") -> None:
        """Write `state_dict` (this module's, whole) as a `<Model>ForSequenceClassification` folder with one label;
        the head is stored as `<value_head_prefix>.weight` (loadable with AutoModelForSequenceClassification when
        that is `score`)."""
        from huggingface_hub import save_torch_state_dict

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(self.model.config)
        config.architectures = [a.replace("ForCausalLM", "ForSequenceClassification") for a in (config.architectures or [])] or None
        config.num_labels = 1
        config.save_pretrained(out_dir)
        # own storage per tensor: ZeRO-1/2 parameters are views into one flat buffer
        state = {(f"{value_head_prefix}.weight" if k == "score.weight" else k): v.detach().clone() for k, v in state_dict.items()}
        save_torch_state_dict(state, out_dir)

    def forward(self, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int) -> torch.Tensor:
        """Values [B, num_actions]: V(state before each response token)."""
        restore_cudnn_sdpa()
        if self.packing:
            packed = pack_batch(sequences, attention_mask, num_actions)
            out = self.model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
            values = self.score(out.last_hidden_state[0, packed.logit_index]).squeeze(-1)
            return unpack_to_actions(values.float(), packed)
        out = self.model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        values = self.score(out.last_hidden_state).squeeze(-1)
        return values[:, -num_actions - 1 : -1].float()
