"""DeepSpeed plumbing for one SPMD rank: process group, ZeRO configs, engines, checkpoints.

Launcher-agnostic: works under the `deepspeed` launcher, torchrun, or a plain single process
(it then forms a world of one). On CPU it uses gloo (DS_ACCELERATOR=cpu); on GPU, NCCL.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from openrlhf.config import ConfigError
from openrlhf.utils.network import free_port

from .checkpoint import (
    MANIFEST, CheckpointError, checkpoint_files, folder_bytes, hash_files, manifest_entries, read_latest, stale_tags, step_tags,
    verify_manifest, write_latest, write_manifest,
)
from .shm import release_shm_allreduce_names

__all__ = ["StrategyConfig", "DeepspeedStrategy"]

logger = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class StrategyConfig:
    zero_stage: int = 2
    param_dtype: str = "bf16"
    adam_offload: bool = False
    micro_batch_size: int = 1  # per rank
    train_batch_size: int = 8  # global, in samples, per optimizer step
    max_norm: float = 1.0
    seed: int = 42
    gradient_checkpointing: bool = False
    overlap_comm: bool = False
    grad_accum_dtype: str | None = None  # DeepSpeed data_types.grad_accum_dtype
    offload_params: bool = False  # inference engines (reference) keep ZeRO-3 params on CPU
    zpg: int = 1  # ZeRO++ hierarchical partitioning (hpZ): ranks holding a secondary ZeRO-3 copy
    load_universal: bool = False  # resume from a DeepSpeed universal checkpoint (latest_universal)


class DeepspeedStrategy:
    def __init__(self, cfg: StrategyConfig) -> None:
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.param_dtype]
        self._hf_ds_config = None  # kept alive for ZeRO-3 from_pretrained

    # ---- process group -------------------------------------------------------------------
    def setup_distributed(self) -> None:
        # A plain `python -m ...` run is a world of one; launchers set these themselves.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(free_port())
        import deepspeed

        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        if not dist.is_initialized():
            if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator loads its shared-memory allreduce op here
                _announce_extension_build("deepspeed_shm_comm")
            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
            release_shm_allreduce_names()
        self.set_seed(self.cfg.seed)
        world = self.world_size
        per_step = self.cfg.micro_batch_size * world
        if self.cfg.train_batch_size % per_step:
            raise ConfigError(
                f"--train.batch_size {self.cfg.train_batch_size} must be a multiple of "
                f"--train.micro_batch_size x world size = {self.cfg.micro_batch_size} x {world}"
            )
        if self.cfg.zpg > 1 and world % self.cfg.zpg:
            raise ConfigError(
                f"--ds.zpg {self.cfg.zpg} must divide the world size {world}: ZeRO++ keeps one secondary copy "
                f"of the parameters per group of {self.cfg.zpg} ranks"
            )
        self.grad_accum_steps = self.cfg.train_batch_size // per_step
        logger.info("rank %d/%d on %s, grad accumulation %d", self.rank, world, self.device, self.grad_accum_steps)

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def is_rank_0(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def set_seed(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def all_reduce(self, value: torch.Tensor | float, op: str = "sum") -> torch.Tensor:
        t = value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        t = t.to(self.device, torch.float64 if t.is_floating_point() else t.dtype)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not dist.is_initialized() or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized() or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    # ---- configs ---------------------------------------------------------------------------
    def ds_config(self, train: bool = True) -> dict[str, Any]:
        c = self.cfg
        zero: dict[str, Any] = {"stage": c.zero_stage if train else (3 if c.zero_stage == 3 else 0)}
        if c.zero_stage == 3:
            zero.update(stage3_param_persistence_threshold="auto", stage3_prefetch_bucket_size="auto")
            zero["stage3_param_persistence_threshold"] = 0
            zero["stage3_prefetch_bucket_size"] = 5e7
        if train and c.adam_offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if train and c.overlap_comm:
            zero["overlap_comm"] = True
        if train and c.zero_stage == 3 and c.zpg > 1:
            zero["zero_hpz_partition_size"] = c.zpg
        if not train and c.offload_params and c.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": c.micro_batch_size,
            "gradient_accumulation_steps": getattr(self, "grad_accum_steps", 1) if train else 1,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if train:
            cfg["gradient_clipping"] = c.max_norm
            if c.grad_accum_dtype:
                cfg["data_types"] = {"grad_accum_dtype": c.grad_accum_dtype}
            if c.load_universal:
                cfg["checkpoint"] = {"load_universal": True}
        if c.param_dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif c.param_dtype == "fp16":
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 16}
        return cfg

    @contextlib.contextmanager
    def model_init_context(self, train: bool = True):
        """Around `from_pretrained`: under ZeRO-3 transformers partitions weights as they load.

        Holding an `HfDeepSpeedConfig` is the supported way (wrapping from_pretrained in
        zero.Init fails with transformers 5.19).
        """
        if self.cfg.zero_stage != 3:
            yield
            return
        from transformers.integrations import HfDeepSpeedConfig
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        self._hf_ds_config = HfDeepSpeedConfig(self.ds_config(train))
        try:
            yield
        finally:
            # Only this load is partitioned: the rollout engine's own copy must load whole.
            self._hf_ds_config = None
            unset_hf_deepspeed_config()

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None, train: bool = True,
        max_norm: float | None = None,
    ):
        """deepspeed.initialize with this strategy's config; `max_norm` replaces its clipping norm (the critic has its own)."""
        import deepspeed

        config = self.ds_config(train)
        if train and max_norm is not None:
            config["gradient_clipping"] = max_norm
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=config,
            dist_init_required=False,
        )
        return engine

    def make_optimizer(self, model: nn.Module, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        if self.cfg.adam_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            _announce_extension_build("cpu_adam")
            return DeepSpeedCPUAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        # torch AdamW everywhere else: no JIT-built op needed on CPU; fused on CUDA.
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=torch.cuda.is_available())

    def gather_params(self, params: Iterable[nn.Parameter]):
        """Materialize ZeRO-3 partitioned params (read-only) for the duration of the block."""
        params = [p for p in params if hasattr(p, "ds_id")]
        if not params:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    # ---- checkpoints -----------------------------------------------------------------------
    def _rank0_outcome(self, fn) -> None:
        """Run `fn` on rank 0, then raise its CheckpointError on every rank (no rank left waiting)."""
        msg = None
        if self.is_rank_0:
            try:
                fn()
            except (CheckpointError, OSError) as e:
                msg = str(e) if isinstance(e, CheckpointError) else f"checkpoint I/O failed: {type(e).__name__}: {e}"
        msg = self.broadcast_object(msg)
        if msg is not None:
            raise CheckpointError(msg)

    def save_checkpoint(
        self, engine, ckpt_dir: str | Path, tag: str, client_state: dict[str, Any], max_num: int = 3,
        max_gb: float | None = None, extra: Callable[[Path], None] | None = None,
    ) -> Path:
        """Save into `<tag>.partial`, checksum every file, rename to `<tag>`, then point `latest` at it.

        `latest` moves only once the new checkpoint is complete and checksummed, and the previous
        checkpoints are pruned (keeping `max_num`, and at most `max_gb` GiB together) only after that:
        a failure or a kill at any point leaves the last good checkpoint in place and named by `latest`.
        `extra(folder)` runs on every rank after the engine's save and writes more files into the staged
        folder (they are checksummed with the rest). `engine=None` saves only what `extra` writes.
        """
        ckpt_dir = Path(ckpt_dir)
        staging = ckpt_dir / f"{tag}.partial"

        def prepare() -> None:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)

        self._rank0_outcome(prepare)
        self.barrier()
        if engine is not None:
            from deepspeed.checkpoint import constants as dsc

            # Marks the checkpoint convertible by `python -m deepspeed.checkpoint.ds_to_universal` (--ds.use_universal_ckpt).
            universal = {dsc.UNIVERSAL_CHECKPOINT_INFO: {dsc.UNIVERSAL_CHECKPOINT_VERSION_KEY: dsc.UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
            engine.save_checkpoint(str(ckpt_dir), tag=staging.name, client_state={**universal, **client_state}, save_latest=False)
        self.barrier()
        if extra is not None:
            extra(staging)
            self.barrier()

        # Every rank hashes a share of the files (a large checkpoint hashes in 1/world of the time).
        files = self.broadcast_object(checkpoint_files(staging) if self.is_rank_0 else None)
        entries = {k: v for part in self.all_gather_object(hash_files(staging, files[self.rank :: self.world_size])) for k, v in part.items()}

        def publish() -> None:
            write_manifest(staging, entries)
            final, old = ckpt_dir / tag, ckpt_dir / f"{tag}.replaced"
            if final.exists():  # the same step saved again (a final save after the last periodic one)
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(staging, final)
            write_latest(ckpt_dir, tag)
            shutil.rmtree(old, ignore_errors=True)
            for stale in stale_tags(ckpt_dir, tag, max_num, max_gb):
                shutil.rmtree(ckpt_dir / stale, ignore_errors=True)
            if max_gb is not None and folder_bytes(final) > max_gb * 2**30:
                logger.warning("checkpoint %s alone takes %.2f GiB, more than --ckpt.max_mem %g: kept (it is the newest)",
                               final, folder_bytes(final) / 2**30, max_gb)

        self._rank0_outcome(publish)
        self.barrier()
        return ckpt_dir / tag

    def load_checkpoint(
        self, engine, ckpt_dir: str | Path, extra: Callable[[Path], None] | None = None
    ) -> dict[str, Any] | None:
        """Load the checkpoint `ckpt_dir/latest` names, after verifying its checksums; None without `latest`.

        With `load_universal` (--ds.use_universal_ckpt) the checkpoint is the one `latest_universal` names: a
        DeepSpeed universal checkpoint, which loads at any world size and ZeRO stage. `extra(folder)` runs on
        every rank after the engine's load (files the save's `extra` wrote)."""
        ckpt_dir = Path(ckpt_dir)
        box: dict[str, Any] = {}
        pointer = "latest_universal" if self.cfg.load_universal else "latest"

        def other(tag: str) -> str:  # only on failure: hashing every other checkpoint costs time
            good = next((t for t in reversed(step_tags(ckpt_dir)) if t != tag and verify_manifest(ckpt_dir / t) == []), None)
            if good is None:
                return "no other checkpoint there verifies"
            return f"the newest other checkpoint that verifies is {good}: `echo {good} > {ckpt_dir / 'latest'}` to resume from it"

        def locate() -> None:
            tag = read_latest(ckpt_dir, pointer)
            if tag is None and self.cfg.load_universal and (plain := read_latest(ckpt_dir)) is not None:
                raise CheckpointError(
                    f"--ds.use_universal_ckpt: {ckpt_dir} has no latest_universal, only a regular checkpoint ({plain}). "
                    f"Convert it first: python -m deepspeed.checkpoint.ds_to_universal --input_folder {ckpt_dir / plain} "
                    f"--output_folder {ckpt_dir / (plain + '_universal')} (or drop --ds.use_universal_ckpt)"
                )
            if tag is not None and not (ckpt_dir / tag).is_dir():
                raise CheckpointError(
                    f"{ckpt_dir / pointer} names {tag}, but {ckpt_dir / tag} does not exist (moved or deleted); "
                    f"{other(tag)}, or drop --ckpt.load_enable to start fresh"
                )
            box["tag"] = tag
            box["files"] = None if tag is None else sorted(manifest_entries(ckpt_dir / tag) or {}) or None

        self._rank0_outcome(locate)
        tag, files = self.broadcast_object((box.get("tag"), box.get("files")))
        if tag is None:
            return None
        if files is None:
            if self.is_rank_0:
                logger.warning("checkpoint %s has no %s (written by another tool or version): loading it unverified", ckpt_dir / tag, MANIFEST)
        else:  # every rank verifies a share of the files
            problems = [p for part in self.all_gather_object(verify_manifest(ckpt_dir / tag, files[self.rank :: self.world_size])) for p in part]
            if problems:
                msg = self.broadcast_object(
                    f"checkpoint {ckpt_dir / tag} is corrupt: {'; '.join(problems[:4])}. Refusing to resume from it; "
                    f"{other(tag)}, or drop --ckpt.load_enable to start fresh" if self.is_rank_0 else None
                )
                raise CheckpointError(msg)
        path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"checkpoint {ckpt_dir / tag} could not be loaded (see DeepSpeed's log above)")
        if extra is not None:
            extra(ckpt_dir / tag)
        return client_state

    def model_state_dict(self, engine, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """`model`'s whole state dict on rank 0 (None elsewhere); `model` is `engine.module` or a submodule of it
        (the HF model inside an Actor). Under ZeRO-3 every rank must call it (it gathers the partitions)."""
        if self.cfg.zero_stage != 3:
            return {k: v.detach().cpu() for k, v in model.state_dict().items()} if self.is_rank_0 else None
        prefix = next(name for name, m in engine.module.named_modules() if m is model)
        full = engine._zero3_consolidated_16bit_state_dict()
        if not self.is_rank_0:
            return None
        prefix = prefix + "." if prefix else ""
        return {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}

    def save_hf(self, engine, model: nn.Module, tokenizer, out_dir: str | Path) -> None:
        """Export a plain HF checkpoint of `model` (high-precision weights; FP8 is recomputed on load). Every rank calls."""
        self.write_hf(model, tokenizer, out_dir, self.model_state_dict(engine, model))

    def write_hf(self, model: nn.Module, tokenizer, out_dir: str | Path, state_dict: dict[str, torch.Tensor] | None) -> None:
        """Rank 0 writes `state_dict` (its own; None elsewhere) as `model`'s HF folder; every rank calls."""
        out_dir = Path(out_dir)
        if self.is_rank_0:
            out_dir.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir)
            (out_dir / "jetrl_export.json").write_text(json.dumps({"note": "bf16/fp32 master weights; apply the recipe on load"}))
        self.barrier()


def _extension_build_dirs(name: str) -> list[Path]:
    """Where torch JIT-builds op `name`: TORCH_EXTENSIONS_DIR/<name> as given, else a per-Python/accelerator
    folder (py311_cpu, ...) under the default root."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return [Path(root) / name] if root else sorted(Path(get_default_build_root()).glob(f"*/{name}"))


def _announce_extension_build(name: str) -> None:
    """Say what DeepSpeed's JIT build of op `name` is about to do, before it goes quiet.

    torch builds extensions under a lock file; a build killed part-way leaves the file behind and
    every later build then waits on it forever without a word. Naming the file turns that silent
    hang into a one-line fix.
    """
    dirs = _extension_build_dirs(name)
    locks = [d / "lock" for d in dirs if (d / "lock").exists()]
    if locks:
        logger.warning("DeepSpeed op %s: build lock %s exists; unless another build is running now, a killed build "
                       "left it and this run will wait on it forever: delete that file", name, locks[0])
    elif not any((d / f"{name}.so").exists() for d in dirs):
        logger.info("DeepSpeed op %s: building it on first use into %s (tens of seconds on 2 cores)", name,
                    os.environ.get("TORCH_EXTENSIONS_DIR") or "torch's extensions cache")
