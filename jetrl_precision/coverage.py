"""How much of a model's weights run in FP8 after conversion, and what stays in high precision and why.

`convert_to_fp8` swaps nn.Linear layers only. Weights held elsewhere keep their dtype on both sides of the flow
(trainer and engine), which is consistent but not what a user who asked for FP8 may assume: an MoE model stores
its experts as 3-D tensors (transformers' `*Experts` modules, vLLM's FusedMoE), so only its attention projections
become FP8. `fp8_coverage` counts it, and `convert_to_fp8` logs the split (a warning when such weights are a
large share of the model).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["Fp8Coverage", "fp8_coverage"]

# A share of the weight matrices outside nn.Linear above which `convert_to_fp8` warns.
UNCOVERED_WARN_FRACTION = 0.05


@dataclass(frozen=True)
class Fp8Coverage:
    """Weight-matrix elements (parameters of two or more dimensions, each counted once when tied) by where they run.

    - `fp8`: in FP8 linears;
    - `kept`: in nn.Linear layers the recipe keeps in high precision (lm_head, MoE routers, value heads);
    - `embeddings`: in nn.Embedding tables;
    - `other`: in modules that are not nn.Linear (MoE experts stored as 3-D tensors, routers with their own
      Parameter, custom heads), named in `other_modules`, the largest first.
    Vectors (norm weights, biases) are not counted: they stay in high precision by design.
    """

    fp8: int
    kept: int
    embeddings: int
    other: int
    other_modules: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.fp8 + self.kept + self.embeddings + self.other

    def share(self, part: int) -> float:
        return part / self.total if self.total else 0.0

    def summary(self) -> str:
        """'62.1% of the weight matrices in FP8; high precision: embeddings 20.3%, kept linears 17.6%'."""
        parts = [(what, n) for what, n in (("embeddings", self.embeddings), ("kept linears", self.kept),
                                           ("modules that are not nn.Linear", self.other)) if n]
        s = f"{100 * self.share(self.fp8):.1f}% of the weight matrices in FP8"
        if parts:
            s += "; high precision: " + ", ".join(f"{what} {100 * self.share(n):.1f}%" for what, n in parts)
        return s


def fp8_coverage(model: nn.Module) -> Fp8Coverage:
    """Count where `model`'s weight matrices run (see `Fp8Coverage`). Parameters on the meta device count too."""
    from .linear import Fp8Linear

    seen: set[int] = set()
    counts = {"fp8": 0, "kept": 0, "embeddings": 0, "other": 0}
    others: list[tuple[int, str]] = []
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.dim() >= 2 and id(p) not in seen]
        if not params:
            continue
        seen.update(id(p) for p in params)
        n = sum(getattr(p, "ds_numel", None) or p.numel() for p in params)  # ZeRO-3 keeps a partition; ds_numel is the whole
        if isinstance(module, Fp8Linear) and module.fprop.is_fp8:
            counts["fp8"] += n
        elif isinstance(module, nn.Linear):
            counts["kept"] += n
        elif isinstance(module, nn.Embedding):
            counts["embeddings"] += n
        else:
            counts["other"] += n
            others.append((n, f"{name} ({type(module).__name__})"))
    others.sort(key=lambda o: -o[0])  # the largest first: the example a message names
    return Fp8Coverage(**counts, other_modules=tuple(name for _, name in others))
