"""Stop training on non-finite gradients or parameters, instead of training on (or saving) them.

A non-finite loss is caught where it is computed. Gradients can still overflow from a finite loss
(a corrupted weight, an FP8 scale gone wrong): under bf16/fp16 DeepSpeed then skips the optimizer
step and carries on, and in fp32 it applies the NaN. `check_optimizer_step` turns both into a
`TrainingDivergedError`, on every rank at once; `nonfinite_parameters` guards loads and saves.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

__all__ = ["TrainingDivergedError", "check_optimizer_step", "nonfinite_parameters"]

_ADVICE = (
    "lower the learning rate (--actor.adam.lr), check the rewards, resume from an earlier checkpoint, "
    "or run --precision.recipe bf16 to rule out FP8 overflow"
)


class TrainingDivergedError(FloatingPointError):
    """Training produced non-finite values; nothing further was applied or saved."""


def check_optimizer_step(engine, name: str, step: int, skipped_before: int) -> None:
    """After `engine.step()`: raise if DeepSpeed skipped it for overflow, or applied a non-finite gradient.

    `skipped_before` is `engine.skipped_steps` read just before the step. Both signals are the same
    on every rank (DeepSpeed reduces the overflow flag and the gradient norm across the group).
    """
    if engine.skipped_steps > skipped_before:
        raise TrainingDivergedError(
            f"{name}: the gradients overflowed (inf/NaN) at step {step} and DeepSpeed skipped the optimizer update; "
            f"stopping instead of training on: {_ADVICE}"
        )
    if not engine.was_step_applied():
        return  # between accumulation boundaries: nothing was applied
    norm = engine.get_global_grad_norm()
    if norm is not None and not math.isfinite(float(norm)):
        raise TrainingDivergedError(
            f"{name}: the gradient norm is {float(norm)} at step {step}: the update wrote non-finite weights; "
            f"stopping without saving them: {_ADVICE}"
        )
    if norm is None:  # no norm computed (ZeRO-0: replicated weights, so a local look agrees on every rank)
        bad = nonfinite_parameters(engine.module)
        if bad:
            raise TrainingDivergedError(
                f"{name}: the update at step {step} wrote NaN/inf into {', '.join(bad[:4])}; stopping without saving them: {_ADVICE}"
            )


def nonfinite_parameters(module: nn.Module, all_reduce: Callable[[float], torch.Tensor] | None = None) -> list[str]:
    """Names of parameters holding NaN/inf (this rank's ZeRO-3 partition, or the whole tensor).

    With `all_reduce` (a sum over ranks), every rank learns whether any rank found one: the
    returned list is then this rank's names, or ["<another rank>"] when only others did.
    """
    bad = []
    with torch.no_grad():
        for name, p in module.named_parameters():
            local = getattr(p, "ds_tensor", None)
            t = local if local is not None else p.data
            if t.numel() and not bool(torch.isfinite(t).all()):
                bad.append(name)
    if all_reduce is not None:
        total = all_reduce(float(len(bad))).item()  # one collective on every rank
        if not bad and total > 0:
            return ["<another rank>"]
    return bad
