"""Declarative precision recipes: frozen dataclasses that round-trip through YAML/JSON.

A recipe says, for every GEMM role of a linear layer, which format and granularity its
operands use, in training and in rollout. The three named recipes:

- ``bf16``: the baseline; nothing is quantized.
- ``fp8_rollout``: BF16 training, FP8 rollout (VeRL/FlashRL style). Off-policy by design.
- ``jet_fp8``: the unified flow (Jet-RL). Rollout uses exactly the training forward's
  quantization, so the rollout graph is a subgraph of the training-forward graph.
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .formats import Granularity
from .kv_cache import KV_CACHE_FORMATS

__all__ = [
    "RECIPE_FILE_SUFFIXES",
    "DType",
    "ScaleRule",
    "TensorSpec",
    "FpropSpec",
    "BackwardSpec",
    "PrecisionRecipe",
    "RecipeError",
    "DEFAULT_KEEP_HIGH_PRECISION",
    "RECIPE_NAMES",
    "get_recipe",
]

# What names a recipe file rather than a recipe (get_recipe reads these; any other name must be a known recipe).
RECIPE_FILE_SUFFIXES = (".yaml", ".yml", ".json")

GEMM_BACKENDS = ("auto", "emulated", "torch", "triton", "deep_gemm", "triton_invariant")


class RecipeError(ValueError):
    """A recipe that is malformed or internally inconsistent."""


class DType(str, enum.Enum):
    E4M3 = "e4m3"
    BF16 = "bf16"
    FP32 = "fp32"


class ScaleRule(str, enum.Enum):
    AMAX_DIV = "amax/448"  # scale = max(amax, 1e-10) / 448, fp32
    AMAX_DIV_POW2 = "amax/448,pow2up"  # the same, rounded up to a power of two (UE8M0)


def _enum(cls: type[enum.Enum], value: Any, what: str) -> Any:
    """Enum conversion whose error names the field and the valid values."""
    try:
        return cls(value)
    except ValueError:
        raise RecipeError(f"{what} {value!r} is not valid: use one of {[m.value for m in cls]}") from None


@dataclass(frozen=True)
class TensorSpec:
    """How one GEMM operand is represented."""

    dtype: DType = DType.BF16
    granularity: Granularity | None = None
    scale_rule: ScaleRule | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _enum(DType, self.dtype, "dtype"))
        if self.granularity is not None:
            object.__setattr__(self, "granularity", _enum(Granularity, self.granularity, "granularity"))
        if self.scale_rule is not None:
            object.__setattr__(self, "scale_rule", _enum(ScaleRule, self.scale_rule, "scale_rule"))
        if self.dtype == DType.E4M3:
            if self.granularity is None or self.scale_rule is None:
                raise RecipeError(f"an e4m3 operand needs a granularity and a scale_rule, got {self}")
        elif self.granularity is not None or self.scale_rule is not None:
            raise RecipeError(f"a {self.dtype.value} operand takes no granularity or scale_rule, got {self}")

    @property
    def is_fp8(self) -> bool:
        return self.dtype == DType.E4M3

    @property
    def pow2_scale(self) -> bool:
        return self.scale_rule == ScaleRule.AMAX_DIV_POW2

    @property
    def quantizer_id(self) -> str:
        """A stable id for 'the same quantizer': equal ids mean byte-identical quantization."""
        if not self.is_fp8:
            return f"{self.dtype.value}/none"
        return f"{self.dtype.value}/{self.granularity.value}/{self.scale_rule.value}/div-rne"

    def short_str(self) -> str:
        return self.dtype.value if not self.is_fp8 else f"{self.dtype.value}[{self.granularity.value}]"


BF16 = TensorSpec()


def _e4m3(granularity: Granularity, pow2: bool = False) -> TensorSpec:
    return TensorSpec(DType.E4M3, granularity, ScaleRule.AMAX_DIV_POW2 if pow2 else ScaleRule.AMAX_DIV)


@dataclass(frozen=True)
class FpropSpec:
    """Forward GEMM y = x W^T: the same spec serves training fprop and rollout."""

    input: TensorSpec = BF16
    weight: TensorSpec = BF16

    @property
    def is_fp8(self) -> bool:
        return self.input.is_fp8 or self.weight.is_fp8


@dataclass(frozen=True)
class BackwardSpec:
    """DGrad (dX = dY W) and WGrad (dW = dY^T X) operands, plus what forward saves for backward.

    The DGrad weight is always the exact transpose of the fprop weight blocks (never re-quantized).
    """

    dgrad_grad_output: TensorSpec = BF16
    wgrad_grad_output: TensorSpec = BF16
    wgrad_input: TensorSpec = BF16
    saved_input: TensorSpec = BF16
    grad_dtype: DType = DType.BF16  # gradients passed between operators: never FP8 (underflow)

    def __post_init__(self) -> None:
        object.__setattr__(self, "grad_dtype", _enum(DType, self.grad_dtype, "grad_dtype"))
        if self.grad_dtype == DType.E4M3:
            raise RecipeError("grad_dtype=e4m3 is not supported: inter-op gradients underflow in FP8; use bf16 or fp32")

    @property
    def is_fp8(self) -> bool:
        return any(s.is_fp8 for s in (self.dgrad_grad_output, self.wgrad_grad_output, self.wgrad_input))


# Name patterns (fnmatch, matched against the module FQN) kept in high precision by default.
DEFAULT_KEEP_HIGH_PRECISION: tuple[str, ...] = (
    "*lm_head*",
    "*embed*",
    "*norm*",
    "*router*",
    "*.gate",  # MoE router linear (Mixtral/Qwen-MoE name it `gate`); not gate_proj
    "*shared_expert_gate",  # Qwen2-MoE's one-logit gate on the shared expert
    "*score*",  # reward / value heads
)


@dataclass(frozen=True)
class PrecisionRecipe:
    """The whole precision flow of a model, for training and rollout."""

    name: str
    train_fprop: FpropSpec = FpropSpec()
    train_backward: BackwardSpec = BackwardSpec()
    rollout: FpropSpec = FpropSpec()
    keep_high_precision: tuple[str, ...] = DEFAULT_KEEP_HIGH_PRECISION
    gemm_backend: str = "auto"
    lm_head_dtype: DType = DType.BF16
    # The KV cache, on both sides: "auto" (the activations' dtype) or "e4m3" (vLLM's FP8 cache, scale 1, mirrored by
    # the trainer's attention: `kv_cache.mirror_kv_cache`).
    kv_cache: str = "auto"
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_high_precision", tuple(self.keep_high_precision))
        object.__setattr__(self, "lm_head_dtype", _enum(DType, self.lm_head_dtype, "lm_head_dtype"))
        if self.gemm_backend not in GEMM_BACKENDS:
            raise RecipeError(f"gemm_backend must be one of {GEMM_BACKENDS}, got {self.gemm_backend!r}")
        if self.lm_head_dtype == DType.E4M3:
            raise RecipeError("lm_head_dtype must be bf16 or fp32: logits in FP8 make logprobs unusable")
        if self.kv_cache not in KV_CACHE_FORMATS:
            raise RecipeError(f"kv_cache must be one of {KV_CACHE_FORMATS}, got {self.kv_cache!r}")
        for spec in (self.train_fprop, self.rollout):
            if spec.weight.is_fp8 and spec.weight.granularity not in (Granularity.BLOCK_128x128, Granularity.TENSOR, Granularity.ROW):
                raise RecipeError(
                    f"weight granularity {spec.weight.granularity.value} is not supported: use 128x128 "
                    "(so the DGrad weight is an exact transpose), or row/tensor for comparisons"
                )
        bw = self.train_backward
        if bw.is_fp8 and not self.train_fprop.is_fp8:
            raise RecipeError("an FP8 backward needs an FP8 forward: set train_fprop to e4m3 as well")
        if bw.saved_input.is_fp8 and bw.saved_input != self.train_fprop.input:
            raise RecipeError(
                f"saved_input {bw.saved_input.short_str()} must equal the fprop input spec "
                f"{self.train_fprop.input.short_str()}: the saved activation is the fprop operand itself"
            )
        if bw.wgrad_input.is_fp8 and bw.wgrad_input.granularity != Granularity.BLOCK_128x1:
            raise RecipeError("wgrad_input must be grouped along tokens (128x1): WGrad contracts over tokens")
        if bw.wgrad_grad_output.is_fp8 and bw.wgrad_grad_output.granularity != Granularity.BLOCK_128x1:
            raise RecipeError("wgrad_grad_output must be grouped along tokens (128x1): WGrad contracts over tokens")
        if bw.dgrad_grad_output.is_fp8 and bw.dgrad_grad_output.granularity != Granularity.BLOCK_1x128:
            raise RecipeError("dgrad_grad_output must be 1x128 (grouped along the contraction dim N)")

    # ---- which layers are FP8 --------------------------------------------------------------
    def keeps_high_precision(self, module_fqn: str) -> bool:
        """Whether the linear layer at `module_fqn` stays in high precision (matches a
        `keep_high_precision` pattern, fnmatch, case-sensitive). The one definition used by the
        trainer's conversion, the weight sync's expected digests and the vLLM plugin: both sides
        must agree on it for the rollout graph to be a subgraph of the training forward."""
        return any(fnmatch.fnmatchcase(module_fqn, p) for p in self.keep_high_precision)

    # ---- derived properties -------------------------------------------------------------
    @property
    def unified(self) -> bool:
        """Rollout quantization is exactly the training forward's: the Jet-RL property."""
        return self.rollout == self.train_fprop

    @property
    def syncs_fp8_weights(self) -> bool:
        """The weight sync sends the trainer's FP8 bytes (unified and FP8 in training), not bf16 weights."""
        return self.unified and self.train_fprop.is_fp8

    @property
    def off_policy(self) -> bool:
        """The sampler's numerics differ from the trained policy's, so IS correction is needed."""
        return not self.unified

    @property
    def fp8_anywhere(self) -> bool:
        return self.train_fprop.is_fp8 or self.rollout.is_fp8

    # ---- serialization ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def conv(v: Any) -> Any:
            if isinstance(v, enum.Enum):
                return v.value
            if dataclasses.is_dataclass(v):
                return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
            if isinstance(v, tuple):
                return [conv(x) for x in v]
            return v

        return conv(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrecisionRecipe":
        if not isinstance(data, dict):
            raise RecipeError(f"a recipe must be a mapping, got {type(data).__name__}")
        base = data.get("base")
        merged: dict[str, Any] = _resolve_base(base).to_dict() if base is not None else {}
        _deep_update(merged, {k: v for k, v in data.items() if k != "base"})
        try:
            return _build(cls, merged, "recipe")
        except (TypeError, ValueError) as e:  # enum values and unknown keys
            if isinstance(e, RecipeError):
                raise
            raise RecipeError(str(e)) from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "PrecisionRecipe":
        text = _read_text(text_or_path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise RecipeError(f"{_where(text_or_path)}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
        return cls.from_dict(data)

    def to_yaml(self) -> str:
        return _yaml().safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text_or_path: str | Path) -> "PrecisionRecipe":
        yaml = _yaml()
        text = _read_text(text_or_path)
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise RecipeError(f"{_where(text_or_path)}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "PrecisionRecipe":
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        f, b, r = self.train_fprop, self.train_backward, self.rollout
        return (
            f"recipe {self.name}: train fprop x={f.input.short_str()} W={f.weight.short_str()}; "
            f"dgrad dY={b.dgrad_grad_output.short_str()}; wgrad dY={b.wgrad_grad_output.short_str()} "
            f"X={b.wgrad_input.short_str()}; saved X={b.saved_input.short_str()}; "
            f"rollout x={r.input.short_str()} W={r.weight.short_str()}; "
            f"{'unified' if self.unified else 'OFF-POLICY'}; backend={self.gemm_backend}"
            + (f"; kv_cache={self.kv_cache}" if self.kv_cache != "auto" else "")
        )


def _yaml():
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml ships with the framework extras
        raise ImportError("YAML recipes need PyYAML: pip install pyyaml (or use to_json/from_json)") from None
    return yaml


def _where(text_or_path: str | Path) -> str:
    text = str(text_or_path)
    return "recipe text" if "\n" in text or not text.endswith(RECIPE_FILE_SUFFIXES) else f"recipe file {text}"


def _read_text(text_or_path: str | Path) -> str:
    p = Path(text_or_path) if isinstance(text_or_path, Path) or "\n" not in str(text_or_path) else None
    if p is not None and (isinstance(text_or_path, Path) or str(p).endswith(RECIPE_FILE_SUFFIXES)):
        if not p.exists():
            raise FileNotFoundError(f"recipe file {p} does not exist; pass a named recipe {RECIPE_NAMES} or a valid path")
        try:
            return p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise RecipeError(f"recipe file {p} cannot be read ({type(e).__name__}: {e}); pass a UTF-8 .yaml/.json file") from None
    return str(text_or_path)


# The `base:` references being resolved right now (outermost first): a name seen twice is a cycle.
_BASE_CHAIN: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("jetrl_recipe_base_chain", default=())


def _resolve_base(base: Any) -> "PrecisionRecipe":
    if not isinstance(base, (str, Path)) or not str(base):
        raise RecipeError(f"recipe base must be a recipe name {RECIPE_NAMES} or a .yaml/.json path, got {base!r}")
    key = str(Path(base).resolve()) if Path(base).suffix in RECIPE_FILE_SUFFIXES else str(base)
    chain = _BASE_CHAIN.get()
    if key in chain:
        cycle = " -> ".join([*chain[chain.index(key):], key])
        raise RecipeError(f"recipe base cycle: {cycle}; a recipe's base must end at a named recipe {RECIPE_NAMES}")
    token = _BASE_CHAIN.set((*chain, key))
    try:
        return get_recipe(str(base))
    finally:
        _BASE_CHAIN.reset(token)


def _deep_update(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = v


def _build(cls: type, data: Any, where: str) -> Any:
    if not dataclasses.is_dataclass(cls):
        return data
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping for {cls.__name__}, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {sorted(unknown)} for {cls.__name__}; valid keys: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        ftype = _FIELD_TYPES.get((cls, name))
        kwargs[name] = _build(ftype, value, f"{where}.{name}") if ftype else value
    try:
        return cls(**kwargs)
    except RecipeError as e:
        if str(e).startswith(where):  # already located by a nested _build
            raise
        raise RecipeError(f"{where}: {e}") from None


_FIELD_TYPES: dict[tuple[type, str], type] = {
    (PrecisionRecipe, "train_fprop"): FpropSpec,
    (PrecisionRecipe, "train_backward"): BackwardSpec,
    (PrecisionRecipe, "rollout"): FpropSpec,
    (FpropSpec, "input"): TensorSpec,
    (FpropSpec, "weight"): TensorSpec,
    (BackwardSpec, "dgrad_grad_output"): TensorSpec,
    (BackwardSpec, "wgrad_grad_output"): TensorSpec,
    (BackwardSpec, "wgrad_input"): TensorSpec,
    (BackwardSpec, "saved_input"): TensorSpec,
}


def _named_recipes() -> dict[str, PrecisionRecipe]:
    fp8_fprop = FpropSpec(input=_e4m3(Granularity.BLOCK_1x128), weight=_e4m3(Granularity.BLOCK_128x128))
    fp8_backward = BackwardSpec(
        dgrad_grad_output=_e4m3(Granularity.BLOCK_1x128),
        wgrad_grad_output=_e4m3(Granularity.BLOCK_128x1),
        wgrad_input=_e4m3(Granularity.BLOCK_128x1),
        saved_input=_e4m3(Granularity.BLOCK_1x128),
    )
    return {
        "bf16": PrecisionRecipe(name="bf16", description="BF16 training and BF16 rollout (baseline)."),
        "fp8_rollout": PrecisionRecipe(
            name="fp8_rollout",
            rollout=fp8_fprop,
            description="BF16 training, FP8 rollout: the off-policy baseline; needs IS correction (TIS/icepop).",
        ),
        "jet_fp8": PrecisionRecipe(
            name="jet_fp8",
            train_fprop=fp8_fprop,
            train_backward=fp8_backward,
            rollout=fp8_fprop,
            description="Unified FP8 flow (Jet-RL): rollout uses the training forward's exact quantization.",
        ),
    }


RECIPE_NAMES = ("bf16", "fp8_rollout", "jet_fp8")


def get_recipe(name: str | Path) -> PrecisionRecipe:
    """A named recipe ("bf16", "fp8_rollout", "jet_fp8") or a path to a YAML/JSON recipe file."""
    if isinstance(name, Path):
        name = str(name)
    if not isinstance(name, str):
        raise RecipeError(f"get_recipe takes a recipe name {RECIPE_NAMES} or a .yaml/.json path, got {name!r} ({type(name).__name__})")
    recipes = _named_recipes()
    if name in recipes:
        return recipes[name]
    path = Path(name)
    if path.suffix in RECIPE_FILE_SUFFIXES:
        if not path.exists():
            raise FileNotFoundError(f"recipe file {path} does not exist")
        return PrecisionRecipe.from_json(path) if path.suffix == ".json" else PrecisionRecipe.from_yaml(path)
    raise RecipeError(f"unknown recipe {name!r}: use one of {RECIPE_NAMES} or a path to a .yaml/.json recipe file")
