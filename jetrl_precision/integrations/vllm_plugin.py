"""`jetrl_fp8`: a vLLM quantization method that runs the recipe's FP8 flow with our quantizer.

Why a plugin: the rollout engine must compute exactly what the training forward computes.
vLLM's own FP8 paths quantize with vLLM kernels (and, on Hopper, may re-quantize weights to
power-of-two scales), so their bytes differ from training. This method:

- creates e4m3 weights [N, K] and fp32 block scales in the logical layout our GEMM dispatch
  reads (per part of a fused projection: [ceil(N_i/128), ceil(K/128)] stacked by part);
- quantizes BF16/fp32 checkpoint weights at load time with `jetrl_precision.ops.quantize`
  and the recipe's rollout weight spec (no calibration, no pre-quantized checkpoint);
- quantizes activations 1x128 with the same quantizer and calls `jetrl_precision.gemm.gemm_nt`
  on the backend the recipe resolves to (emulated on CPU);
- quantizes fused qkv_proj / gate_up_proj PER PART: each part's rows form their own 128-row
  blocks, so the bytes equal the trainer's separate q/k/v/gate/up quantizations even when a
  part's N is not a multiple of 128. (`weight_quant_scope="fused"` quantizes the fused matrix
  as one, as vLLM's own block FP8 does; it exists to show what the graph check catches.)
- leaves modules matched by the recipe's keep_high_precision patterns unquantized.

The recipe travels inside the HF config's `quantization_config` (see `engine_kwargs`), so a
worker process rebuilds exactly the trainer's recipe. `register()` is the entry point
(`vllm.general_plugins: jetrl_fp8`); it is idempotent and a no-op without vLLM.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .. import ops
from ..formats import QuantizedTensor
from ..gemm import gemm_nt, resolve_backend
from ..graph import FUSED_PROJECTIONS
from ..recipe import FpropSpec, PrecisionRecipe, RecipeError, TensorSpec, get_recipe

__all__ = [
    "QUANT_NAME",
    "JetFp8Settings",
    "QuantGroup",
    "plan_quant_groups",
    "engine_kwargs",
    "register",
    "is_registered",
    "jetrl_method_of",
    "fp8_linear_forward",
    "spec_code",
    "spec_from_code",
]

logger = logging.getLogger(__name__)

QUANT_NAME = "jetrl_fp8"
Side = Literal["rollout", "train"]
Scope = Literal["per_part", "fused"]

# shard ids vLLM's loaders pass for the parts of fused projections
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


@dataclass(frozen=True)
class JetFp8Settings:
    """What the engine needs to reproduce the trainer's numerics: the recipe and which flow to run."""

    recipe: PrecisionRecipe
    side: Side = "rollout"  # "rollout": recipe.rollout; "train": recipe.train_fprop
    weight_quant_scope: Scope = "per_part"

    def __post_init__(self) -> None:
        if self.side not in ("rollout", "train"):
            raise RecipeError(f"jetrl_fp8: side must be 'rollout' or 'train', got {self.side!r}")
        if self.weight_quant_scope not in ("per_part", "fused"):
            raise RecipeError(f"jetrl_fp8: weight_quant_scope must be 'per_part' or 'fused', got {self.weight_quant_scope!r}")

    @property
    def fprop(self) -> FpropSpec:
        return self.recipe.rollout if self.side == "rollout" else self.recipe.train_fprop

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": QUANT_NAME,
            "recipe": self.recipe.to_dict(),
            "side": self.side,
            "weight_quant_scope": self.weight_quant_scope,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JetFp8Settings":
        raw = d.get("recipe", "jet_fp8")
        recipe = get_recipe(raw) if isinstance(raw, str) else PrecisionRecipe.from_dict(raw)
        return cls(recipe, d.get("side", "rollout"), d.get("weight_quant_scope", "per_part"))


def engine_kwargs(recipe: PrecisionRecipe, side: Side = "rollout", weight_quant_scope: Scope = "per_part") -> dict[str, Any]:
    """The `vllm.LLM(...)` keyword arguments that select `jetrl_fp8` with this recipe."""
    settings = JetFp8Settings(recipe, side, weight_quant_scope)
    return {"quantization": QUANT_NAME, "hf_overrides": {"quantization_config": settings.to_dict()}}


# ---- weight layout ---------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantGroup:
    """Rows of the (fused) weight that share one block grid: one part (per_part) or all (fused)."""

    row_offset: int
    rows: int
    scale_row_offset: int
    scale_rows: int
    block: tuple[int, int]


def plan_quant_groups(part_sizes: list[int], k: int, spec: TensorSpec, scope: Scope) -> tuple[list[QuantGroup], int, int]:
    """Block grids for a weight made of `part_sizes` rows (per partition) and K columns.

    Returns (groups, total scale rows, scale cols). Per part, each part's rows start a new
    row of blocks, so a part of N=64 gets its own (partial) 128-row block, as in training.
    """
    spans = [(sum(part_sizes[:i]), n) for i, n in enumerate(part_sizes)] if scope == "per_part" else [(0, sum(part_sizes))]
    groups: list[QuantGroup] = []
    srow = 0
    cols = 0
    for off, n in spans:
        b0, b1 = spec.granularity.block((n, k))
        r = -(-n // b0)
        cols = -(-k // b1)
        groups.append(QuantGroup(off, n, srow, r, (b0, b1)))
        srow += r
    return groups, srow, cols


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


def _shard_window(layer: torch.nn.Module, part: int, full_shape: tuple[int, int]) -> tuple[int, int, int, int]:
    """(row_start, rows, col_start, cols) of this TP rank's slice of a full checkpoint part."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

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


def _check_aligned(layer: torch.nn.Module, what: str, start: int, length: int, full: int, block: int) -> None:
    if start % block or (length % block and start + length != full):
        raise ValueError(
            f"jetrl_fp8: {layer.prefix}: the tensor-parallel slice {what}[{start}:{start + length}] of {full} does not "
            f"start/end on a {block}-block boundary, so its FP8 blocks would differ from training. "
            "Use a tensor_parallel_size that keeps shards multiples of 128."
        )


# ---- the forward, as one custom op ------------------------------------------------------------
def spec_code(spec: TensorSpec) -> str:
    """A TensorSpec as a string a custom op can take: "" for high precision, else "granularity|scale_rule"."""
    return f"{spec.granularity.value}|{spec.scale_rule.value}" if spec.is_fp8 else ""


def spec_from_code(code: str) -> TensorSpec:
    if not code:
        return TensorSpec()
    gran, rule = code.split("|")
    return TensorSpec("e4m3", gran, rule)


def fp8_linear_forward(
    x2: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group_rows: list[int],
    group_scale_rows: list[int],
    group_block_rows: list[int],
    block_cols: int,
    input_code: str,
    backend: str,
) -> torch.Tensor:
    """x2 [M, K] @ W^T for an e4m3 weight stored as row groups (fused parts) with their own block grids."""
    views = []
    r = sr = 0
    for rows, srows, b0 in zip(group_rows, group_scale_rows, group_block_rows):
        views.append(QuantizedTensor(weight[r : r + rows], weight_scale[sr : sr + srows], (b0, block_cols)))
        r, sr = r + rows, sr + srows
    input_spec = spec_from_code(input_code)
    if not input_spec.is_fp8:
        # W8A16 (not a named recipe): dequantize the weight, GEMM in fp32, round once.
        w = torch.cat([v.dequantize(torch.float32) for v in views])
        return (x2.float() @ w.t()).to(x2.dtype)
    xq = ops.quantize(x2, input_spec)
    b0 = group_block_rows[0]
    if len(views) == 1 or (len(set(group_block_rows)) == 1 and all(rows % b0 == 0 for rows in group_rows[:-1])):
        # the groups tile one block grid: a single GEMM over the fused weight
        return gemm_nt(xq, QuantizedTensor(weight, weight_scale, (b0, block_cols)), x2.dtype, backend)
    # a part with a partial block row (e.g. k/v of N=64): one GEMM per part, as training runs them
    return torch.cat([gemm_nt(xq, v, x2.dtype, backend) for v in views], dim=-1)


def _register_custom_op() -> None:
    if hasattr(torch.ops, "jetrl") and hasattr(torch.ops.jetrl, "fp8_linear"):
        return

    @torch.library.custom_op(
        "jetrl::fp8_linear",
        mutates_args=(),
        schema="(Tensor x, Tensor weight, Tensor weight_scale, int[] group_rows, int[] group_scale_rows, "
        "int[] group_block_rows, int block_cols, str input_code, str backend) -> Tensor",
    )
    def _op(x, weight, weight_scale, group_rows, group_scale_rows, group_block_rows, block_cols, input_code, backend):
        return fp8_linear_forward(
            x, weight, weight_scale, list(group_rows), list(group_scale_rows), list(group_block_rows), block_cols, input_code, backend
        )

    @_op.register_fake
    def _(x, weight, weight_scale, group_rows, group_scale_rows, group_block_rows, block_cols, input_code, backend):
        return x.new_empty(x.shape[0], weight.shape[0])


_register_custom_op()


# ---- the vLLM classes (defined only when vLLM is importable) ---------------------------------
_CLASSES: dict[str, type] = {}


def _build_classes() -> dict[str, type]:
    if _CLASSES:
        return _CLASSES
    from torch.nn import Parameter
    from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    class JetFp8Config(QuantizationConfig):
        """vLLM quantization config for `jetrl_fp8`; built from the HF config's quantization_config."""

        def __init__(self, settings: JetFp8Settings) -> None:
            super().__init__()
            self.settings = settings

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
            leaf = prefix.rsplit(".", 1)[-1]
            names = [prefix]
            if leaf in FUSED_PROJECTIONS:
                names += [prefix[: -len(leaf)] + p for p in FUSED_PROJECTIONS[leaf]]
            hits = [any(fnmatch.fnmatchcase(n, p) for p in self.settings.recipe.keep_high_precision) for n in names]
            if len(names) > 1 and any(hits[1:]) != all(hits[1:]):
                raise RecipeError(
                    f"jetrl_fp8: keep_high_precision keeps only some parts of the fused {prefix}; "
                    "a fused projection is quantized as a whole: keep all of its parts or none"
                )
            return any(hits)

        def get_quant_method(self, layer: torch.nn.Module, prefix: str):
            if not isinstance(layer, LinearBase):
                return None  # embeddings, lm_head, attention: vLLM's unquantized defaults
            if not self.settings.fprop.weight.is_fp8 or self.keeps_high_precision(prefix):
                return UnquantizedLinearMethod()
            return JetFp8LinearMethod(self.settings, prefix)

    class JetFp8LinearMethod(LinearMethodBase):
        """FP8 linear with our quantizer and GEMM dispatch. Weights stay in place after loading, so
        the weight sync can overwrite bytes and scales directly."""

        def __init__(self, settings: JetFp8Settings, prefix: str) -> None:
            super().__init__()
            self.settings = settings
            self.fprop = settings.fprop
            self.scope: Scope = settings.weight_quant_scope
            self.prefix = prefix
            self._backends: dict[str, str] = {}

        # -- weights ----------------------------------------------------------------------
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
            r0, nr, c0, nc = _shard_window(layer, part, tuple(loaded.shape))
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

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            # Nothing to repack: apply() reads the logical layout. Fused scope quantizes once all parts are in.
            if self.scope == "fused" and len(layer.jetrl_staged) == len(layer.jetrl_part_sizes):
                self._quantize_staged(layer)
            # Resolve the backend now, not in apply(): torch.compile must not trace the dispatch registry.
            layer.jetrl_op_args = self._op_args(layer, layer.weight.device)

        def _op_args(self, layer: torch.nn.Module, device: torch.device) -> tuple:
            groups = layer.jetrl_groups
            return (
                [g.rows for g in groups], [g.scale_rows for g in groups], [g.block[0] for g in groups], groups[0].block[1],
                spec_code(self.fprop.input), self.backend_for(device),
            )

        # -- views used by apply, the weight sync and the digests ----------------------------
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
                self._backends[key] = resolve_backend(self.settings.recipe.gemm_backend, device)
            return self._backends[key]

        # -- forward ------------------------------------------------------------------------
        def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            k = x.shape[-1]
            x2 = x.reshape(-1, k)
            n = layer.weight.shape[0]
            if x2.shape[0] == 0:
                return x.new_zeros(*x.shape[:-1], n)
            args = getattr(layer, "jetrl_op_args", None) or self._op_args(layer, x.device)
            # One opaque custom op: torch.compile / CUDA graphs (vLLM's default on GPU) see a single
            # node instead of tracing our quantizer and GEMM dispatch.
            y = torch.ops.jetrl.fp8_linear(x2, layer.weight, layer.weight_scale, *args)
            if bias is not None:
                y = y + bias.to(y.dtype)
            return y.reshape(*x.shape[:-1], n)

    _CLASSES.update(JetFp8Config=JetFp8Config, JetFp8LinearMethod=JetFp8LinearMethod)
    return _CLASSES


def jetrl_method_of(layer: torch.nn.Module):
    """The layer's JetFp8LinearMethod, or None (unquantized or another quantization)."""
    if not _CLASSES:
        return None
    method = getattr(layer, "quant_method", None)
    return method if isinstance(method, _CLASSES["JetFp8LinearMethod"]) else None


class _QuietFp8LoadWarning(logging.Filter):
    """vLLM warns that it loads an fp32/bf16 tensor into an e4m3 parameter: our loader quantizes it, so drop that line."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (str(record.msg).startswith("Attempted to load weight") and args and args[-1] == torch.float8_e4m3fn)


def _install_log_filter() -> None:
    vllm_logger = logging.getLogger("vllm.model_executor.models.utils")
    if not any(isinstance(f, _QuietFp8LoadWarning) for f in vllm_logger.filters):
        vllm_logger.addFilter(_QuietFp8LoadWarning())


def is_registered() -> bool:
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except ImportError:
        return False
    return QUANT_NAME in QUANTIZATION_METHODS and bool(_CLASSES)


def register() -> bool:
    """Register `jetrl_fp8` with vLLM. Idempotent; returns False (and does nothing) without vLLM.

    vLLM calls this through the `vllm.general_plugins` entry point in every process it starts.
    """
    try:
        from vllm.model_executor.layers.quantization import _CUSTOMIZED_METHOD_TO_QUANT_CONFIG, register_quantization_config
    except ImportError:
        logger.debug("jetrl_fp8: vLLM is not installed; nothing to register")
        return False
    classes = _build_classes()
    _install_log_filter()
    if _CUSTOMIZED_METHOD_TO_QUANT_CONFIG.get(QUANT_NAME) is not classes["JetFp8Config"]:
        register_quantization_config(QUANT_NAME)(classes["JetFp8Config"])
        logger.debug("jetrl_fp8: registered the vLLM quantization method")
    return True
