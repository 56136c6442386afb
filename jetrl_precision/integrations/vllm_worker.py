"""Helpers that run inside a vLLM worker: FP8 weight install, digests, the rollout precision graph.

Every function takes the vLLM worker as its first argument, so it can be passed to
`LLM.collective_rpc(fn, args=...)`; `JetRLWorkerExtension` exposes the same functions as
worker methods (`worker_extension_cls`), so string RPCs work with any executor, including
multi-process ones where callables would have to be pickled.

FP8 install: a SyncTensor named like a training parameter (`model.layers.0.self_attn.k_proj.weight`)
is mapped to its vLLM parameter (the `k` part of `qkv_proj`) and its e4m3 bytes and fp32
scales are copied in place. Nothing is re-quantized, so the engine holds the trainer's bytes.
High-precision tensors (embeddings, norms, lm_head, biases; all weights of an fp8_rollout
trainer) go through vLLM's own loaders: into `jetrl_fp8` layers that means our quantizer with
the recipe's rollout spec; engines without our plugin use vLLM's layer-wise `reload_weights`
(vLLM-CPU repacks unquantized linear weights, so plain `load_weights` fails there).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..digests import DigestPart, DigestPartsError, combine_digest_parts, digest_part, shape_2d
from ..formats import QuantizedTensor
from ..graph import FUSED_PROJECTIONS, EdgeAttrs, PrecisionGraph, add_linear, canonical_name, first_unaligned_part
from ..kv_cache import KV_AUTO, ROUNDING, e4m3_label
from ..ops import kernel_name
from ..recipe import FpropSpec
from ..weight_sync import (
    SyncTensor,
    WeightSyncError,
    broadcast_json,
    digest,
    init_sync_group,
    receive_sync_tensors,
    unpack_sync_bucket,
)
from .vllm_plugin import jetrl_method_of

__all__ = [
    "install_sync_tensors",
    "read_weights",
    "build_rollout_graph",
    "init_weight_sync_group",
    "receive_weights",
    "JetRLWorkerExtension",
    "HeldTensor",
    "weight_digest_parts",
    "merge_digest_answers",
    "assemble_held",
]

logger = logging.getLogger(__name__)

# training part name -> (fused vLLM module name, part index)
_PART_OF: dict[str, tuple[str, int]] = {p: (fused, i) for fused, parts in FUSED_PROJECTIONS.items() for i, p in enumerate(parts)}


def _model(worker: Any) -> nn.Module:
    return worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model


def _resolve(model: nn.Module, name: str) -> tuple[nn.Module, str, int | None] | None:
    """(vLLM module, parameter name, fused part index or None) for a training parameter name."""
    module_name, _, pname = name.rpartition(".")
    try:
        return model.get_submodule(module_name), pname, None
    except AttributeError:
        pass
    parent, _, leaf = module_name.rpartition(".")
    if leaf in _PART_OF:
        fused, part = _PART_OF[leaf]
        try:
            return model.get_submodule(f"{parent}.{fused}" if parent else fused), pname, part
        except AttributeError:
            return None
    return None


def _shard_of(layer: nn.Module, part: int, qt: QuantizedTensor) -> QuantizedTensor:
    """This tensor-parallel rank's slice of a full FP8 part (exact when shards align to blocks)."""
    from .vllm_quant import check_aligned, shard_window

    r0, nr, c0, nc = shard_window(layer, part, tuple(qt.data.shape))
    if (r0, nr, c0, nc) == (0, qt.data.shape[0], 0, qt.data.shape[1]):
        return qt
    b0, b1 = qt.block
    check_aligned(layer, "rows", r0, nr, qt.data.shape[0], b0)
    check_aligned(layer, "cols", c0, nc, qt.data.shape[1], b1)
    data = qt.data[r0 : r0 + nr, c0 : c0 + nc]
    scale = qt.scale[r0 // b0 : -(-(r0 + nr) // b0), c0 // b1 : -(-(c0 + nc) // b1)]
    return QuantizedTensor(data, scale, qt.block)


def _whole_fused(layer: nn.Module, part: int | None, rows: int) -> bool:
    """Whether a training tensor is a fused projection whole (a checkpoint that stores qkv_proj / gate_up_proj
    fused, as Phi-3's does), not one part of it."""
    sizes = getattr(layer, "jetrl_part_sizes", None)
    return part is None and sizes is not None and len(sizes) > 1 and rows == sum(sizes)


def _split_parts(layer: nn.Module, qt: QuantizedTensor, name: str) -> list[QuantizedTensor]:
    """The parts of a fused FP8 projection quantized as one matrix. Exact when every part starts on a block
    row (then no block straddles two parts and each part's blocks are its own quantization's)."""
    if getattr(layer, "tp_size", 1) != 1:
        raise WeightSyncError(f"FP8 weight {name}: a projection fused in the checkpoint cannot be split over tensor-parallel ranks yet")
    b0 = qt.block[0]
    if first_unaligned_part(layer.jetrl_part_sizes, b0) is not None:
        raise WeightSyncError(
            f"FP8 weight {name}: the trainer quantized the fused projection as one matrix, and its part sizes "
            f"{list(layer.jetrl_part_sizes)} put a {b0}-row block across two parts, so the engine's per-part "
            f"blocks cannot hold those bytes; part sizes must be multiples of {b0} (real models' are)"
        )
    parts, row = [], 0
    for rows in layer.jetrl_part_sizes:
        parts.append(QuantizedTensor(qt.data[row : row + rows], qt.scale[row // b0 : -(-(row + rows) // b0)], qt.block))
        row += rows
    return parts


def _install_fp8(model: nn.Module, t: SyncTensor) -> None:
    target = _resolve(model, t.name)
    if target is None:
        raise WeightSyncError(f"FP8 weight {t.name}: no matching module in the vLLM model")
    layer, pname, part = target
    method = jetrl_method_of(layer)
    if method is None or pname != "weight":
        raise WeightSyncError(
            f"FP8 weight {t.name} arrived, but {getattr(layer, 'prefix', type(layer).__name__)} does not run the "
            f"jetrl_fp8 method (quant method: {type(getattr(layer, 'quant_method', None)).__name__}). "
            "Build the engine with the recipe's jetrl_fp8 quantization, or sync high-precision weights (fp8=False)."
        )
    if method.scope != "per_part":
        raise WeightSyncError(
            f"{layer.prefix} quantizes the fused projection as one matrix (weight_quant_scope=fused): the trainer's "
            "per-part FP8 bytes cannot be installed without re-quantizing. Use weight_quant_scope=per_part."
        )
    block = method.fprop.weight.granularity.block(tuple(t.data.shape))
    if t.block is not None and tuple(t.block) != tuple(block):
        raise WeightSyncError(f"FP8 weight {t.name}: trainer block {tuple(t.block)} != engine block {block}")
    qt = QuantizedTensor(t.data.to(layer.weight.device), t.scale.to(layer.weight.device), tuple(block))
    if _whole_fused(layer, part, qt.data.shape[0]):
        for i, piece in enumerate(_split_parts(layer, qt, t.name)):
            method.install_group(layer, i, piece)
        return
    part = part or 0
    method.install_group(layer, part, _shard_of(layer, part, qt))


def _unquantized_packed(layer: nn.Module) -> bool:
    """A linear whose weight vLLM-CPU moved into a packed kernel handle (no loader left to call)."""
    w = getattr(layer, "weight", None)
    return jetrl_method_of(layer) is None and isinstance(w, torch.Tensor) and w.numel() == 0


def _refresh_embeddings(model: nn.Module) -> None:
    # vLLM-CPU keeps a packed copy of lm_head for its GEMM: rebuild it after the weight changed. The digests read
    # the weight, not this copy: a stale copy shows only in the rollout-train mismatch.
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for m in model.modules():
        if isinstance(m, VocabParallelEmbedding) and hasattr(m.quant_method, "process_weights_after_loading"):
            m.quant_method.process_weights_after_loading(m)


def _records(model: nn.Module) -> dict[str, tuple[str, str | None]]:
    if not hasattr(model, "_jetrl_sync_records"):
        model._jetrl_sync_records = {}
    return model._jetrl_sync_records


def install_sync_tensors(worker: Any, tensors: Iterable[SyncTensor]) -> dict[str, int]:
    """Install SyncTensors into the live model: FP8 bytes in place, high-precision via vLLM's loaders.

    A high-precision tensor the engine cannot hold as sent (quantized by our loader for
    fp8_rollout, cast to the engine's dtype, or packed by vLLM-CPU) leaves a record: the digest of
    what arrived and the digest of what it became. `weight_digest_parts` then answers with the arrived
    digest while the held bytes are unchanged, so the trainer compares what it sent against what
    the engine keeps, in every mode.
    """
    model = _model(worker)
    records = _records(model)
    hp: list[tuple[str, torch.Tensor]] = []
    pending: list[tuple[str, str]] = []
    needs_reload = False
    counts = {"fp8": 0, "hp": 0}
    with torch.no_grad():
        for t in tensors:
            if t.scale is not None:
                _install_fp8(model, t)
                records.pop(t.name, None)
                counts["fp8"] += 1
                continue
            target = _resolve(model, t.name)
            transformed = target is None
            if target is not None:
                layer, pname, _ = target
                packed = pname == "weight" and _unquantized_packed(layer)
                needs_reload |= packed
                p = getattr(layer, pname, None)
                # No tensor under the training name: vLLM's loader lays it out anew (MoE experts become FusedMoE's
                # stacked w13/w2), so only its arrival can be digested.
                transformed = not isinstance(p, torch.Tensor) or packed or (pname == "weight" and jetrl_method_of(layer) is not None) or (
                    p.dtype != t.data.dtype
                )
            if transformed:
                pending.append((t.name, digest(t.data)))
            else:
                records.pop(t.name, None)
            hp.append((t.name, t.data))
            counts["hp"] += 1
        if hp:
            if needs_reload:
                worker.reload_weights(weights_iterator=iter(hp))
            else:
                model.load_weights(iter(hp))
            # Both paths: a tied lm_head is in no checkpoint, so the reload puts its old packed copy back while
            # the shared weight moves on (the engine sampled from the previous step's head).
            _refresh_embeddings(model)
        unreadable = []
        for name, sent in pending:
            records[name] = (sent, _held_digest(model, name))
            if records[name][1] is None:
                unreadable.append(name)
        if unreadable and not getattr(model, "_jetrl_unreadable_logged", False):
            model._jetrl_unreadable_logged = True
            logger.warning(
                "vLLM engine: %d synced tensor(s) cannot be read back under their training names (e.g. %s): the "
                "digest check verifies what arrived for them, not the engine's copy", len(unreadable), unreadable[0])
    return counts


# ---- inspection ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeldTensor:
    """What one engine worker holds for a training name: the whole tensor, or this tensor-parallel rank's
    window of it. `full` and `offset` are in elements of the whole tensor's 2-D view (1-D: [n, 1]); an FP8
    weight's scale window follows from its `block`."""

    data: torch.Tensor
    full: tuple[int, int]
    offset: tuple[int, int] = (0, 0)
    scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None

    @classmethod
    def whole(cls, data: torch.Tensor, scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> "HeldTensor":
        return cls(data, shape_2d(data), scale=scale, block=block)

    def parts(self) -> tuple[DigestPart, DigestPart | None]:
        data = digest_part(self.data, self.full, self.offset)
        if self.scale is None:
            return data, None
        b0, b1 = self.block
        (n, k), (r0, c0) = self.full, self.offset
        scale = digest_part(self.scale, (-(-n // b0), -(-k // b1)), (r0 // b0, c0 // b1))
        return data, scale

    def local_digest(self) -> str:
        """Digest of this worker's bytes alone (whether they changed since an install)."""
        return digest(self.data) if self.scale is None else f"{digest(self.data)}:{digest(self.scale)}"

    def to_cpu(self) -> "HeldTensor":
        return dataclasses.replace(
            self, data=self.data.detach().cpu().clone(), scale=None if self.scale is None else self.scale.detach().cpu().clone()
        )


def _held(model: nn.Module, name: str) -> HeldTensor | None:
    """What this worker holds for a training parameter name; None when it cannot say."""
    from .vllm_quant import local_window

    target = _resolve(model, name)
    if target is None:
        return None
    layer, pname, part = target
    tp = getattr(layer, "tp_size", 1)
    method = jetrl_method_of(layer)
    if method is not None and pname == "weight" and method.scope == "per_part" and part is None and len(layer.jetrl_groups) > 1:
        # A fused projection asked for whole (its checkpoint stores it fused): the parts' blocks, stacked, are the
        # one-matrix quantization when every part starts on a block row; otherwise there is no such tensor.
        # (Tensor-parallel engines cannot load such checkpoints: vllm_quant refuses them.)
        if tp > 1 or first_unaligned_part(layer.jetrl_part_sizes, layer.jetrl_groups[0].block[0]) is not None:
            return None
        qts = [method.group_tensor(layer, i) for i in range(len(layer.jetrl_groups))]
        return HeldTensor.whole(torch.cat([q.data for q in qts]), torch.cat([q.scale for q in qts]), tuple(qts[0].block))
    if method is not None and pname == "weight":
        group = 0 if method.scope == "fused" else (part or 0)
        if method.scope == "fused" and (tp > 1 or (len(layer.jetrl_groups) == 1 and len(layer.jetrl_part_sizes) > 1)):
            return None  # fused blocks: a part's bytes are not a separate quantization (nor a rank's slice)
        qt = method.group_tensor(layer, group)
        full, offset = local_window(layer, part, tuple(qt.data.shape))
        return HeldTensor(qt.data, full, offset, qt.scale, tuple(qt.block))
    p = getattr(layer, pname, None)
    if not isinstance(p, torch.Tensor) or p.numel() == 0:
        return None
    if part is not None:
        sizes = getattr(layer, "output_partition_sizes", None) or getattr(layer, "output_sizes", None)
        if sizes is None:
            return None
        off = sum(sizes[:part])
        piece = p.data[off : off + sizes[part]]
    else:
        shard = getattr(layer, "shard_indices", None)  # embeddings/lm_head: this rank's vocab rows, padding dropped
        if shard is not None:
            rows = shard.org_vocab_end_index - shard.org_vocab_start_index
            return HeldTensor(p.data[:rows], (layer.org_vocab_size, p.shape[1]), (shard.org_vocab_start_index, 0))
        piece = p.data
    return HeldTensor(piece, *local_window(layer, part, shape_2d(piece), pname))


def _held_digest(model: nn.Module, name: str) -> str | None:
    """Digest of the bytes this worker holds for a training name (its window of the tensor); None if unreadable."""
    held = _held(model, name)
    return None if held is None else held.local_digest()


DigestAnswer = Union[str, tuple[DigestPart, Optional[DigestPart]], None]


def weight_digest_parts(worker: Any, names: Sequence[str]) -> dict[str, DigestAnswer]:
    """This worker's answer per name, for `merge_digest_answers`: the sums of the window it holds, or a whole
    digest where it keeps one (a tensor it transformed on install, see `install_sync_tensors`: the digest of
    what arrived while the held bytes are unchanged, else a value that cannot match), or None (cannot tell:
    a weight vLLM-CPU packed before any sync)."""
    model = _model(worker)
    records = _records(model)
    out: dict[str, DigestAnswer] = {}
    for name in names:
        if name in records:
            sent, held = records[name]
            now = _held_digest(model, name)
            out[name] = sent if (held is None or held == now) else f"modified-after-sync:{now}"
            continue
        held = _held(model, name)
        out[name] = None if held is None else held.parts()
    return out


def merge_digest_answers(per_worker: Sequence[Mapping[str, DigestAnswer]]) -> dict[str, str | None]:
    """One digest per name from every tensor-parallel worker's answer, in `weight_sync.sync_tensor_digest`
    format: the windows' sums combine into the whole tensor's digest, so the trainer compares the same
    string whatever the engine's tensor-parallel size. A worker that cannot tell makes the answer None;
    answers that do not make one tensor (a missing window, replicas that differ) become a value that cannot
    match, naming the problem."""
    out: dict[str, str | None] = {}
    for name in per_worker[0]:
        answers = [w.get(name) for w in per_worker]
        if any(a is None for a in answers):
            out[name] = None
        elif all(isinstance(a, str) for a in answers):
            out[name] = answers[0] if len(set(answers)) == 1 else f"tensor-parallel-workers-disagree:{sorted(set(answers))}"
        elif any(isinstance(a, str) for a in answers):
            out[name] = "tensor-parallel-workers-disagree: some hold a record of what arrived, some do not"
        else:
            try:
                data = combine_digest_parts([a[0] for a in answers])
                scales = [a[1] for a in answers if a[1] is not None]
                out[name] = data if not scales else f"{data}:{combine_digest_parts(scales)}"
            except DigestPartsError as e:
                out[name] = f"tensor-parallel-shards-inconsistent: {e}"
    return out


def read_weights(worker: Any, names: Sequence[str]) -> dict[str, HeldTensor | None]:
    """Host copies of what this worker holds per name: for tests and debugging, not the hot path."""
    model = _model(worker)
    out = {}
    for name in names:
        held = _held(model, name)
        out[name] = None if held is None else held.to_cpu()
    return out


def assemble_held(pieces: Sequence[HeldTensor | None]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The whole (data, scale) of one name from every worker's `read_weights` piece; None if any is missing."""
    if not pieces or any(p is None for p in pieces):
        return None
    first = pieces[0]
    if len(pieces) == 1 and first.full == shape_2d(first.data):
        return first.data, first.scale
    n, k = first.full
    data = torch.empty((n, k) if first.data.dim() > 1 else (n,), dtype=first.data.dtype)
    scale = None
    if first.scale is not None:
        b0, b1 = first.block
        scale = torch.empty(-(-n // b0), -(-k // b1), dtype=first.scale.dtype)
    for p in pieces:
        (r0, c0), rows = p.offset, p.data.shape[0]
        if data.dim() == 1:
            data[r0 : r0 + rows] = p.data
        else:
            data[r0 : r0 + rows, c0 : c0 + p.data.shape[1]] = p.data
        if scale is not None:
            b0, b1 = p.block
            scale[r0 // b0 : r0 // b0 + p.scale.shape[0], c0 // b1 : c0 // b1 + p.scale.shape[1]] = p.scale
    return data, scale


def corrupt_weight(worker: Any, name: str, flat_index: int = 0, rank: int | None = None) -> None:
    """Flip one byte of what `name` holds on worker `rank` (all workers: None), testing the digest check.
    Never call in production."""
    if rank is not None and int(getattr(worker, "rank", 0)) != rank:
        return
    held = _held(_model(worker), name)
    if held is None:
        raise KeyError(name)
    raw = held.data.view(torch.uint8).reshape(-1)
    raw[flat_index] ^= 0x01


# ---- the rollout precision graph ------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16", torch.float8_e4m3fn: "e4m3"}.get(dtype, str(dtype))


def _full_part_sizes(layer: nn.Module) -> list[int] | None:
    """The checkpoint's part sizes of a fused projection. vLLM's `output_sizes` count a K/V head once per
    tensor-parallel rank that holds it: with more ranks than KV heads, each is replicated over ranks."""
    sizes = getattr(layer, "output_sizes", None)
    if sizes is None or len(sizes) <= 1:
        return None
    replicas = getattr(layer, "num_kv_head_replicas", 1)
    return [s if i == 0 or replicas == 1 else s // replicas for i, s in enumerate(sizes)]


def _add_foreign_linear(g: PrecisionGraph, m: nn.Module, name: str, in_features: int, out_features: int, parts: list[int] | None) -> None:
    """A linear quantized by some other method: its edges name that method as the quantizer."""
    foreign = f"vllm:{type(m.quant_method).__name__}"
    before = len(g.edges)
    add_linear(g, name, in_features, out_features, FpropSpec(), None, hp_dtype=_dtype_name(m.params_dtype), backend=None, part_sizes=parts, op="linear_foreign")
    w = getattr(m, "weight", None)
    wdt = _dtype_name(w.dtype) if isinstance(w, torch.Tensor) else "unknown"
    for i in range(before, len(g.edges)):
        e = g.edges[i]
        dt = wdt if e.role == "weight" else e.attrs.dtype
        g.edges[i] = type(e)(e.dst, e.role, EdgeAttrs(dtype=dt, quantizer_id=foreign))


# Attention implementations that read an FP8 cache by dequantizing it to the query's dtype (the function the
# trainer's KV mirror computes) once no query quantizer rounds the query (JetKVCacheMethod drops it), with how their
# cache write rounds (vLLM 0.26's Triton store on CUDA; vLLM-CPU's write, measured by tests/rl/test_kv_cache_vllm.py).
_DEQUANTIZING_ATTENTION = {"TritonAttentionImpl": ROUNDING["cuda"], "KVDecodeAttentionImpl": ROUNDING["cuda"],
                           "CPUAttentionBackendImpl": ROUNDING["cpu"]}


def _attention_layers(model: torch.nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "kv_cache_dtype") and hasattr(m, "impl")]


def engine_kv_cache_label(model: torch.nn.Module) -> str:
    """What this engine's attention layers read, in the precision graph's terms (`kv_cache.KV_AUTO` / `KV_E4M3`), or
    what they do instead: the cache dtype, its scales, a quantized query, an attention kernel that multiplies in FP8."""
    labels = set()
    for m in _attention_layers(model):
        dtype = str(m.kv_cache_dtype)
        if dtype == "auto":
            labels.add(KV_AUTO)
            continue
        scales = (float(getattr(m, "_k_scale_float", 1.0)), float(getattr(m, "_v_scale_float", 1.0)))
        impl = type(m.impl).__name__
        if dtype in ("fp8", "fp8_e4m3") and scales == (1.0, 1.0) and getattr(m, "query_quant", None) is None \
                and impl in _DEQUANTIZING_ATTENTION:
            labels.add(e4m3_label(_DEQUANTIZING_ATTENTION[impl]))
        else:
            query = "e4m3" if getattr(m, "query_quant", None) is not None else "model dtype"
            labels.add(f"{dtype}/k_scale={scales[0]:g}/v_scale={scales[1]:g}/query {query}/{impl}")
    if not labels:
        return KV_AUTO
    return labels.pop() if len(labels) == 1 else f"mixed ({'; '.join(sorted(labels))})"


def engine_attention_impls(model: torch.nn.Module) -> str:
    """The attention implementations this engine's layers run (vLLM's class names; `KVDecodeAttentionImpl` is the
    e4m3 cache's split-KV decode, `vllm_kv_attention`), so a run whose fast path stayed off says so in its graph."""
    names = sorted({type(m.impl).__name__ for m in _attention_layers(model)})
    return ",".join(names) or "none"


def build_rollout_graph(worker: Any, recipe_name: str = "") -> dict:
    """The rollout PrecisionGraph of what this worker instantiated, as a dict (PrecisionGraph.to_dict()).

    jetrl_fp8 layers report their actual specs, resolved backend, quantization kernel and
    weight quantization scope; other linear layers report their weight dtype (unquantized) or
    the foreign quantization method; embeddings and norms report their dtypes.
    """
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    model = _model(worker)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    methods = sorted({type(getattr(m, "quant_method", None)).__name__ for m in model.modules() if isinstance(m, LinearBase)})
    recipe = recipe_name
    first = next((jetrl_method_of(m) for m in model.modules() if jetrl_method_of(m) is not None), None)
    if first is not None and not recipe:
        recipe = first.settings.recipe.name
    # vLLM's attention, norms and GEMM tiling depend on the batch; a bitwise engine says what it actually built.
    numerics, detail = "ordinary", "vLLM kernels (attention, norms and GEMM tiling depend on the batch)"
    settings = getattr(getattr(getattr(worker, "vllm_config", None), "quant_config", None), "settings", None)
    if getattr(settings, "bitwise", False) or getattr(getattr(first, "settings", None), "bitwise", False):
        from .vllm_bitwise import engine_numerics  # imports vLLM's layers (we are in its worker)

        numerics, detail = engine_numerics(worker, model)
    g = PrecisionGraph("rollout", recipe or "none", meta={
        "source": f"vllm:{type(model).__name__}", "linear_methods": ",".join(methods),
        "numerics": numerics, "numerics_detail": detail, "kv_cache": engine_kv_cache_label(model),
        "attention": engine_attention_impls(model),
    })
    for fqn, m in model.named_modules():
        name = canonical_name(fqn)
        if isinstance(m, LinearBase):
            method = jetrl_method_of(m)
            in_features = getattr(m, "input_size", None)
            parts = _full_part_sizes(m)
            out_features = sum(parts) if parts else getattr(m, "output_size", None)
            if method is not None:
                gemm = getattr(m, "jetrl_gemm", None)
                add_linear(
                    g, name, in_features, out_features, method.fprop, None,
                    hp_dtype=_dtype_name(m.jetrl_hp_dtype), backend=method.backend_for(device), kernel=kernel_name(device),
                    part_sizes=parts, weight_quant_scope=method.scope,
                    input_kernel=gemm.input_kernel(m.jetrl_hp_dtype) if gemm is not None and method.fprop.input.is_fp8 else None,
                )
            elif isinstance(m.quant_method, UnquantizedLinearMethod):
                add_linear(g, name, in_features, out_features, FpropSpec(), None, hp_dtype=_dtype_name(m.params_dtype), backend=None, part_sizes=parts)
            else:  # another quantization (e.g. vLLM's own fp8): not our quantizer, whatever its format
                _add_foreign_linear(g, m, name, in_features, out_features, parts)
        elif isinstance(m, ParallelLMHead):
            # a GEMM in training (nn.Linear lm_head): record it as the unquantized linear it is
            add_linear(g, name, m.embedding_dim, m.org_vocab_size, FpropSpec(), None, hp_dtype=_dtype_name(m.weight.dtype), backend=None)
        elif isinstance(m, VocabParallelEmbedding):
            dt = _dtype_name(m.weight.dtype)
            g.add_node(name, "embedding", num_embeddings=m.org_vocab_size, dim=m.embedding_dim)
            g.add_edge(name, "weight", EdgeAttrs(dtype=dt, quantizer_id=f"{dt}/none"))
        elif "norm" in type(m).__name__.lower() and not any(True for _ in m.children()):
            w = getattr(m, "weight", None)
            dt = _dtype_name(w.dtype) if isinstance(w, torch.Tensor) else "fp32"
            g.add_node(name, "norm")
            g.add_edge(name, "weight", EdgeAttrs(dtype=dt, quantizer_id=f"{dt}/none"))
    # The edges name each layer's backend; decode-sized batches may run another (auto: DeepGEMM up to M = 512).
    gemms = [m.jetrl_gemm for m in model.modules() if getattr(m, "jetrl_gemm", None) is not None]
    decode = sorted({gm.decode_gemm for gm in gemms} - {""})
    if decode:
        g.meta["decode_gemm"] = ", ".join(decode)
    if any(gm.native_asked for gm in gemms):
        # an eager engine: how many projections make one C++ call per decode-sized batch, or why none do
        from .engine_native import status as native_status

        took = sum(gm.host_call == "native" for gm in gemms)
        if took:
            g.meta["eager_linear_call"] = f"native ({took} of {len(gemms)} projections)"
        else:
            why = native_status(device)
            g.meta["eager_linear_call"] = "python (no projection has a shape it takes)" if why == "native" else why
    if any(getattr(m, "jetrl_gemm", None) is not None and m.jetrl_gemm.backend == "torch" for m in model.modules()) and device.type == "cuda":
        from ..gemm import cublaslt

        g.meta["gemm_call"] = cublaslt.call_status(device)
    return g.to_dict()


# ---- transport over a torch.distributed group -------------------------------------------------------
def init_weight_sync_group(worker: Any, host: str, port: int, rank_offset: int, world_size: int, backend: str = "gloo") -> int:
    """Join the trainer's weight-sync group as rank `rank_offset + worker rank`; returns that rank."""
    rank = rank_offset + int(getattr(worker, "rank", 0))
    device = None if backend == "gloo" else getattr(worker, "device", None)
    worker._jetrl_sync_group = init_sync_group(host, port, rank, world_size, backend, device=device)
    return rank


def receive_weights(worker: Any, src: int = 0) -> dict[str, int]:
    """Receive one broadcast of SyncTensors from `src` and install them; returns counts per kind."""
    group = getattr(worker, "_jetrl_sync_group", None)
    if group is None:
        raise WeightSyncError("receive_weights: call init_weight_sync_group on this engine first")
    total = {"fp8": 0, "hp": 0}
    for bucket in receive_sync_tensors(group, src):
        counts = install_sync_tensors(worker, bucket)
        total = {k: total[k] + counts[k] for k in total}
    return total


def receive_weights_ipc(worker: Any, entries: Sequence[Mapping[str, Any]], buckets: Mapping[str, Any]) -> dict[str, int]:
    """Install one bucket that the policy rank on this worker's GPU exported through CUDA IPC (`ipc_sync`)."""
    from ..ipc_sync import mapped_bucket

    device = getattr(worker, "device", None)
    if device is None or torch.device(device).type != "cuda":
        raise WeightSyncError(f"CUDA IPC weight sync needs a GPU worker, this one is on {device}")
    with mapped_bucket(buckets, device, f"engine worker {getattr(worker, 'rank', 0)}") as payload:
        return install_sync_tensors(worker, unpack_sync_bucket(entries, payload))


def broadcast_digests(worker: Any, digests: Mapping[str, str | None]) -> dict[str, str | None]:
    """Send an engine's digests (merged over its tensor-parallel workers by the caller) from its first worker to
    every member of the sync group; the trainer receives them with `weight_sync.broadcast_json(group, None,
    src=<the engine's first rank>)`. Every worker of the engine calls this (the broadcast is collective)."""
    group = getattr(worker, "_jetrl_sync_group", None)
    if group is None:
        raise WeightSyncError("broadcast_digests: call init_weight_sync_group on this engine first")
    src = group.rank - int(getattr(worker, "rank", 0))
    return broadcast_json(group, dict(digests) if group.rank == src else None, src=src)


class JetRLWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): string RPC names for the helpers above."""

    def jetrl_install(self, tensors: list[SyncTensor]) -> dict[str, int]:
        return install_sync_tensors(self, tensors)

    def jetrl_weight_digest_parts(self, names: Sequence[str]) -> dict[str, DigestAnswer]:
        return weight_digest_parts(self, names)

    def jetrl_read_weights(self, names: Sequence[str]) -> dict:
        return read_weights(self, names)

    def jetrl_corrupt_weight(self, name: str, flat_index: int = 0, rank: int | None = None) -> None:
        corrupt_weight(self, name, flat_index, rank)

    def jetrl_precision_graph(self, recipe_name: str = "") -> dict:
        return build_rollout_graph(self, recipe_name)

    def jetrl_init_sync_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str = "gloo") -> int:
        return init_weight_sync_group(self, host, port, rank_offset, world_size, backend)

    def jetrl_receive_weights(self, src: int = 0) -> dict[str, int]:
        return receive_weights(self, src)

    def jetrl_receive_weights_ipc(self, entries: Sequence[Mapping[str, Any]], buckets: Mapping[str, Any]) -> dict[str, int]:
        return receive_weights_ipc(self, entries, buckets)

    def jetrl_broadcast_digests(self, digests: Mapping[str, str | None]) -> dict[str, str | None]:
        return broadcast_digests(self, digests)

    def jetrl_param_names(self) -> list[str]:
        return training_param_names(self)

    def jetrl_install_bitwise_sampler(self) -> str:
        from .vllm_bitwise import install_bitwise_sampler  # imports vLLM (we are in its worker)

        return install_bitwise_sampler(self)

    def jetrl_set_bitwise_temperature(self, temperature: float) -> None:
        from .vllm_bitwise import set_bitwise_temperature

        set_bitwise_temperature(self, temperature)


def training_param_names(worker: Any) -> list[str]:
    """The training-side parameter names this engine's weights correspond to (fused parts expanded)."""
    model = _model(worker)
    names = []
    for fqn, m in model.named_modules():
        prefix = canonical_name(fqn)
        leaf = prefix.rsplit(".", 1)[-1]
        for pname, _ in m.named_parameters(recurse=False):
            if pname == "weight_scale":
                continue
            if leaf in FUSED_PROJECTIONS and _full_part_sizes(m) is not None:
                names += [f"{prefix[: -len(leaf)]}{part}.{pname}" for part in FUSED_PROJECTIONS[leaf]]
            else:
                names.append(f"{prefix}.{pname}")
    return names


__all__ += ["corrupt_weight", "training_param_names", "broadcast_digests", "engine_kv_cache_label", "engine_attention_impls"]
