"""Typed configuration of `train_ppo_ray`: frozen dataclasses, and a parser generated from them.

One frozen dataclass per flag section (`actor`, `ref`, `critic`, `reward`, `data`, `rollout`,
`train`, `algo`, `ds`, `vllm`, `ckpt`, `logger`, `precision`), composed into `PPOConfig`.
Every field is one dotted flag, `--<section>.<field>` (nested sections add dots:
`--actor.adam.lr`). The field's metadata carries its help text, the pre-0.11 flat aliases
OpenRLHF users know (`--pretrain`), short forms that set a constant (`--fp8_unified`), and
numeric bounds. The parser, the `--help` text and the flag tables in docs/cli.md are all
generated from the dataclasses, so there is one place to add a flag.

    cfg = parse_config(["--pretrain", "m", "--prompt_data", "d.jsonl", "--fp8_unified"])
    cfg.actor.adam.lr, cfg.precision.recipe, cfg.needs_critic

`parse_config` = argparse -> nested dataclasses -> `validate`. Problems a user can make on the
command line (unknown flag, an alias and its dotted name with different values, a rule broken
by `validate`) exit with status 2 and one message that names the flag and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import logging
import math
import operator
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

__all__ = [
    "ConfigError",
    "FlagSpec",
    "AdamConfig",
    "ActorConfig",
    "RefConfig",
    "CriticConfig",
    "RewardConfig",
    "DataConfig",
    "RolloutConfig",
    "TrainConfig",
    "AdvantageConfig",
    "KLConfig",
    "AlgoConfig",
    "DeepSpeedConfig",
    "VLLMConfig",
    "CkptConfig",
    "WandbConfig",
    "LoggerConfig",
    "PrecisionConfig",
    "PPOConfig",
    "GROUP_ESTIMATORS",
    "build_parser",
    "parse_config",
    "parse_unvalidated",
    "validate",
    "flag_specs",
    "render_flag_table",
    "render_alias_table",
    "update_docs",
]

logger = logging.getLogger(__name__)

# Estimators whose baseline is computed from the other samples of the same prompt.
GROUP_ESTIMATORS = ("group_norm", "rloo", "reinforce_baseline", "dr_grpo")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flag(s) and the fix."""


# Numeric bounds a field may declare (opt(..., ge=1)): name -> (symbol, check).
_BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le)}


# ---------------------------------------------------------------------------------------------
# Field helpers: the metadata the parser, the validator and the docs read.
# ---------------------------------------------------------------------------------------------
def opt(
    default: Any,
    help: str,
    *,
    aliases: Sequence[str] = (),
    const_aliases: dict[str, Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
) -> Any:
    """A flag field. `const_aliases` maps a short flag to the value it stands for (--fp8_unified)."""
    metadata = {
        "help": help,
        "aliases": tuple(aliases),
        "const_aliases": dict(const_aliases or {}),
        "bounds": {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le)) if v is not None},
    }
    return field(default=default, metadata=metadata)


def section(cls: type, help: str, *, aliases: dict[str, Sequence[str]] | None = None, **defaults: Any) -> Any:
    """A nested section. `aliases` adds flat aliases to its fields (per use: actor vs critic adam)."""
    metadata = {"help": help, "child_aliases": {k: tuple(v) for k, v in (aliases or {}).items()}}
    return field(default_factory=functools.partial(cls, **defaults), metadata=metadata)


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdamConfig:
    lr: float = opt(1e-6, "learning rate (peak, after warmup)", ge=0.0)
    betas: tuple[float, float] = opt((0.9, 0.95), "AdamW betas: BETA1 BETA2")
    eps: float = opt(1e-8, "AdamW epsilon", gt=0.0)
    weight_decay: float = opt(0.0, "decoupled weight decay", ge=0.0)


@dataclass(frozen=True)
class ActorConfig:
    model_name_or_path: str | None = opt(
        None, "policy model: a HF model id or a local folder (required)", aliases=["--pretrain"]
    )
    num_nodes: int = opt(1, "nodes for the actor group (Ray mode)", aliases=["--actor_num_nodes"], ge=1)
    num_gpus_per_node: int = opt(
        1, "GPUs per node for the actor group (Ray mode)", aliases=["--actor_num_gpus_per_node"], ge=1
    )
    gradient_checkpointing_enable: bool = opt(
        False, "recompute activations in backward to save memory", aliases=["--gradient_checkpointing"]
    )
    eps_clip: float = opt(0.2, "PPO ratio clip: ratio is clipped to [1-eps, 1+eps]", aliases=["--eps_clip"], gt=0.0)
    eps_clip_low_high: tuple[float, float] | None = opt(
        None,
        "clip-higher (DAPO): LOW HIGH clip the ratio to [1-LOW, 1+HIGH]; overrides --actor.eps_clip",
        aliases=["--eps_clip_low_high"],
    )
    dual_clip: float | None = opt(
        None,
        "dual-clip PPO: caps the loss of negative-advantage tokens at dual_clip*|A| (> 1)",
        aliases=["--dual_clip"],
    )
    entropy_coef: float = opt(
        0.0, "entropy bonus coefficient (0 = entropy is only logged)", aliases=["--entropy_loss_coef"], ge=0.0
    )
    max_norm: float = opt(1.0, "gradient clipping norm", aliases=["--max_norm"], gt=0.0)
    lr_warmup_ratio: float = opt(
        0.03, "fraction of optimizer steps spent in linear warmup", aliases=["--lr_warmup_ratio"], ge=0.0, le=1.0
    )
    min_lr_ratio: float = opt(0.1, "final lr as a fraction of the peak lr (cosine_with_min_lr)", ge=0.0, le=1.0)
    lr_scheduler: Literal["cosine_with_min_lr", "constant"] = opt(
        "cosine_with_min_lr", "learning-rate schedule after warmup", aliases=["--lr_scheduler"]
    )
    adam: AdamConfig = section(AdamConfig, "actor optimizer (AdamW)", aliases={"lr": ["--actor_learning_rate"]})


@dataclass(frozen=True)
class RefConfig:
    model_name_or_path: str | None = opt(None, "reference model (default: the actor's model)")
    num_nodes: int = opt(1, "nodes for the reference group (Ray mode)", aliases=["--ref_num_nodes"], ge=1)
    num_gpus_per_node: int = opt(
        1, "GPUs per node for the reference group (Ray mode)", aliases=["--ref_num_gpus_per_node"], ge=1
    )
    offload: bool = opt(
        False, "keep the reference model's weights on CPU between uses", aliases=["--ref_reward_offload"]
    )


@dataclass(frozen=True)
class CriticConfig:
    model_name_or_path: str | None = opt(
        None, "critic (value) model, used by gae only (default: the actor's model)", aliases=["--critic_pretrain"]
    )
    num_nodes: int = opt(1, "nodes for the critic group (Ray mode)", aliases=["--critic_num_nodes"], ge=1)
    num_gpus_per_node: int = opt(
        1, "GPUs per node for the critic group (Ray mode)", aliases=["--critic_num_gpus_per_node"], ge=1
    )
    value_clip: float = opt(0.5, "value-loss clip around the old values", aliases=["--value_clip"], ge=0.0)
    adam: AdamConfig = section(
        AdamConfig, "critic optimizer (AdamW)", aliases={"lr": ["--critic_learning_rate"]}, lr=9e-6
    )


@dataclass(frozen=True)
class RewardConfig:
    model_name_or_path: str | None = opt(
        None,
        "reward model; with neither this nor --reward.remote_url, the rule-based math reward (math-verify) is used",
        aliases=["--reward_pretrain"],
    )
    remote_url: str | None = opt(
        None, "an http(s) URL of a reward server, or a .py file defining reward_func", aliases=["--remote_rm_url"]
    )
    num_nodes: int = opt(1, "nodes for the reward group (Ray mode)", aliases=["--reward_num_nodes"], ge=1)
    num_gpus_per_node: int = opt(
        1, "GPUs per node for the reward group (Ray mode)", aliases=["--reward_num_gpus_per_node"], ge=1
    )
    normalize_enable: bool = opt(False, "normalize rewards with running statistics", aliases=["--normalize_reward"])
    clip_range: tuple[float, float] = opt(
        (-10.0, 10.0), "clip rewards to LOW HIGH", aliases=["--reward_clip_range"]
    )


@dataclass(frozen=True)
class DataConfig:
    prompt_dataset: str | None = opt(
        None,
        "prompt data: a .jsonl/.json/.parquet file or a local HF datasets folder (required)",
        aliases=["--prompt_data"],
    )
    prompt_split: str = opt("train", "split to read from the prompt dataset", aliases=["--prompt_split"])
    input_key: str = opt("input", "dataset column holding the prompt", aliases=["--input_key"])
    label_key: str | None = opt(
        None, "dataset column holding the reference answer (passed to the reward)", aliases=["--label_key"]
    )
    input_template: str | None = opt(
        None, "format string applied to the prompt, with one {} for it", aliases=["--input_template"]
    )
    apply_chat_template: bool = opt(
        False, "wrap the prompt with the tokenizer's chat template", aliases=["--apply_chat_template"]
    )
    max_len: int = opt(2048, "max tokens of prompt + response", aliases=["--max_len"])
    max_samples: int | None = opt(None, "use at most this many prompts", aliases=["--max_samples"], ge=1)


@dataclass(frozen=True)
class RolloutConfig:
    batch_size: int = opt(1024, "prompts per rollout (one PPO step)", aliases=["--rollout_batch_size"], ge=1)
    micro_batch_size: int = opt(
        1, "samples per forward when computing logprobs/values", aliases=["--micro_rollout_batch_size"], ge=1
    )
    n_samples_per_prompt: int = opt(
        1, "responses sampled per prompt (>= 2 for group estimators)", aliases=["--n_samples_per_prompt"], ge=1
    )
    max_new_tokens: int | None = opt(
        None,
        "max generated tokens (default: data.max_len - prompt length)",
        aliases=["--max_new_tokens", "--generate_max_len"],
    )
    temperature: float = opt(1.0, "sampling temperature", aliases=["--temperature"], ge=0.0)
    top_p: float = opt(1.0, "nucleus sampling threshold", aliases=["--top_p"], gt=0.0, le=1.0)
    top_k: int = opt(-1, "top-k sampling (-1 = off)", ge=-1)
    engine: Literal["auto", "vllm", "hf"] = opt(
        "auto", "rollout engine: vllm, hf (transformers), or auto (vllm if importable, else hf)"
    )


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = opt(128, "samples per optimizer step (global)", aliases=["--train_batch_size"], ge=1)
    micro_batch_size: int = opt(1, "samples per forward/backward per rank", aliases=["--micro_train_batch_size"], ge=1)
    max_epochs: int = opt(1, "passes over each rollout's samples", aliases=["--max_epochs"], ge=1)
    num_episodes: int = opt(1, "passes over the prompt dataset", aliases=["--num_episodes"], ge=1)
    seed: int = opt(42, "random seed (data order, sampling, init)", aliases=["--seed"])
    max_steps: int | None = opt(None, "stop after this many optimizer steps (handy for demos)", ge=1)
    eval_prompts: int = opt(
        0, "prompts (the dataset's first) of a sampled-reward evaluation before and after training; 0: none", ge=0
    )
    eval_samples: int = opt(4, "samples per evaluation prompt", aliases=["--eval_n_samples_per_prompt"], ge=1)
    colocate_actor_ref: bool = opt(False, "put actor and reference on the same GPUs", aliases=["--colocate_actor_ref"])
    colocate_all: bool = opt(
        False,
        "put all models and the rollout engines on the same GPUs (hybrid engine)",
        aliases=["--colocate_all_models"],
    )
    colocate_critic_reward: bool = opt(
        False, "put critic and reward model on the same GPUs", aliases=["--colocate_critic_reward"]
    )


@dataclass(frozen=True)
class AdvantageConfig:
    estimator: Literal["gae", "group_norm", "rloo", "reinforce", "reinforce_baseline", "dr_grpo"] = opt(
        "gae", "advantage estimator; group_norm is GRPO", aliases=["--advantage_estimator"]
    )
    gamma: float = opt(1.0, "discount factor", aliases=["--gamma"], ge=0.0, le=1.0)
    lambd: float = opt(1.0, "GAE lambda", aliases=["--lambd"], ge=0.0, le=1.0)
    no_std_norm: bool = opt(False, "do not divide advantages by their std", aliases=["--no_advantage_std_norm"])
    is_correction_enable: bool = opt(
        False,
        "importance-sampling correction for the rollout/train mismatch (needed by off-policy recipes)",
        aliases=["--enable_vllm_is_correction"],
    )
    is_correction_type: Literal["tis", "icepop"] = opt(
        "tis", "tis: truncate the IS weight; icepop: mask tokens whose weight leaves the range",
        aliases=["--vllm_is_correction_type"],
    )
    is_correction_threshold: tuple[float, float] = opt(
        (0.5, 5.0), "IS weight range LOW HIGH", aliases=["--vllm_is_truncated_threshold"]
    )


@dataclass(frozen=True)
class KLConfig:
    init_coef: float = opt(
        0.01, "KL coefficient (0 with no KL loss = no reference model)", aliases=["--init_kl_coef"], ge=0.0
    )
    use_loss: bool = opt(False, "KL as a loss term instead of a reward penalty", aliases=["--use_kl_loss"])
    estimator: Literal["k1", "k2", "k3"] = opt(
        "k1", "KL estimator (k1 in the reward; k2/k3 as a loss)", aliases=["--kl_estimator"]
    )
    target: float | None = opt(
        None, "target KL for the adaptive controller (None = fixed coef)", aliases=["--kl_target"]
    )
    horizon: int = opt(10000, "adaptive KL controller horizon", aliases=["--kl_horizon"], ge=1)


@dataclass(frozen=True)
class AlgoConfig:
    advantage: AdvantageConfig = section(AdvantageConfig, "advantages and importance-sampling correction")
    kl: KLConfig = section(KLConfig, "KL regularization against the reference model")


@dataclass(frozen=True)
class DeepSpeedConfig:
    zero_stage: Literal[0, 1, 2, 3] = opt(2, "DeepSpeed ZeRO stage", aliases=["--zero_stage"])
    param_dtype: Literal["bf16", "fp16", "fp32"] = opt(
        "bf16",
        "master-model dtype (fp32 for CPU debugging)",
        aliases=["--param_dtype"],
        const_aliases={"--bf16": "bf16"},
    )
    adam_offload: bool = opt(False, "keep optimizer states on CPU", aliases=["--adam_offload"])
    attn_implementation: str = opt("sdpa", "HF attention implementation (eager, sdpa, flash_attention_2, or jetrl_invariant: float64, batch-invariant, for bit-exact rollout/train verification on CPU)",
                                   aliases=["--attn_implementation"])
    overlap_comm: bool = opt(False, "overlap ZeRO communication with compute", aliases=["--overlap_comm"])
    grad_accum_dtype: Literal["fp16", "bf16", "fp32"] | None = opt(
        None, "gradient-accumulation dtype (None = DeepSpeed's default)", aliases=["--grad_accum_dtype"]
    )


@dataclass(frozen=True)
class VLLMConfig:
    num_engines: int | None = opt(None, "number of vLLM engines (Ray mode)", aliases=["--vllm_num_engines"], ge=1)
    tensor_parallel_size: int = opt(
        1, "tensor-parallel size of each engine", aliases=["--vllm_tensor_parallel_size"], ge=1
    )
    gpu_memory_utilization: float = opt(
        0.95, "fraction of GPU memory vLLM may take", aliases=["--vllm_gpu_memory_utilization"], gt=0.0, le=1.0
    )
    enable_sleep: bool = opt(
        False, "put engines to sleep during training (needs --train.colocate_all)", aliases=["--vllm_enable_sleep"]
    )
    enforce_eager: bool = opt(False, "disable CUDA graphs", aliases=["--enforce_eager"])
    sync_backend: Literal["auto", "nccl", "gloo"] = opt(
        "auto", "weight-sync backend (auto: nccl on GPU, gloo on CPU)", aliases=["--vllm_sync_backend"]
    )
    dtype: str = opt("auto", "vLLM model dtype")


@dataclass(frozen=True)
class CkptConfig:
    output_dir: str = opt("./ckpt", "where the final model is written", aliases=["--save_path"])
    path: str | None = opt(None, "checkpoint folder (default: <output_dir>/checkpoints_ppo)", aliases=["--ckpt_path"])
    save_steps: int = opt(-1, "save a checkpoint every N steps (-1 = only at the end)", aliases=["--save_steps"])
    load_enable: bool = opt(False, "resume from the latest checkpoint in --ckpt.path", aliases=["--load_checkpoint"])
    save_hf: bool = opt(False, "also export HF-format weights with each checkpoint", aliases=["--save_hf_ckpt"])
    max_num: int = opt(3, "keep at most this many checkpoints", aliases=["--max_ckpt_num"], ge=1)


@dataclass(frozen=True)
class WandbConfig:
    key: str | None = opt(None, "wandb API key (enables wandb)", aliases=["--use_wandb"])
    project: str = opt("openrlhf_train_ppo", "wandb project", aliases=["--wandb_project"])
    run_name: str | None = opt(None, "wandb run name", aliases=["--wandb_run_name"])
    group: str | None = opt(None, "wandb group", aliases=["--wandb_group"])
    org: str | None = opt(None, "wandb entity (org)", aliases=["--wandb_org"])
    mode: Literal["online", "offline", "disabled"] = opt(
        "online", "wandb mode; offline works without a key and enables wandb by itself"
    )

    @property
    def enabled(self) -> bool:
        """wandb runs when a key is given or offline mode is asked for, unless mode is disabled."""
        return self.mode != "disabled" and (self.key is not None or self.mode == "offline")


@dataclass(frozen=True)
class LoggerConfig:
    tensorboard_dir: str | None = opt(None, "write TensorBoard logs here", aliases=["--use_tensorboard"])
    logging_steps: int = opt(1, "log metrics every N steps", aliases=["--logging_steps"], ge=1)
    wandb: WandbConfig = section(WandbConfig, "Weights & Biases logging")


@dataclass(frozen=True)
class PrecisionConfig:
    recipe: str = opt(
        "bf16",
        "precision recipe: bf16, fp8_rollout, jet_fp8, or a path to a .yaml/.json recipe",
        const_aliases={"--fp8_unified": "jet_fp8"},
    )
    gemm_backend: Literal["auto", "emulated", "torch", "triton", "deep_gemm"] = opt(
        "auto", "FP8 GEMM backend (auto: the recipe's choice, then the fastest available)"
    )
    strict: bool = opt(False, "refuse off-policy recipes (the rollout graph must be a subgraph of train fwd)")

    def load_recipe(self):
        """The `jetrl_precision.PrecisionRecipe`, with --precision.gemm_backend applied when not auto."""
        from jetrl_precision.recipe import get_recipe  # lazy: keeps `--help` free of torch

        recipe = get_recipe(self.recipe)
        return recipe if self.gemm_backend == "auto" else recipe.replace(gemm_backend=self.gemm_backend)


@dataclass(frozen=True)
class PPOConfig:
    """The whole run. Build it with `parse_config`; read derived values through the properties."""

    actor: ActorConfig = section(ActorConfig, "policy model, PPO loss and schedule")
    ref: RefConfig = section(RefConfig, "reference model (for the KL term)")
    critic: CriticConfig = section(CriticConfig, "critic / value model (gae only)")
    reward: RewardConfig = section(RewardConfig, "reward: a model, a remote URL / .py function, or rule-based math")
    data: DataConfig = section(DataConfig, "prompt dataset")
    rollout: RolloutConfig = section(RolloutConfig, "generation")
    train: TrainConfig = section(TrainConfig, "optimization loop and placement")
    algo: AlgoConfig = section(AlgoConfig, "algorithm")
    ds: DeepSpeedConfig = section(DeepSpeedConfig, "DeepSpeed")
    vllm: VLLMConfig = section(VLLMConfig, "vLLM rollout engines")
    ckpt: CkptConfig = section(CkptConfig, "checkpoints and model export")
    logger: LoggerConfig = section(LoggerConfig, "logging")
    precision: PrecisionConfig = section(PrecisionConfig, "precision flow shared by rollout and training (Jet-RL)")
    local_rank: int = opt(-1, "set by the deepspeed launcher; leave it alone", aliases=["--local-rank"])
    # Not a flag: what `validate` warned about, kept for the run's log/summary.
    cfg_warnings: tuple[str, ...] = field(default=(), metadata={"cli": False})

    # ---- derived values (never stored: the fields stay what the user passed) ----------------
    @property
    def ref_model_path(self) -> str | None:
        return self.ref.model_name_or_path or self.actor.model_name_or_path

    @property
    def needs_critic(self) -> bool:
        return self.algo.advantage.estimator == "gae"

    @property
    def critic_model_path(self) -> str | None:
        """The critic's init weights (the actor's when unset); None when the estimator needs no critic."""
        if not self.needs_critic:
            return None
        return self.critic.model_name_or_path or self.actor.model_name_or_path

    @property
    def needs_ref(self) -> bool:
        return self.algo.kl.init_coef > 0 or self.algo.kl.use_loss

    @property
    def reward_source(self) -> Literal["remote", "model", "math"]:
        """Where rewards come from: a URL/.py function, a reward model, or the rule-based math reward."""
        if self.reward.remote_url:
            return "remote"
        return "model" if self.reward.model_name_or_path else "math"

    @property
    def ckpt_path(self) -> str:
        return self.ckpt.path or os.path.join(self.ckpt.output_dir, "checkpoints_ppo")

    @property
    def eps_clip_low(self) -> float:
        low_high = self.actor.eps_clip_low_high
        return low_high[0] if low_high is not None else self.actor.eps_clip

    @property
    def eps_clip_high(self) -> float:
        low_high = self.actor.eps_clip_low_high
        return low_high[1] if low_high is not None else self.actor.eps_clip

    # ---- serialization ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A nested plain dict (tuples become lists) for logging and YAML; `from_dict` inverts it."""
        return _to_plain(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PPOConfig":
        """Rebuild from `to_dict` output (or a hand-written subset); unknown keys are an error. Not validated."""
        return _from_nested(cls, cls(), data, "")


# ---------------------------------------------------------------------------------------------
# Walking the dataclasses
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlagSpec:
    """One flag, derived from one dataclass field."""

    dest: str  # dotted path in PPOConfig, e.g. "actor.adam.lr"
    section: str  # "actor.adam"; "" for top-level fields
    type: type  # element type: str, int, float or bool
    default: Any
    help: str
    optional: bool = False  # None is a valid value
    nargs: int | None = None  # tuple fields: the number of values
    choices: tuple[Any, ...] | None = None
    aliases: tuple[str, ...] = ()
    const_aliases: tuple[tuple[str, Any], ...] = ()
    bounds: tuple[tuple[str, float], ...] = ()

    @property
    def flag(self) -> str:
        return f"--{self.dest}"

    def type_str(self) -> str:
        if self.choices is not None:
            return "{" + ",".join(str(c) for c in self.choices) + "}"
        if self.type is bool:
            return "flag"
        name = self.type.__name__
        return " ".join([name] * self.nargs) if self.nargs else name


def _resolve_hint(hint: Any) -> tuple[type, bool, int | None, tuple | None]:
    """(element type, optional, nargs, choices) of a field's type hint."""
    optional = False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        if len(args) != 1:
            raise TypeError(f"unsupported union type {hint}")
        hint, origin = args[0], typing.get_origin(args[0])
    if origin is Literal:
        choices = typing.get_args(hint)
        return type(choices[0]), optional, None, choices
    if origin is tuple:
        args = typing.get_args(hint)
        if Ellipsis in args or len(set(args)) != 1:
            raise TypeError(f"tuple fields must be fixed-length and homogeneous, got {hint}")
        return args[0], optional, len(args), None
    if hint not in (str, int, float, bool):
        raise TypeError(f"unsupported field type {hint}")
    return hint, optional, None, None


def _walk(cls: type, default: Any, prefix: str, child_aliases: dict[str, tuple[str, ...]]) -> Iterator[FlagSpec]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        value = getattr(default, f.name)
        dest = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _walk(hints[f.name], value, dest + ".", f.metadata.get("child_aliases", {}))
            continue
        elem, optional, nargs, choices = _resolve_hint(hints[f.name])
        yield FlagSpec(
            dest=dest,
            section=prefix[:-1],
            type=elem,
            default=value,
            help=f.metadata.get("help", ""),
            optional=optional,
            nargs=nargs,
            choices=choices,
            aliases=tuple(f.metadata.get("aliases", ())) + tuple(child_aliases.get(f.name, ())),
            const_aliases=tuple(f.metadata.get("const_aliases", {}).items()),
            bounds=tuple(f.metadata.get("bounds", {}).items()),
        )


@functools.lru_cache(maxsize=None)
def flag_specs() -> tuple[FlagSpec, ...]:
    """Every flag of PPOConfig, in declaration order (sections first, then top-level fields)."""
    return tuple(_walk(PPOConfig, PPOConfig(), "", {}))


@functools.lru_cache(maxsize=None)
def _section_help() -> dict[str, str]:
    """Dotted section name -> its help text (from the `section(...)` metadata)."""
    out: dict[str, str] = {}

    def visit(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                out[prefix + f.name] = f.metadata.get("help", "")
                visit(hints[f.name], prefix + f.name + ".")

    visit(PPOConfig, "")
    return out


def _get(cfg: Any, dest: str) -> Any:
    for part in dest.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_to_plain(v) for v in value]
    return value


def _from_nested(cls: type, default: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    changes = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {where}{close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {where}{key}{hint}")
        current = getattr(default, key)
        if dataclasses.is_dataclass(current):
            changes[key] = _from_nested(type(current), current, value, f"{where}{key}.")
        else:
            changes[key] = tuple(value) if isinstance(value, list) else value
    return dataclasses.replace(default, **changes)


def _from_flat(values: dict[str, Any]) -> PPOConfig:
    """PPOConfig from {dotted dest: value}; absent dests keep their defaults."""
    nested: dict[str, Any] = {}
    for dest, value in values.items():
        *parents, leaf = dest.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return PPOConfig.from_dict(nested)


# ---------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------
_ALIAS_SEP = "|"  # argparse dest of an alias: "<dotted dest>|<alias flag>", so conflicts can be seen


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=44, width=120)


def _default_str(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value)
    return str(value)


def _flag_help(spec: FlagSpec) -> str:
    text = spec.help
    if spec.type is not bool:
        text += f" [default: {_default_str(spec.default)}]"
    if spec.aliases:
        text += f" (alias: {', '.join(spec.aliases)})"
    return text.replace("%", "%%")


_DESCRIPTION = """\
PPO/GRPO training with one FP8 precision flow shared by rollout and training (Jet-RL).

Flags are OpenRLHF v0.11's dotted names (--<section>.<field>); the pre-0.11 flat names
(--pretrain, --prompt_data, --vllm_num_engines, ...) are accepted as aliases. See docs/cli.md."""

_EPILOG = """\
examples:
  GRPO, unified FP8:  --pretrain M --prompt_data D.jsonl --algo.advantage.estimator group_norm \\
                      --rollout.n_samples_per_prompt 8 --algo.kl.use_loss --algo.kl.estimator k3 --fp8_unified
  FP8 rollout only:   ... --precision.recipe fp8_rollout --algo.advantage.is_correction_enable"""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser, generated from the dataclasses. Absent flags are absent from the
    Namespace (default=SUPPRESS): defaults live in the dataclasses only."""
    parser = argparse.ArgumentParser(
        prog=prog or "train_ppo_ray",
        usage="%(prog)s [-h] [--<section>.<field> VALUE ...] [flat aliases such as --pretrain PATH ...]",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_HelpFormatter,
        allow_abbrev=False,  # a prefix must never silently pick a flag
        argument_default=argparse.SUPPRESS,
    )
    section_help = _section_help()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in flag_specs():
        if spec.section not in groups:
            title = f"--{spec.section}.*" if spec.section else "launcher"
            groups[spec.section] = parser.add_argument_group(title, section_help.get(spec.section, "set by launchers"))
        group = groups[spec.section]
        if spec.type is bool:
            kwargs: dict[str, Any] = {"action": "store_true"}
        else:
            kwargs = {"type": spec.type, "metavar": spec.type.__name__.upper()}
            if spec.choices is not None:
                kwargs["choices"] = spec.choices
                del kwargs["metavar"]
            if spec.nargs:
                kwargs["nargs"] = spec.nargs
        group.add_argument(spec.flag, dest=spec.dest, help=_flag_help(spec), **kwargs)
        for alias in spec.aliases:
            group.add_argument(alias, dest=f"{spec.dest}{_ALIAS_SEP}{alias}", help=argparse.SUPPRESS, **kwargs)
        for alias, const in spec.const_aliases:
            group.add_argument(
                alias,
                dest=f"{spec.dest}{_ALIAS_SEP}{alias}",
                action="store_const",
                const=const,
                help=f"short for {spec.flag} {const}",
            )
    return parser


def _suggest(flag: str) -> list[str]:
    """The closest flags to an unknown one: by spelling, with a bonus for the same leaf name
    (--actor.lr -> --actor.adam.lr; --lr -> --actor.adam.lr, --critic.adam.lr) or a prefix."""
    canonical: dict[str, str] = {}  # any option string -> the flag to suggest
    for spec in flag_specs():
        canonical[spec.flag] = spec.flag
        canonical.update({alias: spec.flag for alias in spec.aliases})
        canonical.update({alias: alias for alias, _ in spec.const_aliases})  # --fp8_unified is its own thing
    leaf = flag.lstrip("-").rsplit(".", 1)[-1]
    scores: dict[str, float] = {}
    for option, target in canonical.items():
        score = difflib.SequenceMatcher(None, flag, option).ratio()
        score += 0.2 if option.lstrip("-").rsplit(".", 1)[-1] == leaf else 0.0
        score += 0.2 if "." in flag and option.startswith(flag) else 0.0  # an abbreviated dotted flag
        scores[target] = max(score, scores.get(target, 0.0))
    best = max(scores.values())
    if best < 0.6:
        return []
    ranked = sorted((t for t, sc in scores.items() if sc >= best - 0.05), key=lambda t: -scores[t])
    return ranked[:3]


def _unknown_message(extras: list[str]) -> str:
    flags = [e.split("=", 1)[0] for e in extras if re.match(r"^--?[A-Za-z]", e)]
    if not flags:
        return f"unrecognized argument(s): {' '.join(extras)}; values must follow a flag"
    lines = []
    for flag in flags:
        close = _suggest(flag)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; see --help for the flag list"
        lines.append(f"unrecognized argument {flag}{hint}")
    return "\n".join(lines)


def _normalize(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _merge_given(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict[str, Any]:
    """{dotted dest: value} of the flags given; an alias and its dotted name must agree."""
    given: dict[str, list[tuple[str, Any]]] = {}
    for key, value in vars(ns).items():
        dest, _, alias = key.partition(_ALIAS_SEP)
        given.setdefault(dest, []).append((alias or f"--{dest}", _normalize(value)))
    consts = {alias for spec in flag_specs() for alias, _ in spec.const_aliases}
    values = {}
    for dest, pairs in given.items():
        if len({repr(v) for _, v in pairs}) > 1:
            shown = [f"{f} (= {_default_str(v)})" if f in consts else f"{f} {_default_str(v)}" for f, v in pairs]
            parser.error(
                f"conflicting values for --{dest}: {' vs '.join(shown)}; "
                f"these flags set the same option, pass only one of them"
            )
        values[dest] = pairs[-1][1]
    return values


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> PPOConfig:
    ns, extras = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if extras:
        parser.error(_unknown_message(extras))
    return _from_flat(_merge_given(parser, ns))


def parse_unvalidated(argv: Sequence[str] | None = None) -> PPOConfig:
    """Flags -> PPOConfig without `validate` (tools and tests that only need the mapping)."""
    return _parse(build_parser(), argv)


def parse_config(argv: Sequence[str] | None = None, *, exit_on_error: bool = True) -> PPOConfig:
    """Parse `argv` (default sys.argv[1:]) into a validated PPOConfig.

    Command-line mistakes exit with status 2 and an argparse-style message. A rule broken by
    `validate` does the same, unless `exit_on_error=False`, which raises the ConfigError instead.
    """
    parser = build_parser()
    cfg = _parse(parser, argv)
    try:
        return validate(cfg)
    except ConfigError as e:
        if not exit_on_error:
            raise
        parser.error(str(e))
        raise  # unreachable: parser.error exits


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def _alias_note(dest: str) -> str:
    spec = next(s for s in flag_specs() if s.dest == dest)
    return f"--{dest} (alias {spec.aliases[0]})" if spec.aliases else f"--{dest}"


def _check_field(spec: FlagSpec, value: Any) -> str | None:
    """Type, choices and bounds of one field; these matter for configs built by from_dict."""
    if value is None:
        return None if spec.optional else f"{spec.flag} must be set"
    if spec.nargs:
        if not isinstance(value, tuple) or len(value) != spec.nargs:
            return f"{spec.flag} takes {spec.nargs} values, got {value!r}"
        items = value
    else:
        items = (value,)
    for item in items:
        ok = isinstance(item, spec.type) and not (spec.type is not bool and isinstance(item, bool))
        if spec.type is float and isinstance(item, int) and not isinstance(item, bool):
            ok = True
        if not ok:
            return f"{spec.flag} must be {spec.type.__name__}, got {item!r}"
        if spec.choices is not None and item not in spec.choices:
            return f"{spec.flag} must be one of {', '.join(map(str, spec.choices))}; got {item!r}"
        if spec.type is float and not math.isfinite(item):
            return f"{spec.flag} must be finite, got {item!r}"
        for op, bound in spec.bounds:
            word, holds = _BOUNDS[op]
            if not holds(item, bound):
                return f"{spec.flag} must be {word} {bound}, got {item!r}"
    return None


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _rule_errors(cfg: PPOConfig) -> list[str]:
    errors = []
    adv, kl, roll, data, train = cfg.algo.advantage, cfg.algo.kl, cfg.rollout, cfg.data, cfg.train

    if not cfg.actor.model_name_or_path:
        errors.append(f"{_alias_note('actor.model_name_or_path')} is required: a HF model id or a local model folder")
    if not data.prompt_dataset:
        errors.append(
            f"{_alias_note('data.prompt_dataset')} is required: a .jsonl/.json/.parquet file or a local HF "
            f"datasets folder"
        )
    if adv.estimator in GROUP_ESTIMATORS and roll.n_samples_per_prompt < 2:
        errors.append(
            f"--algo.advantage.estimator {adv.estimator} computes its baseline from the other samples of the same "
            f"prompt, so it needs --rollout.n_samples_per_prompt >= 2 (got {roll.n_samples_per_prompt}); "
            f"pass e.g. --rollout.n_samples_per_prompt 8, or use --algo.advantage.estimator reinforce"
        )
    if data.max_len <= 0:
        errors.append(f"--data.max_len must be > 0 (it bounds prompt + response tokens), got {data.max_len}")
    if roll.max_new_tokens is not None:
        if roll.max_new_tokens <= 0:
            errors.append(f"--rollout.max_new_tokens must be > 0, got {roll.max_new_tokens}")
        elif data.max_len > 0 and roll.max_new_tokens >= data.max_len:
            errors.append(
                f"--rollout.max_new_tokens ({roll.max_new_tokens}) must be smaller than --data.max_len "
                f"({data.max_len}), which bounds prompt + response; raise --data.max_len or lower "
                f"--rollout.max_new_tokens"
            )
    if train.batch_size % train.micro_batch_size:
        errors.append(
            f"--train.batch_size ({train.batch_size}) must be a multiple of --train.micro_batch_size "
            f"({train.micro_batch_size}): one optimizer step accumulates whole micro-batches; e.g. "
            f"--train.micro_batch_size {_largest_divisor_at_most(train.batch_size, train.micro_batch_size)}"
        )
    samples = roll.batch_size * roll.n_samples_per_prompt
    if samples % train.batch_size:
        errors.append(
            f"--rollout.batch_size x --rollout.n_samples_per_prompt = {roll.batch_size} x {roll.n_samples_per_prompt} "
            f"= {samples} samples per rollout must be a multiple of --train.batch_size ({train.batch_size}), so each "
            f"rollout yields whole optimizer steps; e.g. --train.batch_size "
            f"{_largest_divisor_at_most(samples, train.batch_size)}"
        )

    errors += _reward_errors(cfg.reward)

    low_high = cfg.actor.eps_clip_low_high
    if low_high is not None and not (0 < low_high[0] < 1 and low_high[1] > 0):
        errors.append(
            f"--actor.eps_clip_low_high LOW HIGH clips the ratio to [1-LOW, 1+HIGH]: need 0 < LOW < 1 and "
            f"HIGH > 0, got {_default_str(low_high)}; e.g. --actor.eps_clip_low_high 0.2 0.28"
        )
    if cfg.actor.dual_clip is not None and cfg.actor.dual_clip <= 1.0:
        errors.append(f"--actor.dual_clip must be > 1 (it caps the loss at dual_clip*|A|), got {cfg.actor.dual_clip}")
    lo, hi = adv.is_correction_threshold
    if not 0 <= lo < hi:
        errors.append(
            f"--algo.advantage.is_correction_threshold LOW HIGH needs 0 <= LOW < HIGH, got {_default_str((lo, hi))}; "
            f"e.g. --algo.advantage.is_correction_threshold 0.5 5.0"
        )
    if cfg.reward.clip_range[0] >= cfg.reward.clip_range[1]:
        errors.append(f"--reward.clip_range LOW HIGH needs LOW < HIGH, got {_default_str(cfg.reward.clip_range)}")
    if roll.top_k == 0:
        errors.append("--rollout.top_k 0 would sample nothing: use -1 (off) or a positive k")

    errors += _precision_errors(cfg.precision)
    return errors


def _reward_errors(reward: RewardConfig) -> list[str]:
    url = reward.remote_url
    if not url:
        return []
    errors = []
    if reward.model_name_or_path:
        errors.append(
            f"give one reward source: --reward.model_name_or_path {reward.model_name_or_path} and "
            f"--reward.remote_url {url} were both set; drop one"
        )
    if url.startswith(("http://", "https://")):
        return errors
    if url.endswith(".py"):
        if not Path(url).is_file():
            errors.append(
                f"--reward.remote_url {url}: no such file; pass an existing .py file that defines "
                f"reward_func, or an http(s) URL of a reward server"
            )
        return errors
    errors.append(
        f"--reward.remote_url {url!r} is neither an http(s) URL nor a .py file; pass a reward-server URL "
        f"(http://host:port/...) or a .py file defining reward_func (omit it for the rule-based math reward)"
    )
    return errors


def _precision_errors(precision: PrecisionConfig) -> list[str]:
    try:
        recipe = precision.load_recipe()
    except Exception as e:  # RecipeError, FileNotFoundError, YAML/JSON syntax errors: all mean a bad recipe
        return [
            f"--precision.recipe {precision.recipe}: {e}. Use one of bf16, fp8_rollout, jet_fp8 "
            f"(--fp8_unified = jet_fp8) or a path to a .yaml/.json recipe file"
        ]
    if precision.strict and recipe.off_policy:
        return [
            f"--precision.strict refuses an off-policy recipe ({recipe.name}: rollout quantization differs "
            f"from the training forward); drop --precision.strict or use jet_fp8 (--fp8_unified)"
        ]
    return []


def _warnings(cfg: PPOConfig) -> list[str]:
    out = []
    try:
        recipe = cfg.precision.load_recipe()
    except Exception:  # reported as an error already
        recipe = None
    if recipe is not None and recipe.off_policy and not cfg.algo.advantage.is_correction_enable:
        r, t = recipe.rollout, recipe.train_fprop
        out.append(
            f"--precision.recipe {cfg.precision.recipe} is off-policy: rollouts are sampled with different "
            f"numerics (x={r.input.short_str()} W={r.weight.short_str()}) than the policy being trained "
            f"(x={t.input.short_str()} W={t.weight.short_str()}), so every token's logprob differs between "
            f"sampler and learner. The mismatch grows with response length and training tends to collapse "
            f"past ~8k tokens. "
            f"Enable importance-sampling correction (--algo.advantage.is_correction_enable "
            f"--algo.advantage.is_correction_type tis), or switch to the unified flow (--fp8_unified)"
        )
    if cfg.vllm.enable_sleep and not cfg.train.colocate_all:
        out.append(
            "--vllm.enable_sleep only helps when engines share GPUs with training; it is forced off "
            "because --train.colocate_all is not set (add --train.colocate_all to keep it)"
        )
    return out


def validate(cfg: PPOConfig) -> PPOConfig:
    """Check `cfg`; raise ConfigError listing every broken rule, else return the config to run.

    The returned config differs from `cfg` only where a setting is forced (vllm.enable_sleep
    without train.colocate_all is turned off) and in `cfg_warnings`, the warnings also logged.
    """
    errors = [e for spec in flag_specs() if (e := _check_field(spec, _get(cfg, spec.dest)))]
    if not errors:  # the rules assume well-typed fields
        errors = _rule_errors(cfg)
    if errors:
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"{len(errors)} configuration errors:\n" + "\n".join(f"  - {e}" for e in errors))

    warnings = _warnings(cfg)
    for w in warnings:
        logger.warning(w)
    if cfg.vllm.enable_sleep and not cfg.train.colocate_all:
        cfg = dataclasses.replace(cfg, vllm=dataclasses.replace(cfg.vllm, enable_sleep=False))
    if cfg.needs_critic and not cfg.critic.model_name_or_path:
        logger.info("gae needs a critic; --critic.model_name_or_path is unset, so it starts from the actor's "
                    "model (%s) with a fresh value head", cfg.actor.model_name_or_path)
    return dataclasses.replace(cfg, cfg_warnings=tuple(warnings))


# ---------------------------------------------------------------------------------------------
# Docs
# ---------------------------------------------------------------------------------------------
def _md(text: str) -> str:
    return text.replace("|", "\\|")


def render_flag_table() -> str:
    """Markdown: one table per section with flag, type, default, aliases and description."""
    section_help = _section_help()
    parts: list[str] = []
    current = None
    for spec in flag_specs():
        if spec.section != current:
            current = spec.section
            title = f"`--{current}.*`" if current else "launcher"
            desc = section_help.get(current, "set by launchers")
            parts.append(f"\n### {title}: {desc}\n")
            parts.append("| flag | type | default | aliases | description |\n|---|---|---|---|---|")
        aliases = ", ".join(f"`{a}`" for a in spec.aliases + tuple(a for a, _ in spec.const_aliases))
        bounds = ", ".join(f"{_BOUNDS[op][0]} {b}" for op, b in spec.bounds)
        desc = spec.help + (f" (range: {bounds})" if bounds else "")
        default = "off" if spec.type is bool and spec.default is False else f"`{_default_str(spec.default)}`"
        parts.append(f"| `{spec.flag}` | {_md(spec.type_str())} | {_md(default)} | {aliases} | {_md(desc)} |")
    return "\n".join(parts).lstrip("\n") + "\n"


def render_alias_table() -> str:
    """Markdown: flat (pre-0.11) alias -> dotted flag, sorted by alias."""
    rows = []
    for spec in flag_specs():
        rows += [(a, f"`{spec.flag}`") for a in spec.aliases]
        rows += [(a, f"`{spec.flag} {c}`") for a, c in spec.const_aliases]
    lines = ["| flat alias | same as |", "|---|---|"]
    lines += [f"| `{a}` | {target} |" for a, target in sorted(rows)]
    return "\n".join(lines) + "\n"


_GENERATED = {"flags": render_flag_table, "aliases": render_alias_table}


def update_docs(path: str | Path) -> bool:
    """Rewrite the generated blocks of a doc (between `<!-- BEGIN GENERATED: name -->` and
    `<!-- END GENERATED: name -->`). Returns whether the file changed."""
    path = Path(path)
    text = original = path.read_text()
    for name, render in _GENERATED.items():
        pattern = re.compile(rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: {name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"{path} has no '<!-- BEGIN GENERATED: {name} -->' block")
        text = pattern.sub(lambda m: m.group(1) + render() + m.group(2), text)
    if text != original:
        path.write_text(text)
    return text != original


if __name__ == "__main__":  # python -m openrlhf.cli.config docs/cli.md  -> refresh the generated tables
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m openrlhf.cli.config <doc.md>")
    print(("updated " if update_docs(sys.argv[1]) else "up to date: ") + sys.argv[1])
