"""Ray mode: policy / reference / critic / reward groups and rollout engines as Ray actors.

`launcher.run_ray(cfg)` is the entry (`openrlhf.cli.train_ppo_ray` calls it when
--vllm.num_engines is set outside a distributed launcher). See docs/ray.md.
"""

from .errors import EngineDiedError, RayActorDiedError

__all__ = ["EngineDiedError", "RayActorDiedError", "run_ray"]


def run_ray(cfg, *, evaluate: bool = True) -> dict:
    from .launcher import run_ray as _run

    return _run(cfg, evaluate=evaluate)
