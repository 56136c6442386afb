"""One-call module swap: nn.Linear -> Fp8Linear, as a recipe says, keeping the same Parameters.

`convert_to_fp8` is the one call; `Fp8Converter` wraps it with the hook a training loop runs
after every optimizer step, in the shape of torchtitan's model converters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Literal

import torch
from torch import nn

from .coverage import UNCOVERED_WARN_FRACTION, fp8_coverage
from .kv_cache import mirror_kv_cache
from .linear import Fp8Linear, mark_weights_updated
from .recipe import PrecisionRecipe, get_recipe
from .grouped import fuse_projections as _fuse_projections
from .rmsnorm import fuse_rmsnorm as _fuse_rmsnorm
from .swiglu import fuse_swiglu as _fuse_swiglu

__all__ = ["convert_to_fp8", "Fp8Converter", "default_module_filter", "ModuleFilter", "fp8_linears", "Side", "freeze_fp8_weights",
           "FrozenWeights"]

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]
Side = Literal["train", "rollout"]


def default_module_filter(recipe: PrecisionRecipe) -> ModuleFilter:
    """Convert every nn.Linear except those the recipe keeps in high precision (`recipe.keeps_high_precision`)."""

    def keep(module: nn.Module, fqn: str) -> bool:
        return not recipe.keeps_high_precision(fqn)

    return keep


def convert_to_fp8(
    model: nn.Module,
    recipe: PrecisionRecipe | str,
    module_filter: ModuleFilter | None = None,
    *,
    side: Side = "train",
    fuse_swiglu: bool = True,
    cache_weights: bool = True,
    fuse_projections: bool = True,
    fuse_rmsnorm: bool = True,
) -> nn.Module:
    """Swap the model's nn.Linear layers for Fp8Linear in place and return the model.

    `side="train"` applies the recipe's training flow (fprop + backward); `side="rollout"`
    applies its rollout flow (a transformers-based rollout engine). When the chosen flow has
    no FP8 GEMM (``bf16``; the train side of ``fp8_rollout``) the model is left unchanged.
    `module_filter(module, fqn) -> bool` selects layers to convert; it replaces the recipe's
    default filter (lm_head, embeddings, norms, router and value heads stay high precision).

    Call it after `from_pretrained` and before `deepspeed.initialize`: the Fp8Linear adopts
    the existing Parameter objects, so ZeRO-2/3 partitioning and the optimizer are unaffected.

    With `fuse_swiglu` (the default) the Llama/Qwen/Mistral SwiGLU MLPs become `swiglu.SwiGLUMLP`: silu(gate) * up
    and the down projection's 1x128 quantization of it run as one kernel on CUDA, and backward keeps gate and up
    instead of also silu(gate). Same values bit for bit; pass False to keep the model's own MLP modules.

    With `fuse_projections` (the default) sibling projections that read one input (q/k/v, gate/up) run as one
    stacked FP8 GEMM forward and backward (`grouped.fuse_projections`): fewer launches and host work per block, the
    same FP8 bytes; pass False to run every layer on its own.

    With `fuse_rmsnorm` (the default) the Llama-family RMSNorms that feed FP8 projections only (a decoder layer's
    input and post-attention norms) become `rmsnorm.FusedRMSNorm`: the norm and its consumers' 1x128 quantization
    in one kernel on CUDA, the backward in one more. y may differ from transformers' eager formula by an ulp on a
    few elements (the kernel's summation order), the same in every forward; pass False to keep the model's norms.

    A recipe with `kv_cache="e4m3"` also makes the model's attention read e4m3-rounded keys and values, as the
    engine's FP8 KV cache holds them (`kv_cache.mirror_kv_cache`; the model must be a transformers model).

    `cache_weights` (the default) keeps each layer's quantized weight, and after a backward its transpose, until the
    weight changes: one byte per weight each, beside the BF16 weight. False quantizes them in every forward and
    backward instead (the same bytes): for runs whose memory is mostly weights (activation checkpointing).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_to_fp8 converts an nn.Module, got {type(model).__name__}")
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if not isinstance(recipe, PrecisionRecipe):
        raise TypeError(f"convert_to_fp8 needs a PrecisionRecipe or a recipe name (get_recipe), got {recipe!r}")
    if side not in ("train", "rollout"):
        raise ValueError(f"side must be 'train' or 'rollout', got {side!r}")
    fprop = recipe.train_fprop if side == "train" else recipe.rollout
    backward = recipe.train_backward if side == "train" else None
    if recipe.kv_cache == "e4m3":
        mirror_kv_cache(model)
    if not fprop.is_fp8:
        return model
    keep = module_filter or default_module_filter(recipe)
    converted = 0
    for fqn, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            child_fqn = f"{fqn}.{child_name}" if fqn else child_name
            if type(child) is nn.Linear and keep(child, child_fqn):
                new = Fp8Linear.from_linear(child, fprop, backward, recipe.gemm_backend, child_fqn, cache_weights)
                setattr(module, child_name, new)
                converted += 1
    if fuse_swiglu:
        _fuse_swiglu(model)
    if fuse_projections:
        _fuse_projections(model)
    if fuse_rmsnorm:
        _fuse_rmsnorm(model)
    if converted == 0:
        logger.warning("convert_to_fp8(%s, side=%s): no nn.Linear matched the module filter; nothing converted", recipe.name, side)
        return model
    cov = fp8_coverage(model)
    logger.info("convert_to_fp8: %d linear layers -> FP8 (%s, side=%s): %s", converted, recipe.name, side, cov.summary())
    if cov.share(cov.other) >= UNCOVERED_WARN_FRACTION:
        logger.warning(
            "convert_to_fp8: %.0f%% of %s's weights sit in %d modules that are not nn.Linear (e.g. %s) and stay in "
            "high precision (%s here) in the trainer and the engine; only its nn.Linear projections run in FP8",
            100 * cov.share(cov.other), type(model).__name__, len(cov.other_modules), cov.other_modules[0],
            _dtype_of(model),
        )
    return model


def _dtype_of(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return "their own dtype" if p is None else str(p.dtype).replace("torch.", "")


def fp8_linears(model: nn.Module) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


@dataclass(frozen=True)
class FrozenWeights:
    """What `freeze_fp8_weights` did."""

    layers: int  # FP8 layers frozen by this call
    freed_bytes: int  # their high-precision weights
    kept_bytes: int  # the FP8 weights and scales they keep instead


def freeze_fp8_weights(model: nn.Module, device: torch.device | str | None = None) -> FrozenWeights:
    """Make an inference-only model's FP8 layers keep nothing but their FP8 weights (`Fp8Linear.freeze`).

    For a model that is never trained or synced, such as the reference policy: its forward gives the same bytes,
    and each FP8 layer holds 1 byte per weight instead of BF16's 2 plus the cached quantization. Stacked projection
    groups are undone first (a frozen layer keeps its own FP8 weight, not a share of a stacked one); a no-grad
    forward gains nothing measurable from stacking. Call it after `convert_to_fp8`, `requires_grad_(False)` and the
    move to the model's device, or pass `device` to quantize there layer by layer and keep the results where the
    weights are (a model offloaded to the CPU). A ZeRO-3 partitioned model cannot be frozen (its layers gather
    their weights).
    """
    todo = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.fprop.weight.is_fp8 and not m.frozen]
    training = [m.fqn or type(m).__name__ for m in todo if m._parameters["weight"].requires_grad]
    if training:
        raise ValueError(f"freeze_fp8_weights: {len(training)} FP8 layer(s) still require grad (e.g. {training[0]}); "
                         "freeze only inference models: call model.requires_grad_(False) first")
    for group in {id(m._group): m._group for m in todo if m._group is not None}.values():
        group.dissolve("frozen: each layer keeps its own FP8 weight")
    freed = sum(m.freeze(device) for m in todo)
    kept = sum(b.numel() * b.element_size() for m in todo for b in (m.weight_fp8, m.weight_fp8_scale))
    if todo:
        logger.info("freeze_fp8_weights: %d FP8 layers keep only their FP8 weights (%.2f GiB) instead of %.2f GiB of %s weights",
                    len(todo), kept / 2**30, freed / 2**30, str(todo[0].weight.dtype).replace("torch.", ""))
    return FrozenWeights(len(todo), freed, kept)


@dataclass(frozen=True)
class Fp8Converter:
    """A model converter: `convert(model)` once after `from_pretrained` (before `deepspeed.initialize`),
    `post_optimizer_hook(model)` after every optimizer step that changed the weights.

        converter = Fp8Converter(get_recipe("jet_fp8"))
        converter.convert(model)
        ...
        engine.step()
        if engine.was_step_applied():
            converter.post_optimizer_hook(model)
    """

    recipe: PrecisionRecipe
    side: Side = "train"
    module_filter: ModuleFilter | None = None
    fuse_swiglu: bool = True
    cache_weights: bool = True
    fuse_projections: bool = True
    fuse_rmsnorm: bool = True

    def convert(self, model: nn.Module) -> nn.Module:
        """`convert_to_fp8(model, recipe, ...)` with this converter's settings; in place, returns the model."""
        return convert_to_fp8(model, self.recipe, self.module_filter, side=self.side, fuse_swiglu=self.fuse_swiglu,
                              cache_weights=self.cache_weights, fuse_projections=self.fuse_projections,
                              fuse_rmsnorm=self.fuse_rmsnorm)

    def post_optimizer_hook(self, model: nn.Module | Iterable[nn.Module]) -> None:
        """The weights changed: drop the cached FP8 weights (and the step's shared activation quantizations).

        DeepSpeed's ZeRO-1/2 optimizers copy their results into the parameters through `.data`, which
        torch's version counter does not see, so without this the next forward would run on the
        previous step's FP8 bytes. The cache generation is process-wide: one call covers every
        converted model of the process (actor, critic, reference).
        """
        mark_weights_updated()
