"""Reference, critic and reward models as Ray actors, and the callables policy ranks use for them.

Policy rank r talks to reference/reward actor r mod M (each holds a whole copy of its model)
and to critic rank r. The critic group trains with its own DeepSpeed world; since every
critic rank is driven by its paired policy rank, critic ranks run their collectives in the
same order, and the critic step is the SPMD trainer's `critic_micro_step` itself, run where
the critic lives.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from .errors import RayActorDiedError
from .utils import call, device_info, free_port, node_ip, pin_assigned_gpus

__all__ = ["RefActor", "RewardActor", "CriticActor", "RemoteRef", "RemoteReward", "RemoteCritic"]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _dtype(cfg) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.ds.param_dtype]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


# ---- reference ------------------------------------------------------------------------------------
class RefActor:
    """The reference policy in the training forward's precision (as in SPMD mode), inference only."""

    def __init__(self, cfg, actor_id: str) -> None:
        from jetrl_precision import convert_to_fp8, freeze_fp8_weights
        from openrlhf.models.actor import Actor, load_causal_lm

        pin_assigned_gpus()
        self.actor_id = actor_id
        model = load_causal_lm(cfg.ref_model_path, _dtype(cfg), cfg.ds.attn_implementation)
        convert_to_fp8(model, cfg.precision.load_recipe(policy=False), side="train",
                       cache_weights=not cfg.precision.requantize_weights, fuse_projections=not cfg.precision.separate_projections,
                       fuse_rmsnorm=not cfg.precision.plain_norms)
        if cfg.ds.use_liger_kernel:
            from openrlhf.models.liger import apply_liger_kernels

            apply_liger_kernels(model)
        self.model = Actor(model).requires_grad_(False).eval().to(_device())
        freeze_fp8_weights(self.model)  # never trained: its FP8 layers keep their FP8 weights only

    def info(self) -> dict[str, Any]:
        return {"actor_id": self.actor_id, **device_info()}

    @torch.no_grad()
    def forward(self, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int, temperature: float = 1.0) -> torch.Tensor:
        dev = _device()
        return self.model(sequences.to(dev), attention_mask.to(dev), num_actions, temperature=temperature).float().cpu()


class RemoteRef:
    """`ref(sequences, attention_mask, num_actions, temperature=)` on a reference actor."""

    def __init__(self, actors: Sequence[Any], ids: Sequence[str], timeout_s: float) -> None:
        self.actors, self.ids, self.timeout_s = list(actors), list(ids), timeout_s

    def __call__(self, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int, temperature: float = 1.0) -> torch.Tensor:
        i = _rank() % len(self.actors)
        ref = self.actors[i].forward.remote(sequences.cpu(), attention_mask.cpu(), num_actions, temperature)
        return call(ref, self.ids[i], "reference forward", RayActorDiedError, self.timeout_s).to(sequences.device)


# ---- reward model ---------------------------------------------------------------------------------
class RewardActor:
    """A reward model (or any configured reward) scoring prompt + response text."""

    def __init__(self, cfg, actor_id: str) -> None:
        from openrlhf.trainer.reward import build_reward_fn

        pin_assigned_gpus()
        self.actor_id = actor_id
        self.fn = build_reward_fn(
            cfg.reward_source, remote_url=cfg.reward.remote_url, model_path=cfg.reward.model_name_or_path,
            clip_range=cfg.reward.clip_range, dtype=_dtype(cfg), device=_device(), offload=cfg.reward.offload, value_head_prefix=cfg.ds.value_head_prefix,
        )

    def info(self) -> dict[str, Any]:
        return {"actor_id": self.actor_id, **device_info()}

    def score(self, prompts: list[str], responses: list[str], labels: list[str | None]) -> list[float]:
        return self.fn(prompts, responses, labels)


class RemoteReward:
    def __init__(self, actors: Sequence[Any], ids: Sequence[str], timeout_s: float) -> None:
        self.actors, self.ids, self.timeout_s = list(actors), list(ids), timeout_s

    def __call__(self, prompts: list[str], responses: list[str], labels: list[str | None]) -> list[float]:
        i = _rank() % len(self.actors)
        ref = self.actors[i].score.remote(list(prompts), list(responses), list(labels))
        return call(ref, self.ids[i], "reward scoring", RayActorDiedError, self.timeout_s)


# ---- critic ---------------------------------------------------------------------------------------
class CriticActor:
    """One rank of the critic's DeepSpeed group (its own world, paired with policy rank `rank`)."""

    def __init__(self, cfg, actor_id: str, rank: int, world_size: int, local_rank: int) -> None:
        pin_assigned_gpus()
        self.cfg, self.actor_id = cfg, actor_id
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank

    def info(self) -> dict[str, Any]:
        return {"actor_id": self.actor_id, **device_info()}

    def address(self) -> tuple[str, int]:
        ip = node_ip()
        return ip, free_port(ip)

    def setup(self, master_addr: str, master_port: int, total_updates: int) -> None:
        from jetrl_precision import Fp8Converter
        from openrlhf.models.loss import ValueLoss
        from openrlhf.trainer.ppo_trainer import prepare_critic
        from openrlhf.trainer.run import make_strategy

        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
        )
        cfg = self.cfg
        self.strategy = make_strategy(cfg)
        self.strategy.setup_distributed()
        self.converter = Fp8Converter(cfg.precision.load_recipe(policy=False), side="train",
                                      cache_weights=not cfg.precision.requantize_weights,
                                      fuse_projections=not cfg.precision.separate_projections,
                                      fuse_rmsnorm=not cfg.precision.plain_norms)
        # The SPMD trainer's critic (optimizer, schedule, clipping norm), for the same number of updates.
        self.critic_engine = prepare_critic(cfg, self.strategy, self.converter, total_updates)
        self.value_loss = ValueLoss(cfg.critic.value_clip)

    @torch.no_grad()
    def forward(self, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int) -> torch.Tensor:
        dev = self.strategy.device
        return self.critic_engine(sequences.to(dev), attention_mask.to(dev), num_actions).float().cpu()

    def train_micro_step(self, mb, global_tokens: float, scale: float) -> dict[str, float]:
        from openrlhf.trainer.ppo_trainer import critic_micro_step

        # The SPMD code path itself, run where the critic lives; its statistics cross the process boundary as floats.
        stats = critic_micro_step(self.critic_engine, self.value_loss, self.converter, mb.to(self.strategy.device), global_tokens, scale)
        return {k: float(v) for k, v in stats.items()}

    def nonfinite_parameters(self) -> list[str]:
        """The critic's NaN/inf parameters, agreed over the critic group (every critic rank must be asked at once)."""
        from openrlhf.trainer.health import nonfinite_parameters

        return nonfinite_parameters(self.critic_engine.module, self.strategy.all_reduce)

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool = True) -> Any:
        return self.critic_engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest)

    def save_value_network(self, out_dir: str) -> None:
        from openrlhf.trainer.ppo_trainer import save_critic

        save_critic(self.cfg, self.strategy, self.critic_engine, out_dir)

    def load_checkpoint(
        self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True
    ) -> Any:
        return self.critic_engine.load_checkpoint(
            load_dir, tag=tag, load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states
        )


class RemoteCritic:
    """The critic as `PPOTrainer` uses it (see its constructor), on critic rank = policy rank."""

    def __init__(self, actors: Sequence[Any], ids: Sequence[str], master: tuple[str, int], timeout_s: float) -> None:
        self.actors, self.ids, self.master, self.timeout_s = list(actors), list(ids), master, timeout_s

    def _call(self, ref, during: str):
        return call(ref, self.ids[_rank()], during, RayActorDiedError, self.timeout_s)

    @property
    def _actor(self):
        return self.actors[_rank()]

    def setup(self, total_updates: int) -> None:
        self._call(self._actor.setup.remote(*self.master, total_updates), "critic set-up")

    def __call__(self, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int) -> torch.Tensor:
        out = self._call(self._actor.forward.remote(sequences.cpu(), attention_mask.cpu(), num_actions), "critic forward")
        return out.to(sequences.device)

    def train_micro_step(self, mb, global_tokens: float, scale: float) -> dict[str, float]:
        return self._call(self._actor.train_micro_step.remote(mb.to(torch.device("cpu")), global_tokens, scale), "critic training")

    def train(self) -> "RemoteCritic":
        return self

    def eval(self) -> "RemoteCritic":
        return self

    def nonfinite_parameters(self) -> list[str]:
        return self._call(self._actor.nonfinite_parameters.remote(), "critic parameter check")

    def save_value_network(self, out_dir: str) -> None:
        """--critic.save_value_network: each policy rank drives its critic rank (ZeRO-3 gathers); critic rank 0 writes."""
        self._call(self._actor.save_value_network.remote(out_dir), "critic export")

    # DeepSpeed engine signatures, so DeepspeedStrategy.save/load_checkpoint work unchanged
    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict | None = None, save_latest: bool = True) -> Any:
        return self._call(self._actor.save_checkpoint.remote(save_dir, tag, client_state or {}, save_latest), "critic checkpoint save")

    def load_checkpoint(
        self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True
    ) -> Any:
        ref = self._actor.load_checkpoint.remote(load_dir, tag, load_optimizer_states, load_lr_scheduler_states)
        return self._call(ref, "critic checkpoint load")
