"""Entry point: PPO/GRPO training with an OpenRLHF-style CLI (parsing and the launch-mode choice only;
the run itself is `openrlhf.trainer.run.train`, or `openrlhf.trainer.ray.run_ray` in Ray mode).

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

import logging
import os
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a file by the deepspeed launcher: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from openrlhf.config import ConfigError, parse_config  # noqa: E402
from openrlhf.trainer.ray import use_ray_mode  # noqa: E402
from openrlhf.utils.process import exit_after_run  # noqa: E402

__all__ = ["main"]

logger = logging.getLogger("openrlhf")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from openrlhf.trainer.preflight import engine_errors, path_errors, preflight_errors

    # Refusals before anything loads: what this machine or framework cannot run, then paths (a missing
    # model or an unwritable output folder is found now, not after the run; only the rank that writes,
    # rank 0 or the Ray driver, probes the folders), then an engine that could not match the trainer.
    refused = (
        preflight_errors(cfg)
        or path_errors(cfg, write_probes=int(os.environ.get("RANK", "0")) == 0)
        or engine_errors(cfg, ray=use_ray_mode(cfg))
    )
    if refused:
        print("\n".join(f"error: {e}" for e in refused), file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from jetrl_precision import BackendUnavailable, RecipeError
    from jetrl_precision.batch_invariant import BitwiseUnavailable
    from openrlhf.datasets.prompts_dataset import PromptDataError
    from openrlhf.rewards.remote import RewardFunctionError, RewardServerError
    from openrlhf.trainer.health import TrainingDivergedError
    from openrlhf.trainer.ppo_trainer import MismatchError, PrecisionCheckError, WeightSyncError
    from openrlhf.trainer.ray.errors import RayActorDiedError, RayActorStartError
    from openrlhf.utils.deepspeed.checkpoint import CheckpointError

    try:
        if use_ray_mode(cfg):
            from openrlhf.trainer.ray.launcher import run_ray

            run_ray(cfg)
        else:
            from openrlhf.trainer.run import train

            if cfg.vllm.num_engines is not None:
                logger.warning("--vllm.num_engines is ignored under a distributed launcher: SPMD mode, one engine per rank")
            train(cfg)
    except (
        FileNotFoundError, KeyError, RecipeError, BackendUnavailable, BitwiseUnavailable, PrecisionCheckError, WeightSyncError, MismatchError,
        ConfigError, RayActorDiedError, RayActorStartError, PromptDataError, CheckpointError, TrainingDivergedError,
        RewardFunctionError, RewardServerError,
    ) as e:
        # Problems with the user's inputs, setup or data, and a run that diverged: one clear message, no traceback.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_after_run(main())
