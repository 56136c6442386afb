"""One policy (actor-model) rank as a Ray actor, running the SPMD trainer core unchanged.

The actor sets the launcher environment a `deepspeed`/torchrun rank would have (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and calls `openrlhf.trainer.run.train`
with three substitutions: the rollout engine is the `RemoteEngine` proxy to the engine actors,
and the reference / critic / reward model (when the run has them) are the remote callables of
`model_actors`. Everything else — data sharding, experience, losses, ZeRO, FP8 weight sync,
digest and precision checks, checkpoints, logging on rank 0 — is the same code as SPMD mode.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .engine_actor import EngineHandles, RemoteEngine
from .utils import device_info, free_port, node_ip, pin_assigned_gpus

__all__ = ["PolicyActor", "RoleHandles"]


@dataclasses.dataclass(frozen=True)
class RoleHandles:
    """Actor handles of the other roles, handed to every policy rank."""

    engines: EngineHandles
    refs: tuple[Any, ...] = ()
    ref_ids: tuple[str, ...] = ()
    critics: tuple[Any, ...] = ()
    critic_ids: tuple[str, ...] = ()
    critic_master: tuple[str, int] | None = None
    rewards: tuple[Any, ...] = ()
    reward_ids: tuple[str, ...] = ()
    timeout_s: float = 1800.0


class PolicyActor:
    def __init__(self, cfg, rank: int, world_size: int, local_rank: int) -> None:
        pin_assigned_gpus()  # this rank's GPU is cuda:0 (LOCAL_RANK 0 on GPU clusters)
        self.cfg, self.rank, self.world_size, self.local_rank = cfg, rank, world_size, local_rank

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, **device_info()}

    def address(self, exclude: tuple[int, ...] = ()) -> tuple[str, int]:
        """Rank 0: where the policy group's process group rendezvous (this node, a free port other than `exclude`)."""
        ip = node_ip()
        return ip, free_port(ip, exclude)

    def run(self, master_addr: str, master_port: int, roles: RoleHandles, evaluate: bool = True) -> dict:
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
        )
        from openrlhf.trainer.run import train

        from .model_actors import RemoteCritic, RemoteRef, RemoteReward

        kwargs: dict[str, Any] = {}
        if roles.refs:
            kwargs["ref"] = RemoteRef(roles.refs, roles.ref_ids, roles.timeout_s)
        if roles.critics:
            kwargs["critic"] = RemoteCritic(roles.critics, roles.critic_ids, roles.critic_master, roles.timeout_s)
        if roles.rewards:
            kwargs["reward_fn"] = RemoteReward(roles.rewards, roles.reward_ids, roles.timeout_s)
        return train(self.cfg, evaluate=evaluate, engine_factory=lambda recipe: RemoteEngine(roles.engines), **kwargs)
