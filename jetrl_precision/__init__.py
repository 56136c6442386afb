"""jetrl_precision: one FP8 precision flow shared by rollout and training (Jet-RL).

Public API (stable; see docs/precision.md):
    quantize_fp8, QuantizedTensor, get_recipe, PrecisionRecipe, convert_to_fp8,
    build_precision_graph, check_subgraph, mismatch_metrics
"""

from .convert import Fp8Converter, FrozenWeights, convert_to_fp8, default_module_filter, fp8_linears, freeze_fp8_weights
from .coverage import Fp8Coverage, fp8_coverage
from .formats import E4M3_MAX, FP8_DTYPE, Granularity, QuantizedTensor
from .gemm import BackendUnavailable, available_backends, resolve_backend
from .grouped import Fp8LinearGroup, fuse_projections, unfuse_projections
from .graph import PrecisionGraph, Violation, build_precision_graph, check_subgraph, format_violations
from .linear import Fp8Linear, mark_weights_updated
from .metrics import mismatch_metrics
from .quantize import NonFiniteInputError, dequantize_fp8, quantize_fp8, requantize_fp8
from .recipe import RECIPE_NAMES, BackwardSpec, FpropSpec, PrecisionRecipe, RecipeError, TensorSpec, get_recipe

__all__ = [
    # the stable API: these names keep their meaning (docs/precision.md, Public API)
    "quantize_fp8",
    "QuantizedTensor",
    "get_recipe",
    "PrecisionRecipe",
    "convert_to_fp8",
    "build_precision_graph",
    "check_subgraph",
    "mismatch_metrics",
    # more
    "BackendUnavailable",
    "BackwardSpec",
    "E4M3_MAX",
    "FP8_DTYPE",
    "Fp8Converter",
    "Fp8Coverage",
    "Fp8Linear",
    "Fp8LinearGroup",
    "FpropSpec",
    "Granularity",
    "NonFiniteInputError",
    "PrecisionGraph",
    "RECIPE_NAMES",
    "RecipeError",
    "TensorSpec",
    "Violation",
    "available_backends",
    "default_module_filter",
    "dequantize_fp8",
    "format_violations",
    "fp8_coverage",
    "fp8_linears",
    "freeze_fp8_weights",
    "FrozenWeights",
    "fuse_projections",
    "mark_weights_updated",
    "requantize_fp8",
    "resolve_backend",
    "unfuse_projections",
]

__version__ = "0.1.0"
