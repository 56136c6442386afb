"""What the trainer sends to a rollout engine after each optimizer step.

FP8 layers travel as the e4m3 bytes + fp32 128x128 scales that the trainer's own forward
uses (`Fp8Linear.quantized_weight`, cached): half the bytes of bf16, and the engine installs
them without re-quantizing, so both sides hold identical bytes. Everything else (embeddings,
norms, lm_head, biases) travels in its own dtype. `digest` (jetrl_precision.digests) fingerprints
bytes for the post-sync check.

Transport: colocated engines take the tensors in-process; a separate engine receives them
packed into uint8 buckets with JSON entries (`pack_sync_buckets` / `unpack_sync_bucket`), over a
torch.distributed group (`init_sync_group`: gloo on CPU, NCCL on GPU) that lives beside any
default group (DeepSpeed's, vLLM's) (`broadcast_sync_tensors` / `receive_sync_tensors`), or, from a
GPU it shares, through CUDA IPC (`ipc_sync`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import random
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator, Literal, Mapping, Sequence

import torch
from torch import nn

from . import ops
from .digests import digest
from .formats import Block
from .graph import canonical_name
from .linear import Fp8Linear
from .recipe import PrecisionRecipe

__all__ = [
    "SyncTensor",
    "iter_sync_tensors",
    "digest",
    "sync_nbytes",
    "WeightSyncError",
    "sync_tensor_digest",
    "expected_engine_digests",
    "sample_names",
    "compare_digests",
    "SyncStats",
    "SyncGroup",
    "init_sync_group",
    "pack_sync_buckets",
    "unpack_sync_bucket",
    "broadcast_sync_tensors",
    "receive_sync_tensors",
    "broadcast_json",
]

logger = logging.getLogger(__name__)


@dataclass
class SyncTensor:
    name: str  # canonical parameter name, e.g. "model.layers.0.mlp.down_proj.weight"
    data: torch.Tensor  # e4m3 bytes (kind == "fp8") or the parameter in its dtype
    scale: torch.Tensor | None = None  # fp32 logical [ceil(N/b0), ceil(K/b1)] for fp8
    block: Block | None = None

    @property
    def kind(self) -> str:
        return "fp8" if self.scale is not None else "hp"

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (self.scale.numel() * self.scale.element_size() if self.scale is not None else 0)


Layout = Literal["checkpoint", "model"]  # how synced high-precision tensors are named and laid out (iter_sync_tensors)


def _checkpoint_layout(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
    """Maps high-precision tensors named as the live model holds them to the names and layout of its checkpoint,
    which is what an engine's loader reads: transformers converts some weights on load (MoE experts become 3-D
    stacks; their checkpoints store one matrix per expert) and reverts that on save. None when nothing is converted."""
    hf = next((m for m in model.modules() if hasattr(m, "base_model_prefix") and hasattr(m, "config")), None)
    if hf is None:
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5 keeps checkpoint names and layouts in memory
        return None
    conversions = getattr(hf, "_weight_conversions", None)  # what from_pretrained applied; else the defaults
    if conversions is None:  # (a model built from a config): as revert_weight_conversion reads them
        conversions = [c for c in get_model_conversion_mapping(hf, add_legacy=False) if type(c).__name__ != "PrefixChange"]
    if not conversions:
        return None
    return lambda tensors: revert_weight_conversion(hf, tensors)


def _layout_map(model: nn.Module, layout: Layout):
    if layout not in ("checkpoint", "model"):
        raise ValueError(f"layout must be 'checkpoint' or 'model', got {layout!r}")
    return _checkpoint_layout(model) if layout == "checkpoint" else None


def _module_tensors(layout, prefix: str, params: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    named = {(f"{prefix}.{n}" if prefix else n): p.detach() for n, p in params}
    yield from (layout(named) if layout is not None else named).items()


def iter_sync_tensors(
    model: nn.Module,
    gather: Callable[[list[nn.Parameter]], ContextManager] | None = None,
    fp8: bool = True,
    layout: Layout = "checkpoint",
) -> Iterator[SyncTensor]:
    """Yield every tensor a rollout engine needs, module by module.

    `gather(params)` is a context manager that materializes partitioned parameters
    (DeepSpeed ZeRO-3: `deepspeed.zero.GatheredParameters(params)`); tensors are yielded
    inside it, so consume each before asking for the next. With `fp8=False` every weight
    travels in high precision (the bf16 baseline, or fp8_rollout where the engine quantizes).
    `layout`: "checkpoint" names and lays out high-precision tensors as the model's checkpoint does, which is what
    an engine's loader reads (vLLM; `_checkpoint_layout`: MoE experts one matrix per expert); "model" as the live
    model holds them (an engine that is a transformers model itself).
    """
    gather = gather or (lambda params: contextlib.nullcontext())
    to_checkpoint = _layout_map(model, layout)
    seen: set[int] = set()  # tied weights (lm_head = embed_tokens) travel once; the engine ties them too
    for fqn, module in model.named_modules():
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for _, p in params)
        if not params:
            continue
        prefix = canonical_name(fqn)
        with gather([p for _, p in params]):
            if fp8 and isinstance(module, Fp8Linear) and module.fprop.weight.is_fp8 and any(n == "weight" for n, _ in params):
                wq = module.quantized_weight(module.weight)
                yield SyncTensor(f"{prefix}.weight" if prefix else "weight", wq.data, wq.scale, wq.block)
                params = [(n, p) for n, p in params if n != "weight"]
            for name, t in _module_tensors(to_checkpoint, prefix, params):
                yield SyncTensor(name, t)


def sync_nbytes(model: nn.Module, fp8: bool = True) -> int:
    return sum(t.nbytes() for t in iter_sync_tensors(model, fp8=fp8))


# ---- post-sync digest check ---------------------------------------------------------------------
class WeightSyncError(RuntimeError):
    """The engine's weights differ from what the trainer sent (or the transfer failed)."""


def sync_tensor_digest(t: SyncTensor) -> str:
    """Digest of what the engine must hold for `t`: FP8 bytes + scales, or the high-precision tensor."""
    return digest(t.data) if t.scale is None else f"{digest(t.data)}:{digest(t.scale)}"


def expected_engine_digests(
    model: nn.Module,
    names: Iterable[str] | None = None,
    *,
    fp8: bool = True,
    engine_recipe: PrecisionRecipe | None = None,
    layout: Layout = "checkpoint",
) -> dict[str, str]:
    """Digests of the bytes a rollout engine should hold after a sync, computed on the trainer.

    Fp8Linear weights: the trainer's cached FP8 bytes (what `iter_sync_tensors` sends).
    With `engine_recipe` (fp8_rollout: a BF16 trainer, an engine that quantizes), plain linear
    weights the recipe does not keep in high precision are quantized with its rollout weight
    spec, as the engine's loader does. Everything else: the tensor itself.
    """
    engine_weight_spec = engine_recipe.rollout.weight if engine_recipe is not None else None
    wanted = set(names) if names is not None else None
    to_checkpoint = _layout_map(model, layout)
    out: dict[str, str] = {}
    for fqn, module in model.named_modules():
        prefix = canonical_name(fqn)
        plain: list[tuple[str, torch.Tensor]] = []
        for pname, p in module.named_parameters(recurse=False):
            name = f"{prefix}.{pname}" if prefix else pname
            if fp8 and isinstance(module, Fp8Linear) and pname == "weight" and module.fprop.weight.is_fp8:
                if wanted is None or name in wanted:
                    wq = module.quantized_weight(p)
                    out[name] = f"{digest(wq.data)}:{digest(wq.scale)}"
            elif (
                engine_weight_spec is not None
                and engine_weight_spec.is_fp8
                and type(module) is nn.Linear
                and pname == "weight"
                and not engine_recipe.keeps_high_precision(prefix)
            ):
                if wanted is None or name in wanted:
                    with torch.no_grad():
                        wq = ops.quantize(p.detach(), engine_weight_spec)
                    out[name] = f"{digest(wq.data)}:{digest(wq.scale)}"
            else:
                plain.append((pname, p))
        # As sent: named and laid out as `layout` says.
        if plain and (wanted is None or any(n.startswith(prefix) for n in wanted)):
            for name, t in _module_tensors(to_checkpoint, prefix, plain):
                if wanted is None or name in wanted:
                    out[name] = digest(t)
    if wanted is not None and wanted - set(out):
        raise KeyError(f"trainer model has no parameter(s) {sorted(wanted - set(out))}")
    return out


def sample_names(names: Sequence[str], k: int = 8, seed: int | None = None) -> list[str]:
    """A sample of `k` names that always includes the first and the last (cheap per-sync check)."""
    names = list(names)
    if len(names) <= k:
        return names
    rng = random.Random(seed)
    middle = rng.sample(names[1:-1], max(k - 2, 0))
    return [names[0], *sorted(middle, key=names.index), names[-1]]


def _pair(sent: str, held: str) -> str:
    """'trainer <prefix>.. engine <prefix>..' with prefixes long enough to differ visibly."""
    n = next((i for i, (a, b) in enumerate(zip(sent, held)) if a != b), min(len(sent), len(held)))
    width = max(12, n + 4)
    cut = lambda d: d if len(d) <= width else d[:width] + ".."  # noqa: E731
    return f"trainer {cut(sent)} engine {cut(held)}"


def _describe_difference(sent: str, held: str) -> str:
    """Which part of a `data[:scale]` digest differs, with the differing parts shown."""
    if held.startswith("modified-after-sync:"):
        return f"the engine changed the tensor after the sync (now {held.split(':', 1)[1][:12]}..)"
    sent_parts, held_parts = sent.split(":"), held.split(":")
    if len(sent_parts) != len(held_parts):
        kinds = {1: "a high-precision tensor", 2: "FP8 bytes + scales"}
        return f"trainer sent {kinds.get(len(sent_parts), sent)}, engine holds {kinds.get(len(held_parts), held)}"
    if len(sent_parts) == 1:
        return _pair(sent, held)
    (sd, ss), (hd, hs) = sent_parts, held_parts
    diffs = []
    if sd != hd:
        diffs.append(f"FP8 data differs: {_pair(sd, hd)}")
    if ss != hs:
        diffs.append(f"scales differ: {_pair(ss, hs)}")
    if sd == hd:
        diffs.append("FP8 data equal")
    elif ss == hs:
        diffs.append("scales equal")
    return ", ".join(diffs)


def compare_digests(
    trainer: Mapping[str, str],
    engine: Mapping[str, str | None] | None,
    *,
    raise_on_mismatch: bool = True,
) -> list[str]:
    """Names whose engine digest differs from the trainer's, or that the engine did not vouch for.

    The check must prove something, so each of these is a failure (raised as WeightSyncError
    by default; with `raise_on_mismatch=False` logged and returned): no names to check, an
    engine answer that is not a mapping, a name the engine left out or answered None for
    (it holds no readable copy), names the engine answered that were not asked for, and a
    digest that differs. The message shows which part differs (FP8 data or scales).
    """
    if not isinstance(trainer, Mapping) or not trainer:
        raise WeightSyncError(
            f"weight sync check: the trainer sampled no tensors to check (got {trainer!r}); a check of nothing proves nothing"
        )
    if not isinstance(engine, Mapping):
        raise WeightSyncError(
            f"weight sync check: the engine answered {type(engine).__name__} instead of a name -> digest mapping "
            f"for {len(trainer)} tensor(s); the engine's digest call is broken"
        )
    mismatched = [n for n in trainer if engine.get(n) is not None and engine[n] != trainer[n]]
    unavailable = [n for n in trainer if engine.get(n) is None]
    unexpected = sorted(set(engine) - set(trainer))
    problems = []
    if unavailable:
        what = "left out" if all(n not in engine for n in unavailable) else "could not digest (None)"
        problems.append(f"the engine {what} {len(unavailable)} tensor(s): {', '.join(unavailable[:8])}{' ...' if len(unavailable) > 8 else ''}")
    if unexpected:
        problems.append(f"the engine answered for name(s) the trainer did not ask about: {', '.join(unexpected[:8])}")
    if mismatched:
        detail = "; ".join(f"{n}: {_describe_difference(trainer[n], str(engine[n]))}" for n in mismatched[:8])
        problems.append(f"{len(mismatched)} of {len(trainer)} checked tensor(s) differ between trainer and rollout engine: {detail}")
    if problems:
        msg = (
            "WEIGHT SYNC MISMATCH: " + "; ".join(problems) + ". The engine is NOT proven to run the trained policy; stop and "
            "check the sync path (a re-quantizing loader, a wrong recipe on the engine, names that do not map, or a corrupted transfer)."
        )
        logger.error(msg)
        if raise_on_mismatch:
            raise WeightSyncError(msg)
    return [n for n in trainer if n in set(mismatched) | set(unavailable)]


# ---- transport over a torch.distributed group ------------------------------------------------
@dataclass
class SyncStats:
    tensors: int = 0
    fp8_tensors: int = 0
    fp8_bytes: int = 0  # e4m3 data + fp32 scales
    hp_bytes: int = 0
    seconds: float = 0.0
    buckets: int = 0

    @property
    def total_bytes(self) -> int:
        return self.fp8_bytes + self.hp_bytes

    def add(self, t: SyncTensor) -> None:
        self.tensors += 1
        if t.kind == "fp8":
            self.fp8_tensors += 1
            self.fp8_bytes += t.nbytes()
        else:
            self.hp_bytes += t.nbytes()


@dataclass(eq=False)  # compared and hashed by identity: the live groups are tracked in a WeakSet
class SyncGroup:
    """A process group for weight sync that lives beside any default group (DeepSpeed's, vLLM's)."""

    pg: Any
    rank: int
    world_size: int
    backend: str
    device: torch.device
    store: Any = field(default=None, repr=False)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        if self.pg is None:
            raise WeightSyncError(f"weight-sync group (rank {self.rank} of {self.world_size}) is closed")
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([t], opts).wait()

    def close(self) -> None:
        """Destroy the backend's group now. A group still alive when the interpreter shuts down has its worker
        threads torn down unjoined, and the process aborts ("terminate called without an active exception")
        after its work is done; every live group is therefore closed at exit (`_close_live_groups`)."""
        self.pg = self.store = None


_LIVE_GROUPS: "weakref.WeakSet[SyncGroup]" = weakref.WeakSet()


@atexit.register
def _close_live_groups() -> None:
    # close() drops the only reference to the backend object, which is destroyed here while the interpreter is
    # whole, even where the SyncGroup itself sits in a reference cycle (no collection needed, which at exit would
    # scan every object the run allocated).
    for group in list(_LIVE_GROUPS):
        group.close()


def init_sync_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    device: torch.device | str | None = None,
) -> SyncGroup:
    """Join (rank 0 hosts) a standalone weight-sync group on host:port. Every member calls this.

    Built on a TCPStore plus a backend object, not `init_process_group`, so trainer ranks and
    engine workers that already have a default group can form a second one.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(f"jetrl_weight_sync/{host}:{port}", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        dev = torch.device(device or "cpu")
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        dev = torch.device(device or f"cuda:{torch.cuda.current_device()}")
    else:
        raise ValueError(f"weight-sync backend must be 'gloo' or 'nccl', got {backend!r}")
    group = SyncGroup(pg, rank, world_size, backend, dev, store)
    _LIVE_GROUPS.add(group)
    return group


_ALIGN = 16  # byte alignment of every tensor inside a bucket (so uint8 views re-type cleanly)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def pack_sync_buckets(
    tensors: Iterable[SyncTensor],
    device: torch.device | str,
    bucket_bytes: int = 256 << 20,
    stats: SyncStats | None = None,
) -> Iterator[tuple[list[dict], torch.Tensor]]:
    """Pack SyncTensors into uint8 payloads on `device`, each with its entries (names, offsets, dtypes, shapes: JSON);
    a payload is yielded once it holds `bucket_bytes` or the tensors run out. Send or share each before asking for
    the next: under ZeRO-3 the tensors are released as the iterator moves on. `stats` counts what was packed."""
    entries: list[dict] = []
    chunks: list[torch.Tensor] = []
    size = 0

    def put(raw: torch.Tensor, t: torch.Tensor) -> dict:
        nonlocal size
        meta = {"offset": size, "nbytes": raw.numel(), "dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
        chunks.append(raw)
        size += -(-raw.numel() // _ALIGN) * _ALIGN
        return meta

    def payload() -> torch.Tensor:
        out = torch.zeros(size, dtype=torch.uint8, device=device)
        off = 0
        for c in chunks:
            out[off : off + c.numel()].copy_(c)
            off += -(-c.numel() // _ALIGN) * _ALIGN
        if stats is not None:
            stats.buckets += 1
        return out

    for t in tensors:
        if stats is not None:
            stats.add(t)
        entry = {"name": t.name, "data": put(_raw(t.data), t.data)}
        if t.scale is not None:
            entry["scale"] = put(_raw(t.scale), t.scale)
            entry["block"] = list(t.block) if t.block is not None else None
        entries.append(entry)
        if size >= bucket_bytes:
            yield entries, payload()
            entries, chunks, size = [], [], 0
    if entries:
        yield entries, payload()


def unpack_sync_bucket(entries: Sequence[Mapping[str, Any]], payload: torch.Tensor) -> list[SyncTensor]:
    """The SyncTensors of one packed bucket, as views into `payload`: install (copy) them before it is reused."""
    out = []
    for e in entries:
        scale = _view(payload, e["scale"]) if "scale" in e else None
        block = tuple(e["block"]) if e.get("block") else None
        out.append(SyncTensor(e["name"], _view(payload, e["data"]), scale, block))
    return out


def _send_bucket(group: SyncGroup, src: int, entries: list[dict], payload: torch.Tensor) -> None:
    header = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8)
    sizes = torch.tensor([header.numel(), payload.numel()], dtype=torch.int64, device=group.device)
    group.broadcast(sizes, src)
    group.broadcast(header.to(group.device), src)
    group.broadcast(payload, src)


def broadcast_sync_tensors(
    tensors: Iterable[SyncTensor],
    group: SyncGroup,
    src: int = 0,
    bucket_bytes: int = 256 << 20,
) -> SyncStats:
    """Send SyncTensors from rank `src` to every other member (who call `receive_sync_tensors`).

    FP8 tensors travel as e4m3 bytes + fp32 scales; nothing is re-quantized on either side.
    """
    stats = SyncStats()
    t0 = time.perf_counter()
    for entries, payload in pack_sync_buckets(tensors, group.device, bucket_bytes, stats):
        _send_bucket(group, src, entries, payload)
    group.broadcast(torch.zeros(2, dtype=torch.int64, device=group.device), src)  # end of stream
    stats.seconds = time.perf_counter() - t0
    return stats


def _view(payload: torch.Tensor, meta: dict) -> torch.Tensor:
    dtype = getattr(torch, meta["dtype"])
    raw = payload[meta["offset"] : meta["offset"] + meta["nbytes"]]
    return raw.view(dtype).reshape(meta["shape"])


def receive_sync_tensors(group: SyncGroup, src: int = 0) -> Iterator[list[SyncTensor]]:
    """Receive what `broadcast_sync_tensors` sends: yields one list of SyncTensors per bucket.

    The tensors are views into the bucket buffer: install (copy) them before asking for the next bucket.
    """
    while True:
        sizes = torch.zeros(2, dtype=torch.int64, device=group.device)
        group.broadcast(sizes, src)
        header_len, payload_len = (int(v) for v in sizes.tolist())
        if header_len == 0:
            return
        header = torch.zeros(header_len, dtype=torch.uint8, device=group.device)
        group.broadcast(header, src)
        entries = json.loads(bytes(header.cpu().numpy().tobytes()).decode())
        payload = torch.zeros(payload_len, dtype=torch.uint8, device=group.device)
        group.broadcast(payload, src)
        yield unpack_sync_bucket(entries, payload)


def broadcast_json(group: SyncGroup, obj: Any, src: int) -> Any:
    """Broadcast a JSON-serializable object from `src` (which passes it) to every member (who pass None).

    Small control data only (e.g. an engine's digests back to the trainer).
    """
    if group.rank == src:
        raw = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(group.device)
        n = torch.tensor([raw.numel()], dtype=torch.int64, device=group.device)
        group.broadcast(n, src)
        group.broadcast(raw, src)
        return obj
    n = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast(n, src)
    raw = torch.zeros(int(n.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(raw, src)
    return json.loads(bytes(raw.cpu().numpy().tobytes()).decode())
