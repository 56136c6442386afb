"""Checks of a whole `PPOConfig`: field types and bounds, then the rules across fields.

`validate` raises one ConfigError listing every broken rule (each names the flag and the fix),
and returns the config to run with its warnings recorded in `cfg_warnings`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

from jetrl_precision.recipe import RECIPE_FILE_SUFFIXES

from .fields import BOUNDS, ConfigError
from .flags import FlagSpec, default_str, flag_specs, get_field
from .schema import GROUP_ESTIMATORS, PPOConfig, PrecisionConfig, RewardConfig

__all__ = ["validate", "parse_probs"]

logger = logging.getLogger(__name__)

def _alias_note(dest: str) -> str:
    spec = next(s for s in flag_specs() if s.dest == dest)
    return f"--{dest} (alias {spec.aliases[0]})" if spec.aliases else f"--{dest}"


def _check_field(spec: FlagSpec, value: Any) -> str | None:
    """Type, choices and bounds of one field; these matter for configs built by from_dict."""
    if value is None:
        return None if spec.optional else f"{spec.flag} must be set"
    if spec.nargs == "*":
        if not isinstance(value, tuple):
            return f"{spec.flag} takes a list of values, got {value!r}"
        items = value
    elif spec.nargs:
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
            word, holds = BOUNDS[op]
            if not holds(item, bound):
                return f"{spec.flag} must be {word} {bound}, got {item!r}"
    return None


def parse_probs(probs: str, n_sources: int) -> list[float]:
    """--data.prompt_probs "0.7,0.3": one positive weight per comma-separated source, normalized to sum to 1."""
    try:
        weights = [float(w) for w in probs.split(",")]
    except ValueError:
        raise ConfigError(f"--data.prompt_probs {probs!r}: not a comma-separated list of numbers (e.g. 0.7,0.3)") from None
    if len(weights) != n_sources:
        raise ConfigError(
            f"--data.prompt_probs {probs!r} gives {len(weights)} weights for {n_sources} comma-separated "
            f"--data.prompt_dataset sources; give one weight per source"
        )
    if not all(w > 0 and w != float("inf") for w in weights):
        raise ConfigError(f"--data.prompt_probs {probs!r}: every weight must be a finite number > 0 (drop a source instead of weighting it 0)")
    total = sum(weights)
    return [w / total for w in weights]


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _rule_errors(cfg: PPOConfig) -> list[str]:
    errors = []
    adv, roll, data, train = cfg.algo.advantage, cfg.rollout, cfg.data, cfg.train

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
            f"HIGH > 0, got {default_str(low_high)}; e.g. --actor.eps_clip_low_high 0.2 0.28"
        )
    if cfg.actor.dual_clip is not None and cfg.actor.dual_clip <= 1.0:
        errors.append(f"--actor.dual_clip must be > 1 (it caps the loss at dual_clip*|A|), got {cfg.actor.dual_clip}")
    lo, hi = adv.is_correction_threshold
    if not 0 <= lo < hi:
        errors.append(
            f"--algo.advantage.is_correction_threshold LOW HIGH needs 0 <= LOW < HIGH, got {default_str((lo, hi))}; "
            f"e.g. --algo.advantage.is_correction_threshold 0.5 5.0"
        )
    if cfg.reward.clip_range[0] >= cfg.reward.clip_range[1]:
        errors.append(f"--reward.clip_range LOW HIGH needs LOW < HIGH, got {default_str(cfg.reward.clip_range)}")
    if roll.top_k == 0:
        errors.append("--rollout.top_k 0 would sample nothing: use -1 (off) or a positive k")

    lo, hi = cfg.algo.dynamic_filtering_range
    if cfg.algo.dynamic_filtering_enable and (lo >= hi or roll.n_samples_per_prompt < 2):
        errors.append(
            f"--algo.dynamic_filtering_enable keeps prompts whose {roll.n_samples_per_prompt} samples' mean score lies in "
            f"({lo:g}, {hi:g}): it needs LOW < HIGH and --rollout.n_samples_per_prompt >= 2"
        )
    agent = cfg.train.agent_func_path
    if agent and not Path(agent).is_file():
        errors.append(f"--train.agent_func_path {agent}: no such file; pass a .py file that defines AgentExecutor")
    if cfg.eval.steps > 0 and not cfg.eval.dataset:
        errors.append(f"--eval.steps {cfg.eval.steps} evaluates on --eval.dataset, which is not set; pass one or drop --eval.steps")
    if data.prompt_probs is not None and data.prompt_dataset:
        try:
            parse_probs(data.prompt_probs, len([s for s in data.prompt_dataset.split(",") if s.strip()]))
        except ConfigError as e:
            errors.append(str(e))
    if cfg.ckpt.disable_ds and cfg.ckpt.load_enable:
        errors.append(
            "--ckpt.disable_ds saves no DeepSpeed checkpoint, so --ckpt.load_enable has nothing to resume from "
            "(HF exports hold no optimizer state or data position); drop one of them"
        )
    if cfg.ds.zpg > 1 and cfg.ds.zero_stage != 3:
        errors.append(
            f"--ds.zpg {cfg.ds.zpg} (ZeRO++ hierarchical partitioning) partitions ZeRO-3 parameters; with "
            f"--ds.zero_stage {cfg.ds.zero_stage} it would do nothing: add --ds.zero_stage 3 or drop --ds.zpg"
        )
    errors += _precision_errors(cfg.precision)
    if cfg.precision.bitwise:
        errors += _bitwise_errors(cfg)
    return errors


def _bitwise_errors(cfg: PPOConfig) -> list[str]:
    """--precision.bitwise needs an on-policy recipe, the transformers engine and the batch-invariant kernels;
    the device is checked before the first step (preflight)."""
    p, errors = cfg.precision, []
    try:
        recipe = p.load_recipe()
    except Exception:  # reported by _precision_errors
        return []
    if recipe.off_policy:
        errors.append(
            f"--precision.bitwise needs an on-policy recipe: {recipe.name} samples from other numerics than it trains "
            "by design; use bf16 or jet_fp8 (--fp8_unified)"
        )
    if p.gemm_backend not in ("auto", "emulated", "triton_invariant"):
        errors.append(
            f"--precision.bitwise: the {p.gemm_backend} FP8 GEMM is not batch-invariant (its tiling depends on the row "
            "count); only emulated (CPU) and triton_invariant (CUDA) are: drop --precision.gemm_backend"
        )
    if recipe.kv_cache != "auto":
        errors.append(
            f"--precision.bitwise reads the KV cache in the model's dtype (its attention kernels are batch-invariant on "
            f"bf16 keys and values); the recipe's kv_cache {recipe.kv_cache} has no such kernel: drop one of them"
        )
    if cfg.ds.attn_implementation not in ("sdpa", "jetrl_invariant"):
        errors.append(
            f"--precision.bitwise runs the batch-invariant attention (jetrl_invariant), not "
            f"--ds.attn_implementation {cfg.ds.attn_implementation}: drop --ds.attn_implementation"
        )
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
        # An unknown name's error already lists the names; a recipe file's error says what is wrong in the file.
        is_file = str(precision.recipe).endswith(RECIPE_FILE_SUFFIXES)
        return [f"--precision.recipe {precision.recipe}: {e}" + ("" if is_file else " (--fp8_unified is jet_fp8)")]
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
    if cfg.algo.advantage.no_std_norm and cfg.algo.advantage.estimator in GROUP_ESTIMATORS:
        out.append(
            f"--algo.advantage.no_std_norm changes the batch normalization of gae/reinforce/reinforce_baseline advantages "
            f"only (as in OpenRLHF v0.11); {cfg.algo.advantage.estimator} keeps its own group normalization. For a "
            f"mean-only group baseline use --algo.advantage.estimator dr_grpo"
        )
    if cfg.ds.use_universal_ckpt and not cfg.ckpt.load_enable:
        out.append("--ds.use_universal_ckpt only changes how a checkpoint is resumed; it has no effect without --ckpt.load_enable")
    if cfg.vllm.sync_with_ray:
        out.append(
            "--vllm.sync_with_ray: weights always sync over a torch.distributed group here (gloo/NCCL, --vllm.sync_backend), "
            "not ray.util.collective; the same bytes arrive, the flag changes nothing"
        )
    if cfg.data.dataloader_num_workers > 0:
        out.append(
            f"--data.dataloader_num_workers {cfg.data.dataloader_num_workers}: prompts are read into memory once and "
            "tokenized per rollout, so no loader workers run; the flag changes nothing"
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
    errors = [e for spec in flag_specs() if (e := _check_field(spec, get_field(cfg, spec.dest)))]
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
