"""Rollout engines as Ray actors, and the `RolloutEngine` proxy the policy ranks drive them through.

`EngineActor` wraps one engine (`VLLMEngine`, or the transformers `HFEngine`) in its own process.
`RemoteEngine` is what `PPOTrainer` sees on every policy rank in Ray mode: the same interface
as a colocated engine, so the trainer core is unchanged.

Weight sync: a process group (gloo on CPU, NCCL on GPU) spans policy rank 0 and every engine
worker. Under ZeRO-3 *every* policy rank runs the gathering iterator (the gather is a
collective); rank 0 packs what it yields — FP8 bytes + scales for FP8 layers, the cached
quantization the trainer's forward uses — and broadcasts it; the engines install it without
re-quantizing. The digest check then asks each engine for digests of what it holds; rank 0
collects them and shares them with the other ranks, so every rank runs the same check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Iterable, Sequence

import torch

from ..engines.base import RolloutEngine, RolloutSample, SamplingConfig
from ..engines.factory import build_engine
from .errors import EngineDiedError
from .utils import call, device_info, free_port, node_ip, pin_assigned_gpus

__all__ = ["EngineActor", "RemoteEngine", "EngineHandles", "engine_placement"]

logger = logging.getLogger(__name__)


def engine_placement(tensor_parallel_size: int, on_gpu: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM engine kwargs and environment for an engine actor.

    TP > 1 on GPUs: the TP workers are Ray actors in this engine's placement-group bundles (on CPU, vLLM's
    worker processes beside the actor's, `VLLMEngine`'s choice). TP 1 on a GPU:
    vLLM runs inside the actor's own process (executor "uni", no engine-core subprocess), so the
    worker that joins the weight-sync group, installs FP8 bytes and answers digests and the precision
    graph is this process, on the GPU Ray gave the actor, with our `jetrl_fp8` method registered in
    it (a spawned engine core would need the project pip-installed for vLLM's plugin entry point).
    """
    if tensor_parallel_size > 1:
        return ({"distributed_executor_backend": "ray"}, {}) if on_gpu else ({}, {})
    if on_gpu:
        return {"distributed_executor_backend": "uni"}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return {}, {}


def _build_engine(cfg, kind: str, index: int, engine_kwargs: dict[str, Any] | None = None) -> RolloutEngine:
    on_gpu = torch.cuda.is_available()
    kwargs, env = engine_placement(cfg.vllm.tensor_parallel_size, on_gpu)
    os.environ.update(env)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.ds.param_dtype]
    return build_engine(
        cfg, kind, cfg.precision.load_recipe(), rank=index, dtype=dtype, device="cuda" if on_gpu else "cpu",
        vllm_engine_kwargs={**kwargs, **(engine_kwargs or {})} or None,
    )


class EngineActor:
    """One rollout engine in its own Ray actor. Created threaded (max_concurrency=2) so `status()`
    answers while a rollout runs; every engine call holds one lock, so the engine itself only
    ever sees one call at a time."""

    def __init__(self, cfg, engine_id: str, index: int, kind: str, engine_kwargs: dict[str, Any] | None = None) -> None:
        """`engine_kwargs`: extra vLLM engine arguments (benchmarks: dummy weights, no tokenizer)."""
        from openrlhf.utils.logging_utils import setup_logging

        setup_logging(0)
        pin_assigned_gpus()
        self.engine_id, self.index, self.kind = engine_id, index, kind
        self._lock = threading.Lock()
        self._busy: str | None = None
        self._calls: dict[str, int] = {}
        self._group = None  # the weight-sync group, for engines without their own transport
        with self._using("init"):
            self.engine = _build_engine(cfg, kind, index, engine_kwargs)

    @contextlib.contextmanager
    def _using(self, what: str):
        with self._lock:
            self._busy = what
            self._calls[what] = self._calls.get(what, 0) + 1
            try:
                yield
            finally:
                self._busy = None

    # ---- introspection (lock-free) --------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "name": self.engine.name, **device_info()}

    def status(self) -> dict[str, Any]:
        return {"busy": self._busy, "calls": dict(self._calls)}

    # ---- rollout ----------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[list[RolloutSample]]:
        with self._using("generate"):
            return self.engine.generate(prompts, sampling)

    def sleep(self) -> None:
        with self._using("sleep"):
            self.engine.sleep()

    def wake_up(self) -> None:
        with self._using("wake_up"):
            self.engine.wake_up()

    # ---- weights ------------------------------------------------------------------------------------
    def init_sync_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str) -> Any:
        with self._using("init_sync_group"):
            if hasattr(self.engine, "init_weight_sync_group"):  # vLLM: its workers join
                return self.engine.init_weight_sync_group(host, port, rank_offset, world_size, backend)
            from jetrl_precision.weight_sync import init_sync_group

            self._group = init_sync_group(host, port, rank_offset, world_size, backend)
            return [rank_offset]

    def receive_weights(self, src: int = 0) -> dict[str, int]:
        with self._using("receive_weights"):
            if hasattr(self.engine, "receive_weights"):  # vLLM: wakes only the weights of a sleeping engine
                return self.engine.receive_weights(src)
            from jetrl_precision.weight_sync import receive_sync_tensors

            counts = {"fp8": 0, "hp": 0}
            for bucket in receive_sync_tensors(self._group, src):
                self._install(bucket, counts)
            return counts

    def receive_weights_ipc(self, entries: Sequence[dict], buckets: dict) -> dict[str, int]:
        with self._using("receive_weights"):
            if hasattr(self.engine, "receive_weights_ipc"):  # vLLM: each worker maps its own GPU's bucket
                return self.engine.receive_weights_ipc(entries, buckets)
            from jetrl_precision.ipc_sync import mapped_bucket
            from jetrl_precision.weight_sync import unpack_sync_bucket

            with mapped_bucket(buckets, "cuda", self.engine_id) as payload:
                return self._install(unpack_sync_bucket(entries, payload), {"fp8": 0, "hp": 0})

    def _install(self, bucket: Sequence[Any], counts: dict[str, int]) -> dict[str, int]:
        """One received bucket into the (non-vLLM) engine, counted as FP8 tensors and high-precision ones."""
        self.engine.update_weights(bucket)
        for t in bucket:
            counts["fp8" if t.scale is not None else "hp"] += 1
        return counts

    def weight_digests(self, names: Sequence[str]) -> dict[str, str | None]:
        with self._using("weight_digests"):
            return self.engine.weight_digests(list(names))

    def precision_graph(self) -> dict:
        with self._using("precision_graph"):
            graph = self.engine.precision_graph()
        meta = graph.setdefault("meta", {})
        meta["engine"] = f"{meta.get('engine', self.engine.name)} [{self.engine_id}]"
        meta["engine_id"] = self.engine_id
        return graph

    def shutdown(self) -> None:
        with self._using("shutdown"):
            self.engine.shutdown()


@dataclasses.dataclass(frozen=True)
class EngineHandles:
    """What a policy rank needs to reach the engines (picklable: Ray actor handles + settings)."""

    actors: tuple[Any, ...]
    ids: tuple[str, ...]
    kind: str
    tensor_parallel_size: int = 1
    sync_backend: str = "gloo"
    enable_sleep: bool = False
    timeout_s: float = 1800.0
    # Rendezvous ports handed to the critic and policy groups, which may not be bound yet when the sync group
    # picks its own: it must not pick one of them.
    reserved_ports: tuple[int, ...] = ()


class RemoteEngine(RolloutEngine):
    """The policy rank's view of the engine actors, behind the `RolloutEngine` interface.

    Rank r rolls out on engines r, r+W, ... (W policy ranks) when there are at least W engines,
    else on engine r mod N; engine deaths surface as `EngineDiedError` naming the engine.
    """

    in_process = False  # the engines are other processes, usually on other GPUs

    def __init__(self, handles: EngineHandles) -> None:
        import torch.distributed as dist

        self.h = handles
        self.name = handles.kind
        self.sync_layout = "model" if handles.kind == "hf" else "checkpoint"  # as the engines behind it read them
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        n = len(handles.actors)
        self.mine = list(range(self.rank, n, self.world_size)) if n >= self.world_size else [self.rank % n]
        self._group = None
        if self.rank == 0 and handles.sync_backend != "ipc":  # CUDA IPC needs no group: buckets go by handle
            self._init_sync_group()

    # ---- helpers ----------------------------------------------------------------------------------
    def _get(self, refs: list, idx: list[int], during: str) -> list:
        return call(refs, [self.h.ids[i] for i in idx], during, EngineDiedError, timeout=self.h.timeout_s)

    def _all(self, method: str, *args: Any, during: str) -> list:
        idx = list(range(len(self.h.actors)))
        return self._get([getattr(self.h.actors[i], method).remote(*args) for i in idx], idx, during)

    def _raise_dead_engine(self, refs: list, during: str, cause: BaseException) -> None:
        """After a transport error: name the engine that died, if one did."""
        import ray
        from ray.exceptions import RayActorError

        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            for i, a in enumerate(self.h.actors):
                try:
                    ray.get(a.status.remote(), timeout=2.0)
                except RayActorError:
                    raise EngineDiedError(self.h.ids[i], during, cause) from cause
                except Exception:
                    pass
            time.sleep(0.5)

    def _barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()

    def _share(self, obj: Any) -> Any:
        """Rank 0's object, on every policy rank."""
        import torch.distributed as dist

        if not dist.is_initialized() or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _init_sync_group(self) -> None:
        from jetrl_precision.weight_sync import init_sync_group

        tp = self.h.tensor_parallel_size
        world = 1 + len(self.h.actors) * tp
        host = node_ip()
        port = free_port(host, self.h.reserved_ports)
        refs = [a.init_sync_group.remote(host, port, 1 + i * tp, world, self.h.sync_backend) for i, a in enumerate(self.h.actors)]
        t0 = time.perf_counter()
        try:
            self._group = init_sync_group(host, port, 0, world, self.h.sync_backend, timeout_s=min(self.h.timeout_s, 600.0))
        except Exception as e:
            self._raise_dead_engine(refs, "weight-sync group set-up", e)
            raise
        self._get(refs, list(range(len(refs))), "weight-sync group set-up")
        logger.info("weight-sync group: %d ranks over %s at %s:%d (%.1f s)", world, self.h.sync_backend, host, port, time.perf_counter() - t0)

    # ---- RolloutEngine ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[list[RolloutSample]]:
        k = len(self.mine)
        bounds = [len(prompts) * j // k for j in range(k + 1)]
        refs, idx = [], []
        for j, e in enumerate(self.mine):
            part = list(prompts[bounds[j] : bounds[j + 1]])
            if not part:
                continue
            # distinct seeds per engine: two engines must not draw the same samples
            s = sampling if j == 0 or sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + 1_000_003 * j)
            refs.append(self.h.actors[e].generate.remote(part, s))
            idx.append(e)
        return [group for part in self._get(refs, idx, "generate (rollout)") for group in part]

    def update_weights(self, tensors: Iterable[Any]) -> None:
        if self.h.sync_backend == "ipc":
            self._update_weights_ipc(tensors)
            return
        if self.rank != 0:
            for _ in tensors:  # the ZeRO-3 gather is collective: consume in step with rank 0
                pass
            return
        from jetrl_precision.weight_sync import broadcast_sync_tensors

        refs = [a.receive_weights.remote(0) for a in self.h.actors]
        try:
            stats = broadcast_sync_tensors(tensors, self._group, src=0)
        except Exception as e:
            self._raise_dead_engine(refs, "weight sync", e)
            raise
        self._get(refs, list(range(len(refs))), "weight sync")
        self.last_sync_stats = stats

    def _update_weights_ipc(self, tensors: Iterable[Any]) -> None:
        """Every rank packs each bucket on its own GPU and exports it (`ipc_sync.share_bucket`); rank 0 hands every
        engine the buckets by GPU and waits for their installs; no rank reuses a bucket's memory before that."""
        import torch.distributed as dist

        from jetrl_precision.ipc_sync import share_bucket
        from jetrl_precision.weight_sync import SyncStats, pack_sync_buckets

        stats = SyncStats()
        t0 = time.perf_counter()
        device = torch.device("cuda", torch.cuda.current_device())
        for entries, payload in pack_sync_buckets(tensors, device, stats=stats):
            mine = share_bucket(payload)
            shared = [mine]
            if dist.is_initialized() and self.world_size > 1:
                shared = [None] * self.world_size
                dist.all_gather_object(shared, mine)
            if self.rank == 0:
                buckets = {}
                for b in shared:
                    buckets.setdefault(b.device_uuid, b)
                self._all("receive_weights_ipc", entries, buckets, during="weight sync")
            self._barrier()
            del payload  # every engine has let go: free it before the next bucket is packed
        stats.seconds = time.perf_counter() - t0
        self.last_sync_stats = stats

    def weight_digests(self, names: Sequence[str]) -> dict[str, str | None]:
        from openrlhf.trainer.ppo_trainer import WeightSyncError

        result: dict[str, Any] | None = None
        if self.rank == 0:
            per_engine = self._all("weight_digests", list(names), during="digest check")
            base = per_engine[0]
            differ = {self.h.ids[i]: [n for n in names if d.get(n) != base.get(n)] for i, d in enumerate(per_engine)}
            differ = {k: v for k, v in differ.items() if v}
            if differ:
                detail = "; ".join(f"{k}: {v[:4]}" for k, v in differ.items())
                result = {"error": f"engines disagree after weight sync ({detail} differ from {self.h.ids[0]})"}
            else:
                result = {"digests": base}
        result = self._share(result)
        if "error" in result:
            raise WeightSyncError(result["error"])
        return result["digests"]

    def precision_graphs(self) -> list[dict]:
        return self._all("precision_graph", during="precision check")

    def precision_graph(self) -> dict:
        return self.precision_graphs()[0]

    def wake_up(self) -> None:
        if not self.h.enable_sleep:
            return
        if self.rank == 0:
            self._all("wake_up", during="wake_up")
        self._barrier()  # no rank generates before every engine is awake

    def sleep(self) -> None:
        if not self.h.enable_sleep:
            return
        self._barrier()  # every rank's rollout is done
        if self.rank == 0:
            self._all("sleep", during="sleep")

    def shutdown(self) -> None:
        pass  # the driver owns the engine actors
