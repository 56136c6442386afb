"""The vLLM classes of the `jetrl_fp8` method: its quantization config and linear method.

Imported only by `vllm_plugin.register()` (and by code running inside a vLLM worker), because it
imports vLLM at module level. What the method does is described in `vllm_plugin`'s docstring.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethodBase,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from .. import ops
from ..formats import QuantizedTensor
from ..gemm import resolve_backend, resolve_decode_backend
from ..gemm.dispatch import ROLLOUT_DECODE_MAX_M
from ..recipe import RecipeError
from .engine_linear import FUSED_DECODE, FUSED_DECODE_MAX_M, EngineLinear
from .vllm_plugin import QUANT_NAME, JetFp8Settings, Scope, plan_quant_groups

__all__ = ["JetFp8Config", "JetFp8LinearMethod", "JetKVCacheMethod", "shard_window", "local_window", "check_aligned", "captured_batch_max"]

logger = logging.getLogger(__name__)
_logged: set = set()

# shard ids vLLM's loaders pass for the parts of fused projections
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


class JetFp8Config(QuantizationConfig):
    """vLLM quantization config for `jetrl_fp8`.

    Built from the HF config's quantization_config when it carries one (`engine_kwargs`); the bare
    method name (`LLM(model, quantization="jetrl_fp8")`, `vllm serve --quantization jetrl_fp8`)
    means the unified `jet_fp8` recipe on the rollout side.
    """

    def __init__(self, settings: JetFp8Settings | None = None) -> None:
        super().__init__()
        self.settings = settings if settings is not None else JetFp8Settings.default()
        _forget_cached_rotaries()

    def get_name(self) -> str:
        return QUANT_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # the emulated backend runs anywhere; faster backends are picked at run time

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "JetFp8Config":
        return cls(JetFp8Settings.from_dict(config))

    def keeps_high_precision(self, prefix: str) -> bool:
        return self.settings.keeps_high_precision(prefix)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        bitwise = self.settings.bitwise
        if bitwise and isinstance(layer, VocabParallelEmbedding):  # embed_tokens and lm_head (ParallelLMHead)
            from .vllm_bitwise import InvariantEmbeddingMethod

            return InvariantEmbeddingMethod()
        if isinstance(layer, Attention) and self.settings.recipe.kv_cache == "e4m3":
            return JetKVCacheMethod(self)
        if not isinstance(layer, LinearBase):
            return None  # embeddings, lm_head, attention: vLLM's unquantized defaults
        if not self.settings.fprop.weight.is_fp8 or self.keeps_high_precision(prefix):
            if bitwise:
                from .vllm_bitwise import InvariantLinearMethod

                return InvariantLinearMethod()
            return UnquantizedLinearMethod()
        return JetFp8LinearMethod(self.settings, prefix)


class JetKVCacheMethod(BaseKVCacheMethod):
    """The recipe's e4m3 KV cache as the trainer mirrors it (`jetrl_precision.kv_cache`): scale 1.0, and attention
    on the dequantized keys and values with the query kept in the model's dtype.

    vLLM's FP8-cache attention on CUDA (its Triton backend, FlashAttention-3) would also round the query, and with it
    the probabilities, to e4m3: a function the trainer's attention does not compute. Dropping the layer's query
    quantizer after loading (before the forward is compiled) keeps both sides on one function."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        dtype = str(layer.kv_cache_dtype)
        if dtype not in ("fp8", "fp8_e4m3"):
            raise RecipeError(
                f"jetrl_fp8: the recipe's kv_cache e4m3 needs the engine built with kv_cache_dtype='fp8_e4m3' "
                f"(vllm_engine sets it), but {getattr(layer, 'layer_name', 'an attention layer')} has {dtype!r}"
            )
        scales = (float(layer._k_scale_float), float(layer._v_scale_float))
        if scales != (1.0, 1.0) or getattr(layer, "calculate_kv_scales", False):
            raise RecipeError(
                f"jetrl_fp8: the trainer mirrors an e4m3 KV cache with scale 1.0; this engine's k/v scales are {scales} "
                "(from the checkpoint, or calculate_kv_scales): use a checkpoint without kv scales and leave "
                "calculate_kv_scales off"
            )
        layer.query_quant = None
        from .vllm_kv_attention import install_kv_decode

        install_kv_decode(layer)


class JetFp8LinearMethod(LinearMethodBase):
    """FP8 linear with our quantizer and GEMM dispatch.

    Weights stay in place after loading, so the weight sync overwrites bytes and scales directly;
    `EngineLinear` holds what the forward derives from them (the GEMM's scale layout) and is
    refreshed in place after every install, so captured CUDA graphs keep reading valid buffers.
    """

    def __init__(self, settings: JetFp8Settings, prefix: str) -> None:
        super().__init__()
        self.settings = settings
        self.fprop = settings.fprop
        self.scope: Scope = settings.weight_quant_scope
        self.prefix = prefix
        self._backends: dict[str, str] = {}

    # -- weights ----------------------------------------------------------------------------------
    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        spec = self.fprop.weight
        n, k = sum(output_partition_sizes), input_size_per_partition
        groups, srows, scols = plan_quant_groups(list(output_partition_sizes), k, spec, self.scope)
        weight = Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
        scale = Parameter(torch.empty(srows, scols, dtype=torch.float32), requires_grad=False)
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)
        layer.jetrl_part_sizes = list(output_partition_sizes)
        layer.jetrl_in_features = k
        layer.jetrl_groups = groups
        layer.jetrl_hp_dtype = params_dtype
        layer.jetrl_gemm = None
        # vLLM's loaders call param.weight_loader(param, tensor[, shard_id]); ours quantizes.
        method = self

        def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: Any = None) -> None:
            method.load_hp_weight(layer, param, loaded_weight, loaded_shard_id)

        weight.weight_loader = weight_loader
        weight.input_dim, weight.output_dim = 1, 0
        if self.scope == "fused":
            layer.jetrl_staging = torch.zeros(n, k, dtype=params_dtype)
            layer.jetrl_staged = set()

    def load_hp_weight(self, layer: torch.nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """Quantize a checkpoint (or synced high-precision) weight part into the FP8 parameter."""
        part = _part_index(layer, shard_id)
        if part is None:
            if len(layer.jetrl_part_sizes) > 1:
                # a checkpoint that stores the projection already fused (e.g. Phi-3): split into parts
                if getattr(layer, "tp_size", 1) != 1:
                    raise NotImplementedError(f"jetrl_fp8: {layer.prefix}: a fused checkpoint tensor with tensor parallelism")
                for i, chunk in enumerate(torch.split(loaded, layer.jetrl_part_sizes)):
                    self.load_hp_weight(layer, param, chunk, i)
                return
            part = 0
        r0, nr, c0, nc = shard_window(layer, part, tuple(loaded.shape))
        w = loaded.narrow(0, r0, nr).narrow(1, c0, nc).to(device=param.device, dtype=layer.jetrl_hp_dtype)
        expected = (layer.jetrl_part_sizes[part], layer.jetrl_in_features)
        if tuple(w.shape) != expected:
            raise ValueError(f"jetrl_fp8: {layer.prefix} part {part}: got a weight of shape {tuple(w.shape)}, expected {expected}")
        if self.scope == "fused":
            off = sum(layer.jetrl_part_sizes[:part])
            layer.jetrl_staging[off : off + w.shape[0]].copy_(w)
            layer.jetrl_staged.add(part)
            if len(layer.jetrl_staged) == len(layer.jetrl_part_sizes):
                self._quantize_staged(layer, param)
            return
        qt = ops.quantize(w, self.fprop.weight)
        self.install_group(layer, part, qt, param=param)

    def _quantize_staged(self, layer: torch.nn.Module, param: torch.Tensor | None = None) -> None:
        qt = ops.quantize(layer.jetrl_staging.to(param.device if param is not None else layer.weight.device), self.fprop.weight)
        self.install_group(layer, 0, qt, param=param)

    def install_group(self, layer: torch.nn.Module, group: int, qt: QuantizedTensor, param: torch.Tensor | None = None) -> None:
        """Copy FP8 bytes and scales of one quant group into the layer, in place (no re-quantization)."""
        g = layer.jetrl_groups[group]
        weight = layer.weight if param is None else param
        if tuple(qt.data.shape) != (g.rows, layer.jetrl_in_features) or tuple(qt.block) != g.block:
            raise ValueError(
                f"jetrl_fp8: {layer.prefix} group {group}: got FP8 data {tuple(qt.data.shape)} block {qt.block}, "
                f"expected {(g.rows, layer.jetrl_in_features)} block {g.block}"
            )
        weight.data[g.row_offset : g.row_offset + g.rows].copy_(qt.data)
        layer.weight_scale.data[g.scale_row_offset : g.scale_row_offset + g.scale_rows].copy_(qt.scale)
        if layer.jetrl_gemm is not None:
            layer.jetrl_gemm.refresh()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Nothing to repack: the forward reads the logical layout. Fused scope quantizes once all parts are in.
        if self.scope == "fused" and len(layer.jetrl_staged) == len(layer.jetrl_part_sizes):
            self._quantize_staged(layer)
        # Resolve the backend and derive the GEMM's operands now, not in apply(): torch.compile must not
        # trace the dispatch registry, and eager calls should not pay for it.
        groups = [(g.rows, g.scale_rows, g.block[0]) for g in layer.jetrl_groups]
        device = layer.weight.device
        decode, decode_max = self.decode_backend_for(device)
        layer.jetrl_gemm = EngineLinear(
            layer.weight, layer.weight_scale, groups, layer.jetrl_groups[0].block[1], self.fprop.input,
            self.backend_for(device), decode or "", decode_max,
            # an eager engine's decode steps wait on host time: one C++ call per projection (`engine_native`)
            native=captured_batch_max() == 0 and device.type == "cuda",
        )

    # -- views used by the weight sync and the digests ---------------------------------------------
    def group_tensor(self, layer: torch.nn.Module, group: int) -> QuantizedTensor:
        g = layer.jetrl_groups[group]
        return QuantizedTensor(
            layer.weight.data[g.row_offset : g.row_offset + g.rows],
            layer.weight_scale.data[g.scale_row_offset : g.scale_row_offset + g.scale_rows],
            g.block,
        )

    def backend_for(self, device: torch.device) -> str:
        key = str(device)
        if key not in self._backends:
            # a bitwise engine asks for triton_invariant; resolve_backend refuses it where it cannot run
            self._backends[key] = resolve_backend(self.settings.gemm_backend, device, role="rollout")
        return self._backends[key]

    def decode_backend_for(self, device: torch.device) -> tuple[str | None, int]:
        """(backend, largest M) of decode-sized batches where `auto` picks a backend other than `backend_for`'s, else
        (None, 0): that backend at every M.

        DeepGEMM only takes batches that vLLM replays from captured CUDA graphs: it compiles a kernel per tiling at
        first use (the capture's warm-up does that before the engine serves), and an eager engine ran slower with it
        even with every tiling compiled at load (docs/vllm.md has the measurement): host-bound decode steps pay for
        its calls, which a replay skips. An eager engine takes `_eager_decode_backend`'s choice instead.
        """
        captured = captured_batch_max()
        if captured == 0:
            return self._eager_decode_backend(device)
        decode = resolve_decode_backend(self.settings.gemm_backend, device, self.backend_for(device))
        if decode is None:
            return None, 0
        max_m = ROLLOUT_DECODE_MAX_M if captured is None else min(ROLLOUT_DECODE_MAX_M, captured)
        if ("decode", max_m) not in _logged:
            _logged.add(("decode", max_m))
            logger.info("jetrl_fp8: decode batches of up to %d rows run %s (compiled while vLLM captures its CUDA "
                        "graphs), larger ones %s", max_m, decode, self.backend_for(device))
        return decode, max_m

    def _eager_decode_backend(self, device: torch.device) -> tuple[str | None, int]:
        """An eager engine's decode GEMM under `auto`: cuBLASLt (the trainer's GEMM), unless asked for
        - JETRL_EAGER_FUSED=1: the one-launch FP8 linear up to FUSED_DECODE_MAX_M rows (`kernels.quant_gemm`: the
          activation quantized inside the batch-invariant GEMM);
        - JETRL_EAGER_CUTLASS=1: vLLM's CUTLASS blockwise kernel (`vllm_cutlass`, checked at first use).
        Both opt-in: they accumulate differently from the trainer's GEMM, and neither has shown the eager engine
        faster (docs/vllm.md)."""
        backend = self.backend_for(device)
        if self.settings.gemm_backend != "auto" or backend != "torch" or device.type != "cuda":
            return None, 0
        if os.environ.get("JETRL_EAGER_FUSED", "0") == "1":
            if "eager_fused" not in _logged:
                _logged.add("eager_fused")
                logger.info("jetrl_fp8: eager engine (JETRL_EAGER_FUSED=1): decode batches of up to %d rows run the FP8 "
                            "linear in one launch (activation quantized inside the GEMM), larger ones %s", FUSED_DECODE_MAX_M, backend)
            return FUSED_DECODE, FUSED_DECODE_MAX_M
        if os.environ.get("JETRL_EAGER_CUTLASS", "0") != "1":
            if "eager" not in _logged:
                _logged.add("eager")
                logger.info("jetrl_fp8: eager engine (no CUDA graphs): every GEMM runs %s (DeepGEMM takes decode batches only "
                            "under CUDA graphs; JETRL_EAGER_CUTLASS=1 tries vLLM's CUTLASS kernel for them)", backend)
            return None, 0
        from . import vllm_cutlass

        why = vllm_cutlass.unusable_reason(device)
        if ("eager", why) not in _logged:
            _logged.add(("eager", why))
            if why:
                logger.warning("jetrl_fp8: JETRL_EAGER_CUTLASS=1, but vLLM's CUTLASS kernel is not used on %s: %s; decode "
                               "GEMMs stay on %s", device, why, backend)
            else:
                logger.info("jetrl_fp8: eager engine (JETRL_EAGER_CUTLASS=1): decode batches of up to %d rows run vLLM's "
                            "CUTLASS blockwise kernel, larger ones %s", ROLLOUT_DECODE_MAX_M, backend)
        return (None, 0) if why else (vllm_cutlass.NAME, ROLLOUT_DECODE_MAX_M)

    # -- forward ------------------------------------------------------------------------------------
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        gemm: EngineLinear | None = layer.jetrl_gemm
        if gemm is None:  # a forward before process_weights_after_loading (vLLM never does this)
            raise RuntimeError(f"jetrl_fp8: {self.prefix}: forward before the weights were processed")
        x2 = x.reshape(-1, x.shape[-1])
        if torch.compiler.is_compiling():
            # One opaque custom op: torch.compile and CUDA graphs (vLLM's default on GPU) see a single node
            # whose output layout is declared, instead of tracing our quantizer and GEMM dispatch.
            y = torch.ops.jetrl.fp8_linear(x2, layer.weight, layer.weight_scale, *gemm.op_args)
        else:
            y = gemm(x2)  # eager: the same computation without the dispatcher's hop
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def captured_batch_max() -> int | None:
    """The largest batch the engine being built replays from captured CUDA graphs: 0 when it captures none (eager),
    None outside an engine's construction (no vLLM config is current)."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    if cfg is None:
        return None
    cc = cfg.compilation_config
    mode = getattr(cc, "cudagraph_mode", None)
    if getattr(cfg.model_config, "enforce_eager", False) or mode is None or getattr(mode, "name", "") == "NONE":
        return 0
    sizes = getattr(cc, "cudagraph_capture_sizes", None) or []
    return int(max(sizes)) if sizes else int(getattr(cc, "max_cudagraph_capture_size", 0) or 0)


def _forget_cached_rotaries() -> None:
    """vLLM caches rotary modules per process by shape (`get_rope`), not by engine; a bitwise engine's rotary
    (vllm_bitwise) must not serve an ordinary engine built later in the process, nor the reverse."""
    try:
        from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT
    except ImportError:  # another vLLM layout: nothing cached where we look
        return
    _ROPE_DICT.clear()


# ---- tensor-parallel shards ---------------------------------------------------------------------
def _part_index(layer: torch.nn.Module, shard_id: Any) -> int | None:
    if shard_id is None:
        return None
    if isinstance(shard_id, str):
        if shard_id not in _QKV_SHARDS:
            raise ValueError(f"jetrl_fp8: unknown shard id {shard_id!r} for {layer.prefix}")
        return _QKV_SHARDS[shard_id]
    if isinstance(shard_id, tuple):
        raise NotImplementedError(f"jetrl_fp8: {layer.prefix}: loading several fused parts at once is not supported")
    return int(shard_id)


def shard_window(layer: torch.nn.Module, part: int, full_shape: tuple[int, int]) -> tuple[int, int, int, int]:
    """(row_start, rows, col_start, cols) of this TP rank's slice of a full checkpoint part."""
    n_full, k_full = full_shape
    tp_size, tp_rank = getattr(layer, "tp_size", 1), getattr(layer, "tp_rank", 0)
    rows = layer.jetrl_part_sizes[part]
    cols = layer.jetrl_in_features
    if tp_size == 1:
        return 0, n_full, 0, k_full
    if isinstance(layer, ColumnParallelLinear):
        shard_rank = tp_rank
        if isinstance(layer, QKVParallelLinear) and part > 0:
            shard_rank = tp_rank // layer.num_kv_head_replicas  # kv heads replicated when tp > kv heads
        return shard_rank * rows, rows, 0, k_full
    if isinstance(layer, RowParallelLinear):
        return 0, n_full, tp_rank * cols, cols
    return 0, n_full, 0, k_full


def local_window(layer: torch.nn.Module, part: int | None, local_shape: tuple[int, int], pname: str = "weight") -> tuple[tuple[int, int], tuple[int, int]]:
    """(full 2-D shape, offset) of what this TP rank holds of a checkpoint part, from its local [rows, cols]:
    `shard_window` run backwards. Column-parallel layers split rows (k/v heads may be replicated over ranks),
    row-parallel weights split columns; their biases and everything else are whole on every rank."""
    rows, cols = local_shape
    tp_size, tp_rank = getattr(layer, "tp_size", 1), getattr(layer, "tp_rank", 0)
    if tp_size == 1:
        return (rows, cols), (0, 0)
    if isinstance(layer, ColumnParallelLinear):
        replicas = layer.num_kv_head_replicas if isinstance(layer, QKVParallelLinear) and (part or 0) > 0 else 1
        return (rows * (tp_size // replicas), cols), ((tp_rank // replicas) * rows, 0)
    if isinstance(layer, RowParallelLinear) and pname == "weight":
        return (rows, cols * tp_size), (0, tp_rank * cols)
    return (rows, cols), (0, 0)


def check_aligned(layer: torch.nn.Module, what: str, start: int, length: int, full: int, block: int) -> None:
    if start % block or (length % block and start + length != full):
        raise ValueError(
            f"jetrl_fp8: {layer.prefix}: the tensor-parallel slice {what}[{start}:{start + length}] of {full} does not "
            f"start/end on a {block}-block boundary, so its FP8 blocks would differ from training. "
            "Use a tensor_parallel_size that keeps shards multiples of 128."
        )

