"""Small Ray helpers: joining or starting a cluster, the env actors inherit, addresses and ports."""

from __future__ import annotations

import logging
import os
from typing import Any

from openrlhf.utils.network import free_port

__all__ = ["init_ray", "actor_env", "node_ip", "free_port", "call", "on_gpu_cluster", "visible_devices_for", "pin_assigned_gpus", "device_info"]

logger = logging.getLogger(__name__)

# Environment the actors need from the driver. A `ray start` cluster's workers do not see the
# driver's shell, so these travel in each actor's runtime_env.
_PASS_PREFIXES = ("HF_", "TRANSFORMERS_", "VLLM_", "DS_", "NCCL_", "NVSHMEM_", "TRITON_", "JETRL_", "TORCH_", "TOKENIZERS_")
_PASS_NAMES = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "WANDB_API_KEY", "WANDB_MODE")


def _existing_cluster() -> str | None:
    """RAY_ADDRESS (set by `ray job submit`), else a cluster this machine joined with `ray start`."""
    addr = os.environ.get("RAY_ADDRESS")
    if addr:
        return addr
    try:  # the file `ray start` writes; never "auto", which would join any Ray process on the machine
        from ray._private.services import find_bootstrap_address

        return find_bootstrap_address(None)
    except Exception:  # a private helper: if it moves, fall back to a fresh local instance
        return None


def init_ray() -> bool:
    """Join a running cluster if there is one, else start a local instance. Returns True when this
    call started Ray (the caller then shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    addr = _existing_cluster()
    if addr:
        logger.info("joining the Ray cluster at %s", addr)
        ray.init(address=addr, log_to_driver=True)
        return False
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True)
    # A local instance lives on this machine only: VLLM_HOST_IP pins its address (loopback on machines
    # without an outside network); CPU machines use loopback by default, as the CPU CI does.
    host = os.environ.get("VLLM_HOST_IP") or (None if _has_cuda() else "127.0.0.1")
    if host:
        kwargs["_node_ip_address"] = host
    logger.info("no running Ray cluster found: starting a local one")
    ray.init(**kwargs)
    return True


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def on_gpu_cluster() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def actor_env(on_gpu: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(_PASS_PREFIXES) or k in _PASS_NAMES}
    env.pop("CUDA_VISIBLE_DEVICES", None)  # Ray assigns devices
    if not on_gpu:
        env.setdefault("OMP_NUM_THREADS", "1")  # actors share a few cores: no oversubscription
        env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def visible_devices_for(assigned: list, visible: str | None) -> str | None:
    """The CUDA_VISIBLE_DEVICES an actor should run with so that Ray's GPUs for it are devices 0..k-1,
    or None when it already does. Ray normally sets exactly that; with
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES (or a runtime_env that sets the variable) the actor
    would see every GPU, and code that uses device 0 / LOCAL_RANK 0 would land on another actor's GPU."""
    ids = [str(i) for i in assigned]
    if not ids:
        return None
    return None if visible is not None and visible.split(",") == ids else ",".join(ids)


def pin_assigned_gpus() -> list[str]:
    """Narrow this actor's CUDA_VISIBLE_DEVICES to the GPUs Ray assigned it (call before CUDA is
    initialized, first thing in an actor's constructor). Returns the assigned ids."""
    import ray

    ids = [str(i) for i in ray.get_gpu_ids()]
    narrowed = visible_devices_for(ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if narrowed is not None:
        logger.info("CUDA_VISIBLE_DEVICES %s -> %s (the GPUs Ray assigned this actor)", os.environ.get("CUDA_VISIBLE_DEVICES"), narrowed)
        os.environ["CUDA_VISIBLE_DEVICES"] = narrowed
    return ids


def device_info() -> dict[str, Any]:
    """Where this actor runs: node, pid, Ray's GPU ids and the device torch uses (for logs and tests)."""
    import ray

    info: dict[str, Any] = {"node_ip": node_ip(), "pid": os.getpid(), "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if _has_cuda():
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["cuda_device"] = torch.cuda.current_device()
        info["cuda_uuid"] = str(getattr(props, "uuid", ""))
    return info


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def call(ref_or_refs, actor_ids, during: str, error_cls=None, timeout: float | None = None):
    """`ray.get` that turns an actor's death into `error_cls(actor_id, during)` naming the actor.

    `ref_or_refs` and `actor_ids` are one ObjectRef and its id, or parallel lists. An exception
    raised *inside* a live actor propagates unchanged (it is the actor's own error).
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from .errors import RayActorDiedError, RayActorStartError

    error_cls = error_cls or RayActorDiedError
    single = not isinstance(ref_or_refs, list)
    refs = [ref_or_refs] if single else list(ref_or_refs)
    ids = [actor_ids] if single else list(actor_ids)
    out = []
    for ref, aid in zip(refs, ids):
        try:
            out.append(ray.get(ref, timeout=timeout))
        except RayActorError as e:
            text = str(e)
            if "creation task" in text:  # the constructor raised: report its exception, not a "death"
                lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
                raise RayActorStartError(aid, lines[-1] if lines else text) from None
            raise error_cls(aid, during, e) from None
        except GetTimeoutError as e:
            raise error_cls(aid, during, f"no answer within {timeout:.0f} s") from e
    return out[0] if single else out
