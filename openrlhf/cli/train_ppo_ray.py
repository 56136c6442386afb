"""Entry point: PPO/GRPO training with an OpenRLHF-style CLI.

SPMD / hybrid engine (each rank: DeepSpeed actor shard + reference + colocated rollout engine):
    deepspeed openrlhf/cli/train_ppo_ray.py --fp8_unified ...
    torchrun --nproc_per_node 2 -m openrlhf.cli.train_ppo_ray --fp8_unified ...
    python -m openrlhf.cli.train_ppo_ray --fp8_unified ...          (one process)

Ray (actor/reference/critic/reward groups and vLLM engines as Ray actors; docs/ray.md):
    ray job submit --address=http://HEAD:8265 -- python3 -m openrlhf.cli.train_ppo_ray --vllm.num_engines 2 ...
    python -m openrlhf.cli.train_ppo_ray --vllm.num_engines 1 ...   (joins `ray start`'s cluster, or starts a local one)

The rule: Ray mode when --vllm.num_engines is set and no distributed launcher started this
process (none of WORLD_SIZE, LOCAL_RANK, RANK in the environment); otherwise SPMD.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a file by the deepspeed launcher: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from openrlhf.cli.config import ConfigError, PPOConfig, parse_config  # noqa: E402

__all__ = ["main", "train", "make_engine_factory", "make_strategy", "use_ray_mode"]

logger = logging.getLogger("openrlhf")


def make_engine_factory(cfg: PPOConfig, strategy):
    """The colocated rollout engine for this rank: vLLM when asked for (or available under auto), else transformers."""
    from openrlhf.trainer.engines.hf_engine import HFEngine

    def vllm_available() -> bool:
        try:
            import vllm  # noqa: F401

            from openrlhf.trainer.engines import vllm_engine  # noqa: F401
        except ImportError:
            return False
        return True

    choice = cfg.rollout.engine
    if choice == "auto":
        choice = "vllm" if vllm_available() else "hf"

    def factory(recipe):
        if choice == "vllm":
            from openrlhf.trainer.engines.vllm_engine import VLLMEngine

            return VLLMEngine.from_config(cfg, recipe, rank=strategy.rank)
        return HFEngine(cfg.actor.model_name_or_path, recipe, dtype=strategy.dtype, device=strategy.device, attn_implementation=cfg.ds.attn_implementation)

    return factory


def use_ray_mode(cfg: PPOConfig, environ=os.environ) -> bool:
    """Ray mode: engines asked for (--vllm.num_engines) and no distributed launcher around us."""
    return cfg.vllm.num_engines is not None and not any(k in environ for k in ("WORLD_SIZE", "LOCAL_RANK", "RANK"))


def make_strategy(cfg: PPOConfig):
    from openrlhf.utils.deepspeed import DeepspeedStrategy, StrategyConfig

    return DeepspeedStrategy(
        StrategyConfig(
            zero_stage=cfg.ds.zero_stage, param_dtype=cfg.ds.param_dtype, adam_offload=cfg.ds.adam_offload,
            micro_batch_size=cfg.train.micro_batch_size, train_batch_size=cfg.train.batch_size, max_norm=cfg.actor.max_norm,
            seed=cfg.train.seed, gradient_checkpointing=cfg.actor.gradient_checkpointing_enable, overlap_comm=cfg.ds.overlap_comm,
            grad_accum_dtype=cfg.ds.grad_accum_dtype, offload_params=cfg.ref.offload,
        )
    )


def train(cfg: PPOConfig, *, evaluate: bool = True, engine_factory=None, **trainer_kwargs) -> dict:
    """Run a whole training job on this rank; returns the run summary (rank 0 has it all).

    SPMD ranks call it as is; in Ray mode each policy actor calls it with the Ray engine proxy
    and remote ref/critic/reward (`openrlhf.trainer.ray.policy_actor`): the same loop either way.
    """
    from openrlhf.trainer.ppo_trainer import PPOTrainer
    from openrlhf.utils.logging_utils import setup_logging

    strategy = make_strategy(cfg)
    strategy.setup_distributed()
    setup_logging(strategy.rank)
    for w in cfg.cfg_warnings:
        logger.warning(w)
    trainer = PPOTrainer(cfg, strategy, engine_factory or make_engine_factory(cfg, strategy), **trainer_kwargs)
    trainer.setup()
    evaluate = evaluate and cfg.train.eval_prompts > 0
    eval_kw = {"n_prompts": cfg.train.eval_prompts, "n_samples": cfg.train.eval_samples}
    eval_before = trainer.evaluate(**eval_kw) if evaluate else None
    history = trainer.fit()
    eval_after = trainer.evaluate(**eval_kw) if evaluate else None
    if cfg.ckpt.save_steps != 0 and (not history or cfg.ckpt.save_steps < 0 or trainer.global_step % cfg.ckpt.save_steps):
        trainer.save_checkpoint()
    summary = {
        "recipe": trainer.recipe.name,
        "engine": trainer.engine.name,
        "world_size": strategy.world_size,
        "steps": trainer.global_step,
        "eval_reward_before": eval_before,
        "eval_reward_after": eval_after,
        "first_step": history[0].metrics if history else {},
        "last_step": history[-1].metrics if history else {},
        "tensorboard_dir": cfg.logger.tensorboard_dir,
        "checkpoint_dir": cfg.ckpt_path,
        "precision_report": trainer.precision_report,
    }
    if strategy.is_rank_0:
        out = Path(cfg.ckpt.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({k: v for k, v in summary.items()}, indent=1, default=str))
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s.step, **s.metrics}) + "\n" for s in history))
    trainer.close()
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from jetrl_precision import BackendUnavailable, RecipeError
    from openrlhf.trainer.ppo_trainer import PrecisionCheckError, WeightSyncError
    from openrlhf.trainer.ray.errors import RayActorDiedError, RayActorStartError

    try:
        if use_ray_mode(cfg):
            from openrlhf.trainer.ray.launcher import run_ray

            run_ray(cfg)
        else:
            if cfg.vllm.num_engines is not None:
                logger.warning("--vllm.num_engines is ignored under a distributed launcher: SPMD mode, one engine per rank")
            train(cfg)
    except (
        FileNotFoundError, KeyError, RecipeError, BackendUnavailable, PrecisionCheckError, WeightSyncError, ConfigError, RayActorDiedError,
        RayActorStartError,
    ) as e:
        # Problems with the user's inputs or setup: one clear message, no traceback.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
