"""One rank's whole training job, shared by both launch modes.

SPMD ranks (`deepspeed`, torchrun, plain python) call `train(cfg)` from the CLI; in Ray mode each
policy actor calls it with the Ray engine proxy and remote reference/critic/reward
(`openrlhf.trainer.ray.policy_actor`): the same loop either way.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

from jetrl_precision import PrecisionRecipe
from openrlhf.config import PPOConfig
from openrlhf.utils.deepspeed import DeepspeedStrategy, StrategyConfig

from .engines.base import RolloutEngine
from .engines.factory import build_engine, engine_kind

__all__ = ["train", "make_strategy", "make_engine_factory"]

logger = logging.getLogger("openrlhf")


def make_engine_factory(cfg: PPOConfig, strategy: DeepspeedStrategy) -> Callable[[PrecisionRecipe], RolloutEngine]:
    """The colocated rollout engine for this rank: vLLM when asked for (or available under auto), else transformers."""
    kind = engine_kind(cfg.rollout.engine, cfg.precision.bitwise)

    def factory(recipe: PrecisionRecipe) -> RolloutEngine:
        return build_engine(cfg, kind, recipe, rank=strategy.rank, dtype=strategy.dtype, device=strategy.device)

    return factory


def make_strategy(cfg: PPOConfig) -> DeepspeedStrategy:
    return DeepspeedStrategy(
        StrategyConfig(
            zero_stage=cfg.ds.zero_stage, param_dtype=cfg.ds.param_dtype, adam_offload=cfg.ds.adam_offload,
            micro_batch_size=cfg.train.micro_batch_size, train_batch_size=cfg.train.batch_size, max_norm=cfg.actor.max_norm,
            seed=cfg.train.seed, gradient_checkpointing=cfg.actor.gradient_checkpointing_enable, overlap_comm=cfg.ds.overlap_comm,
            grad_accum_dtype=cfg.ds.grad_accum_dtype, offload_params=cfg.ref.offload, zpg=cfg.ds.zpg,
            load_universal=cfg.ds.use_universal_ckpt,
        )
    )


def train(cfg: PPOConfig, *, evaluate: bool = True, engine_factory=None, **trainer_kwargs) -> dict:
    """Run a whole training job on this rank; returns the run summary (rank 0 has it all)."""
    from openrlhf.utils.logging_utils import setup_logging

    from .ppo_trainer import PPOTrainer

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
    trainer.save_model()
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
        "model_dir": cfg.ckpt.output_dir,
        "precision_report": trainer.precision_report,
    }
    if strategy.is_rank_0:
        out = Path(cfg.ckpt.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({k: v for k, v in summary.items()}, indent=1, default=str))
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s.step, **s.metrics}) + "\n" for s in history))
    trainer.close()
    return summary
