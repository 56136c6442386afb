"""Ray mode's driver: placement groups, actor groups, and the run.

Roles and their Ray actors (each role's size is --<role>.num_nodes x --<role>.num_gpus_per_node):
  policy   `PolicyActor` ranks, one DeepSpeed world (ZeRO-2/3), the trainer core on every rank
  ref      `RefActor` (when the KL term needs a reference), a whole model each
  critic   `CriticActor` ranks (gae), their own DeepSpeed world, rank r paired with policy rank r
  reward   `RewardActor` (with --reward.model_name_or_path; rule/remote rewards run in the policy ranks)
  engines  `EngineActor` x --vllm.num_engines, each --vllm.tensor_parallel_size devices

Placement: one placement group per role, one bundle per device, PACK. On GPU clusters a bundle
is {"GPU": 1, "CPU": 1}; on CPU-only clusters it is a fraction of a CPU sized so that every
bundle fits. Colocation puts roles in the same bundles, each taking a share of it:
--train.colocate_actor_ref (policy + ref), --train.colocate_critic_reward (critic + reward),
--train.colocate_all (everything, engines included: the hybrid engine).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from openrlhf.config import ConfigError

from ..engines.factory import engine_kind
from .engine_actor import EngineActor, EngineHandles
from .errors import EngineDiedError, RayActorDiedError
from .model_actors import CriticActor, RefActor, RewardActor
from .policy_actor import PolicyActor, RoleHandles
from .utils import actor_env, call, init_ray, on_gpu_cluster

__all__ = ["run_ray", "RayLayout", "RayActorGroup", "plan_layout", "check_gpu_fit", "choose_sync_backend"]

logger = logging.getLogger(__name__)


# ---- layout ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Slot:
    group: str  # placement group name
    bundle: int
    share: float  # fraction of the bundle's resources this actor asks for


@dataclasses.dataclass(frozen=True)
class RayLayout:
    """Where every actor of the run goes. Pure data: `plan_layout` builds it from the config."""

    groups: dict[str, int]  # placement group -> number of bundles
    slots: dict[str, tuple[Slot, ...]]  # role -> one slot per actor (engines: one per engine, its first bundle)
    tensor_parallel_size: int = 1

    def world(self, role: str) -> int:
        return len(self.slots.get(role, ()))

    @property
    def devices(self) -> int:
        """GPUs the layout takes on a GPU cluster: one per bundle."""
        return sum(self.groups.values())


_GROUP_FLAGS = {
    "policy": "--actor.num_nodes x --actor.num_gpus_per_node",
    "engines": "--vllm.num_engines x --vllm.tensor_parallel_size",
    "ref": "--ref.num_nodes x --ref.num_gpus_per_node (only when the KL term needs a reference: --algo.kl.init_coef 0 "
           "without --algo.kl.use_loss drops it; --train.colocate_actor_ref shares the policy's GPUs)",
    "critic": "--critic.num_nodes x --critic.num_gpus_per_node",
    "reward": "--reward.num_nodes x --reward.num_gpus_per_node (--train.colocate_critic_reward shares the critic's)",
}


def check_gpu_fit(layout: RayLayout, cluster_gpus: float) -> None:
    """ConfigError before anything is placed when the layout needs more GPUs than the cluster has
    (placing it would otherwise wait for GPUs that never come)."""
    if layout.devices <= cluster_gpus:
        return
    parts = "\n".join(f"  - {g}: {n} GPU(s), {_GROUP_FLAGS.get(g, g)}" for g, n in layout.groups.items())
    raise ConfigError(
        f"this Ray layout needs {layout.devices} GPUs and the cluster has {cluster_gpus:g}:\n{parts}\n"
        "Lower a group's size, colocate groups (--train.colocate_all, --train.colocate_actor_ref), or add nodes."
    )


def _size(cfg_section) -> int:
    return cfg_section.num_nodes * cfg_section.num_gpus_per_node


def plan_layout(cfg) -> RayLayout:
    """Placement groups and slots for the roles this run needs; ConfigError for impossible layouts."""
    t = cfg.train
    n_policy = _size(cfg.actor)
    n_engines, tp = cfg.vllm.num_engines or 0, cfg.vllm.tensor_parallel_size
    roles: dict[str, int] = {"policy": n_policy, "engines": n_engines}
    if cfg.needs_ref:
        roles["ref"] = _size(cfg.ref)
    if cfg.needs_critic:
        roles["critic"] = _size(cfg.critic)
    if cfg.reward_source == "model":
        roles["reward"] = _size(cfg.reward)
    if n_engines < 1:
        raise ConfigError("Ray mode needs --vllm.num_engines >= 1 (the rollout engines are Ray actors)")
    errors = []
    if "critic" in roles and roles["critic"] != n_policy:
        errors.append(
            f"critic rank r is driven by policy rank r: --critic.num_nodes x --critic.num_gpus_per_node = {roles['critic']} "
            f"must equal the actor's {n_policy}"
        )
    # which group each role lives in
    home = {"policy": "policy"}
    if t.colocate_all:
        for role, n in roles.items():
            want = n * tp if role == "engines" else n
            if want != n_policy:
                flag = "--vllm.num_engines x --vllm.tensor_parallel_size" if role == "engines" else f"--{role if role != 'policy' else 'actor'}.num_nodes x num_gpus_per_node"
                errors.append(f"--train.colocate_all shares every device: {flag} = {want} must equal the actor's {n_policy}")
            home[role] = "policy"
    else:
        if "ref" in roles:
            if t.colocate_actor_ref and roles["ref"] != n_policy:
                errors.append(f"--train.colocate_actor_ref: the reference group ({roles['ref']}) must match the actor group ({n_policy})")
            home["ref"] = "policy" if t.colocate_actor_ref else "ref"
        if "critic" in roles:
            home["critic"] = "critic"
        if "reward" in roles:
            if t.colocate_critic_reward and "critic" in roles:
                if roles["reward"] != roles["critic"]:
                    errors.append(f"--train.colocate_critic_reward: the reward group ({roles['reward']}) must match the critic group ({roles['critic']})")
                home["reward"] = "critic"
            else:
                home["reward"] = "reward"
        home["engines"] = "engines"
    if errors:
        raise ConfigError(errors[0] if len(errors) == 1 else "Ray layout errors:\n" + "\n".join(f"  - {e}" for e in errors))

    groups: dict[str, int] = {}
    for role, n in roles.items():
        g = home[role]
        groups[g] = max(groups.get(g, 0), n * tp if role == "engines" else n)
    # how many actors share each bundle -> each takes that share
    users: dict[tuple[str, int], int] = defaultdict(int)
    first_bundles: dict[str, list[int]] = {}
    for role, n in roles.items():
        step = tp if role == "engines" else 1
        first_bundles[role] = [i * step for i in range(n)]
        for b in first_bundles[role]:
            users[(home[role], b)] += 1
    slots = {
        role: tuple(Slot(home[role], b, 1.0 / users[(home[role], b)]) for b in first_bundles[role]) for role in roles
    }
    return RayLayout(groups, slots, tp)


# ---- actor groups ---------------------------------------------------------------------------------
class RayActorGroup:
    """The actors of one role, with their ids (used in every error message)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.actors: list[Any] = []
        self.ids: list[str] = []

    def add(self, actor_id: str, handle: Any) -> None:
        self.ids.append(actor_id)
        self.actors.append(handle)

    def call_all(self, method: str, *args: Any, during: str, timeout: float | None = None) -> list:
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        err = EngineDiedError if self.role == "engines" else RayActorDiedError
        return call(refs, self.ids, during, err, timeout)


def choose_sync_backend(cfg, on_gpu: bool) -> str:
    """--vllm.sync_backend resolved for this cluster. gloo on CPU; NCCL on GPU unless the engines share the policy ranks'
    GPUs (--train.colocate_all): NCCL refuses two ranks of one communicator on the same device, so those sync over
    CUDA IPC (`ipc`: each engine worker maps the bucket its GPU's policy rank packed; no host copy), or, asked for,
    gloo (every byte through host memory)."""
    chosen = cfg.vllm.sync_backend
    shared = on_gpu and cfg.train.colocate_all
    if chosen == "auto":
        chosen = "ipc" if shared else "nccl" if on_gpu else "gloo"
        if shared:
            logger.info("weight sync over CUDA IPC: with --train.colocate_all every engine shares a policy rank's GPU "
                        "(--vllm.sync_backend gloo sends the bytes through host memory instead)")
    elif chosen == "nccl" and shared:
        raise ConfigError(
            "--vllm.sync_backend nccl with --train.colocate_all: engine 0 shares policy rank 0's GPU and NCCL "
            "refuses two ranks on one device; use --vllm.sync_backend ipc or gloo (or auto)"
        )
    elif chosen == "nccl" and not on_gpu:
        raise ConfigError("--vllm.sync_backend nccl needs GPUs; this Ray cluster has none (use gloo or auto)")
    elif chosen == "ipc" and not shared:
        raise ConfigError(
            "--vllm.sync_backend ipc maps the trainer's GPU memory in the engines, so it needs GPUs and "
            f"--train.colocate_all (this run: {'GPUs' if on_gpu else 'no GPUs'}, --train.colocate_all "
            f"{'on' if cfg.train.colocate_all else 'off'}); use auto"
        )
    return chosen


class _Launcher:
    def __init__(self, cfg) -> None:
        import ray

        self.ray = ray
        self.cfg = cfg
        self.layout = plan_layout(cfg)
        self.on_gpu = on_gpu_cluster()
        self.kind = engine_kind(cfg.rollout.engine, cfg.precision.bitwise, cuda=self.on_gpu)  # where the engines run
        self.env = actor_env(self.on_gpu)
        self.tag = uuid.uuid4().hex[:6]
        self.pgs: dict[str, Any] = {}
        self.groups: dict[str, RayActorGroup] = {}
        self.timeout_s = 1800.0
        self.placement: dict[str, list[dict]] = {}  # role -> each actor's info() (node, GPU ids)

    # -- placement groups
    def _bundle_cpu(self) -> float:
        if self.on_gpu:
            return 1.0
        total = sum(self.layout.groups.values())
        cpus = self.ray.cluster_resources().get("CPU", 1.0)
        # CPU-only: fractional bundles so that the whole layout fits on the cluster's cores
        return max(0.01, min(1.0, math.floor(0.9 * cpus / total * 100) / 100))

    def create_placement_groups(self) -> None:
        from ray.util.placement_group import placement_group

        if self.on_gpu:
            check_gpu_fit(self.layout, self.ray.cluster_resources().get("GPU", 0.0))
        cpu = self._bundle_cpu()
        for name, n in self.layout.groups.items():
            bundle = {"GPU": 1.0, "CPU": cpu} if self.on_gpu else {"CPU": cpu}
            self.pgs[name] = placement_group([dict(bundle) for _ in range(n)], strategy="PACK", name=f"jetrl-{self.tag}-{name}")
        t0 = time.perf_counter()
        pending = {name: pg.ready() for name, pg in self.pgs.items()}
        for name, ref in pending.items():
            try:
                self.ray.get(ref, timeout=600)
            except self.ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"placement group {name!r} ({self.layout.groups[name]} bundles of {bundle}) could not be placed within "
                    f"600 s: the cluster has {self.ray.cluster_resources()}; lower --<role>.num_gpus_per_node / "
                    "--vllm.num_engines or add nodes"
                ) from None
        self.bundle_cpu = cpu
        logger.info("placement groups ready in %.1f s: %s (bundle CPU %.2f)", time.perf_counter() - t0, self.layout.groups, cpu)

    def _options(self, slot, *, gpu: bool = True, env_extra: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts: dict[str, Any] = dict(
            num_cpus=round(self.bundle_cpu * slot.share, 4),
            num_gpus=round(slot.share, 4) if (self.on_gpu and gpu) else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pgs[slot.group], placement_group_bundle_index=slot.bundle, placement_group_capture_child_tasks=True
            ),
            runtime_env={"env_vars": {**self.env, **(env_extra or {})}},
        )
        opts.update(kw)
        return opts

    def _local_ranks(self, slots) -> list[int]:
        """On GPU Ray isolates each actor's device (LOCAL_RANK 0); on CPU the index among this role's
        ranks placed on the same node (from the placement group's bundle -> node map)."""
        if self.on_gpu:
            return [0] * len(slots)
        from ray.util.placement_group import placement_group_table

        seen: dict[str, int] = defaultdict(int)
        out = []
        for slot in slots:
            node = placement_group_table(self.pgs[slot.group]).get("bundles_to_node_id", {}).get(slot.bundle, "?")
            out.append(seen[node])
            seen[node] += 1
        return out

    # -- actors
    def create_engines(self) -> RayActorGroup:
        g = RayActorGroup("engines")
        tp = self.layout.tensor_parallel_size
        remote = self.ray.remote(EngineActor)
        for i, slot in enumerate(self.layout.slots["engines"]):
            eid = f"{self.kind}-engine-{i}"
            extra = {}
            gpu = True
            if tp > 1 and self.on_gpu:  # vLLM's Ray executor places the TP workers in this engine's bundles
                extra = {"VLLM_RAY_BUNDLE_INDICES": ",".join(str(slot.bundle + k) for k in range(tp)), "VLLM_RAY_PER_WORKER_GPUS": str(slot.share)}
                gpu = False
            opts = self._options(slot, gpu=gpu, env_extra=extra, name=f"jetrl-{self.tag}-{eid}", max_concurrency=2, max_restarts=0)
            g.add(eid, remote.options(**opts).remote(self.cfg, eid, i, self.kind))
        self.groups["engines"] = g
        return g

    def create_simple(self, role: str, cls: type, make_id) -> RayActorGroup:
        g = RayActorGroup(role)
        remote = self.ray.remote(cls)
        for i, slot in enumerate(self.layout.slots[role]):
            aid = make_id(i)
            g.add(aid, remote.options(**self._options(slot, name=f"jetrl-{self.tag}-{aid}")).remote(self.cfg, aid))
        self.groups[role] = g
        return g

    def create_ranked(self, role: str, cls: type, with_id: bool) -> RayActorGroup:
        """A DeepSpeed world (policy or critic), one actor per rank."""
        g = RayActorGroup(role)
        remote = self.ray.remote(cls)
        slots = self.layout.slots[role]
        for i, (slot, lr) in enumerate(zip(slots, self._local_ranks(slots))):
            aid = f"{role}-rank-{i}"
            args = (self.cfg, aid, i, len(slots), lr) if with_id else (self.cfg, i, len(slots), lr)
            g.add(aid, remote.options(**self._options(slot, name=f"jetrl-{self.tag}-{aid}")).remote(*args))
        self.groups[role] = g
        return g

    def wait_ready(self) -> None:
        for role in ("engines", "ref", "reward", "critic", "policy"):
            g = self.groups.get(role)
            if g is not None:
                t0 = time.perf_counter()
                infos = g.call_all("info", during=f"{role} start-up", timeout=self.timeout_s)
                self.placement[role] = infos
                where = ", ".join(f"{i} (GPU {','.join(x.get('gpu_ids') or ['-'])})" for i, x in zip(g.ids, infos)) if self.on_gpu else ", ".join(g.ids)
                logger.info("%s ready: %s (%.1f s)", role, where, time.perf_counter() - t0)

    def cleanup(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.groups.values():
            for a in g.actors:
                try:
                    self.ray.kill(a, no_restart=True)
                except Exception:
                    pass
        for pg in self.pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:
                pass

    def sync_backend(self) -> str:
        return choose_sync_backend(self.cfg, self.on_gpu)

    # -- the run
    def run(self, evaluate: bool) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        backend = self.sync_backend()  # refuse a bad backend before placing anything
        self.create_placement_groups()
        engines = self.create_engines()  # slowest to start: first
        if "ref" in self.layout.slots:
            self.create_simple("ref", RefActor, lambda i: f"ref-{i}")
        if "reward" in self.layout.slots:
            self.create_simple("reward", RewardActor, lambda i: f"reward-{i}")
        critic_master = None
        if "critic" in self.layout.slots:
            critics = self.create_ranked("critic", CriticActor, with_id=True)
            critic_master = call(critics.actors[0].address.remote(), critics.ids[0], "critic start-up", RayActorDiedError, self.timeout_s)
        policy = self.create_ranked("policy", PolicyActor, with_id=False)
        self.wait_ready()
        # Each group's rendezvous port is picked before any group binds its own: later picks exclude earlier ones.
        reserved = (critic_master[1],) if critic_master else ()
        master = call(policy.actors[0].address.remote(reserved), policy.ids[0], "policy start-up", RayActorDiedError, self.timeout_s)
        roles = RoleHandles(
            engines=EngineHandles(
                tuple(engines.actors), tuple(engines.ids), self.kind, self.layout.tensor_parallel_size, backend,
                enable_sleep=cfg.vllm.enable_sleep and cfg.train.colocate_all and self.on_gpu, timeout_s=self.timeout_s,
                reserved_ports=(*reserved, master[1]),
            ),
            refs=tuple(self.groups["ref"].actors) if "ref" in self.groups else (),
            ref_ids=tuple(self.groups["ref"].ids) if "ref" in self.groups else (),
            critics=tuple(self.groups["critic"].actors) if "critic" in self.groups else (),
            critic_ids=tuple(self.groups["critic"].ids) if "critic" in self.groups else (),
            critic_master=critic_master,
            rewards=tuple(self.groups["reward"].actors) if "reward" in self.groups else (),
            reward_ids=tuple(self.groups["reward"].ids) if "reward" in self.groups else (),
            timeout_s=self.timeout_s,
        )
        self._write_layout(backend)
        logger.info("Ray layout ready in %.1f s: %s; starting %d policy ranks", time.perf_counter() - t0,
                    {r: len(s) for r, s in self.layout.slots.items()}, len(policy.actors))
        futures = [a.run.remote(*master, roles, evaluate) for a in policy.actors]
        results = self._wait_policy(futures, policy.ids)
        summary = dict(results[0])
        summary.update(mode="ray", engines=list(engines.ids), layout={r: len(s) for r, s in self.layout.slots.items()},
                       sync_backend=backend, placement=self.placement)
        return summary

    def _write_layout(self, backend: str) -> None:
        """<output_dir>/ray_layout.json: the groups, the weight-sync backend and where every actor runs
        (node, GPU ids), for whoever reads the run afterwards."""
        out = Path(self.cfg.ckpt.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"groups": self.layout.groups, "roles": {r: len(s) for r, s in self.layout.slots.items()}, "on_gpu": self.on_gpu,
               "sync_backend": backend, "placement": self.placement}
        (out / "ray_layout.json").write_text(json.dumps(doc, indent=1, default=str))

    def _wait_policy(self, futures: list, ids: list[str]) -> list:
        """Wait for every rank; on the first failure, give the others a moment to fail too (an engine
        death reaches every rank that uses it), then report the most telling error: an engine's death,
        which ends the wait as soon as one rank reports it (nothing a rank reports later would be chosen
        over it; a rank blocked in a collective with a failed one would only use up the grace period)."""
        from ray.exceptions import RayActorError, RayTaskError

        ray = self.ray
        index = {f: i for i, f in enumerate(futures)}
        pending, results, errors = list(futures), {}, []
        deadline = None
        while pending:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                break  # grace period over
            f = done[0]
            try:
                results[index[f]] = ray.get(f)
            except RayTaskError as e:
                cause = getattr(e, "cause", None)
                errors.append(cause if isinstance(cause, BaseException) else e)
            except RayActorError as e:
                errors.append(RayActorDiedError(ids[index[f]], "training", e))
            if any(isinstance(e, EngineDiedError) for e in errors):
                break
            if errors and deadline is None:
                deadline = time.monotonic() + 15.0
        if errors:
            for e in errors:
                if isinstance(e, EngineDiedError):
                    raise e
            raise errors[0]
        return [results[i] for i in range(len(futures))]


def run_ray(cfg, *, evaluate: bool = True) -> dict:
    """Run `cfg` in Ray mode: join (or start) Ray, place the roles, train, clean up. Returns rank 0's summary."""
    from openrlhf.utils.logging_utils import setup_logging

    setup_logging(0)
    started = init_ray()
    launcher = None
    try:
        launcher = _Launcher(cfg)
        return launcher.run(evaluate)
    finally:
        if launcher is not None:
            launcher.cleanup()
        if started:
            import ray

            ray.shutdown()
