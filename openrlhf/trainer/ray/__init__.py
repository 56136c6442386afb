"""Ray mode: policy / reference / critic / reward groups and rollout engines as Ray actors.

`launcher.run_ray(cfg)` is the entry (`openrlhf.cli.train_ppo_ray` calls it when
--vllm.num_engines is set outside a distributed launcher). See docs/ray.md.
"""

import os

from .errors import EngineDiedError, RayActorDiedError

__all__ = ["EngineDiedError", "RayActorDiedError", "run_ray", "use_ray_mode"]


def use_ray_mode(cfg, environ=os.environ) -> bool:
    """Ray mode: engines asked for (--vllm.num_engines) and no distributed launcher around us."""
    return cfg.vllm.num_engines is not None and not any(k in environ for k in ("WORLD_SIZE", "LOCAL_RANK", "RANK"))


def run_ray(cfg, *, evaluate: bool = True) -> dict:
    from .launcher import run_ray as _run

    return _run(cfg, evaluate=evaluate)
