"""Tiny models and tokenizers built locally (there is no model hub on CI or dev machines).

A character-level tokenizer over printable ASCII and a small causal LM of one of the architectures in
`TINY_ARCHS`, built from a config. Saved with `save_pretrained`, so transformers, DeepSpeed and vLLM load them
the same way they load a real checkpoint.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TINY_ARCHS", "TinyModelSpec", "build_char_tokenizer", "build_tiny_model", "PAD", "BOS", "EOS"]

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"


def build_char_tokenizer(vocab_size: int = 128):
    """One token per printable ASCII character, plus pad/bos/eos/unk, padded to `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    specials = [PAD, BOS, EOS, UNK]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} < {len(vocab)} characters")
    for i in range(len(vocab), vocab_size):  # unused slots keep the embedding table a round size
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK, fuse_unk=True))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left"
    )
    fast.add_special_tokens({"additional_special_tokens": []})
    return fast


# arch -> (transformers config class name, what that architecture's config needs beyond the common fields).
# Each differs from Llama in a way the FP8 flow must handle: biases (qwen2), q/k norms (qwen3, olmo2),
# fused qkv_proj and gate_up_proj checkpoints (phi3), residual/logit multipliers (granite), (1 + w) norms, GELU
# MLPs, soft-capping and tied embeddings (gemma2/gemma3), expert weights that are not nn.Linear (qwen3_moe), a
# shared expert with a one-logit gate beside them (qwen2_moe).
TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": None}),
    "mistral": ("MistralConfig", {}),
    "phi3": ("Phi3Config", {}),
    "granite": ("GraniteConfig", {"residual_multiplier": 0.5, "logits_scaling": 2.0, "embedding_multiplier": 2.0}),
    "olmo2": ("Olmo2Config", {}),
    "gemma2": ("Gemma2Config", {"head_dim": None, "query_pre_attn_scalar": None, "tie_word_embeddings": True}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": None, "query_pre_attn_scalar": None, "tie_word_embeddings": True}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": None, "num_experts": 4, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": None}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": None,
                                      "shared_expert_intermediate_size": None}),
}


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "llama"  # a key of TINY_ARCHS
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # k/v projections of N=64: not a multiple of 128 (exercises fused-qkv handling)
    vocab_size: int = 128
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02  # larger -> peakier next-token distributions
    seed: int = 0


def build_tiny_model(save_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), tokenizer=None, dtype: torch.dtype = torch.float32) -> Path:
    """Build a randomly initialised causal LM plus char tokenizer and save both to `save_dir`."""
    import transformers
    from transformers import AutoModelForCausalLM

    save_dir = Path(save_dir)
    tokenizer = tokenizer or build_char_tokenizer(spec.vocab_size)
    if spec.arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {spec.arch!r}; use one of {', '.join(TINY_ARCHS)}")
    cfg_name, extra = TINY_ARCHS[spec.arch]
    head_dim = spec.hidden_size // spec.num_attention_heads
    # None in the table: derived from the spec (head_dim, the attention scale, the expert width).
    derived = {"head_dim": head_dim, "query_pre_attn_scalar": head_dim, "moe_intermediate_size": spec.intermediate_size // 2,
               "shared_expert_intermediate_size": spec.intermediate_size}
    extra = {k: derived[k] if v is None else v for k, v in extra.items()}
    config = getattr(transformers, cfg_name)(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{"tie_word_embeddings": spec.tie_word_embeddings, **extra},
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    save_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    return save_dir
