"""The engine's log-probs as the old log-probs, on steps that prove them exact (--precision.bitwise).

With batch-invariant numerics the engine's log-prob of every sampled token should be the
trainer's recompute bit for bit, which makes the recompute (a full forward over every sequence)
redundant. "Should" is not enough to skip it, so every step proves it:

1. the weight digests compared after the last sync matched (the engine holds the bytes sent), and
2. the trainer recomputes a few sequences (a fresh random sample per step and rank) and every
   response token's log-prob equals the engine's exactly (`==`, not a tolerance).

Both on every rank: then the engine's log-probs become the old log-probs and the rest of the
recompute is skipped. Otherwise the step recomputes everything, as without the mode; the first
failure is logged as a warning and every failure counts in `bitwise/fallbacks`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from .experience_maker import Experience

__all__ = ["EngineLogprobProof", "ProofResult"]

logger = logging.getLogger(__name__)

Reduce = Callable[[float, str], float]  # (local value, "sum" | "max" | "min") -> value over all ranks


@dataclass(frozen=True)
class ProofResult:
    """One step's proof, over all ranks. `rows` are this rank's sampled rows."""

    held: bool
    weights_verified: bool
    sequences: int
    tokens: int
    mismatched_tokens: int
    max_abs_diff: float
    rows: tuple[int, ...] = ()

    def metrics(self, fallbacks: int) -> dict[str, float]:
        return {
            "bitwise/proof_sequences": float(self.sequences),
            "bitwise/proof_tokens": float(self.tokens),
            "bitwise/proof_mismatched_tokens": float(self.mismatched_tokens),
            "bitwise/proof_max_abs_diff": self.max_abs_diff,
            "bitwise/weights_verified": float(self.weights_verified),
            "bitwise/engine_logprobs_used": float(self.held),
            "bitwise/fallbacks": float(fallbacks),
        }


class EngineLogprobProof:
    """Decides, per step, whether the engine's log-probs stand in for the trainer's recompute.

    `samples` sequences per rank are recomputed (0: never use the engine's log-probs, recompute every
    step); `reduce` combines a value over ranks (every rank must take the same branch: the forwards
    are collective under ZeRO-3)."""

    def __init__(self, samples: int, reduce: Reduce, *, rank: int = 0, seed: int = 0) -> None:
        if samples < 0:
            raise ValueError(f"samples must be >= 0, got {samples}")
        self.samples, self.reduce, self.rank, self.seed = samples, reduce, rank, seed
        self.fallbacks = 0
        self._warned = False

    def sample_rows(self, n_rows: int, step: int) -> list[int]:
        """A fresh random sample per step and rank, so that over a run every kind of row gets checked."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 9973 + self.rank)
        return sorted(torch.randperm(n_rows, generator=g)[: min(self.samples, n_rows)].tolist())

    def __call__(
        self, exp: Experience, recompute: Callable[[Experience], torch.Tensor], *, step: int, weights_verified: bool
    ) -> tuple[torch.Tensor, ProofResult]:
        """(old log-probs for `exp`, the proof). `recompute(sub)` runs the trainer's forward on `sub`'s rows."""
        if self.samples == 0:
            return recompute(exp), ProofResult(False, weights_verified, 0, 0, 0, 0.0)
        rows = self.sample_rows(len(exp), step)
        sub = exp.select(torch.tensor(rows))
        trainer_lp = recompute(sub)
        mask = sub.action_mask.bool()
        engine_lp = sub.rollout_logprobs[:, : trainer_lp.shape[1]]
        differs = (trainer_lp != engine_lp) & mask  # NaN never equals: a NaN fails the proof
        diff = (trainer_lp - engine_lp).abs()[mask]
        local_max = float(diff.max()) if diff.numel() else 0.0
        tokens, bad = int(mask.sum()), int(differs.sum())
        held_here = weights_verified and tokens > 0 and bad == 0
        held = self.reduce(float(held_here), "min") == 1.0
        result = ProofResult(
            held=held,
            weights_verified=self.reduce(float(weights_verified), "min") == 1.0,
            sequences=int(self.reduce(float(len(rows)), "sum")),
            tokens=int(self.reduce(float(tokens), "sum")),
            mismatched_tokens=int(self.reduce(float(bad), "sum")),
            max_abs_diff=self.reduce(local_max if local_max == local_max else float("inf"), "max"),
            rows=tuple(rows),
        )
        if held:
            return exp.rollout_logprobs.clone(), result
        self.fallbacks += 1
        if not self._warned:
            self._warned = True
            why = (
                "the weight digests after the last sync were not verified" if not result.weights_verified
                else f"{result.mismatched_tokens} of {result.tokens} sampled response tokens differ from the trainer's "
                f"recompute (max |dlogp| {result.max_abs_diff:.3g})"
            )
            logger.warning(
                "--precision.bitwise: step %d cannot use the engine's log-probs: %s. Recomputing every sequence for this "
                "step and checking again on the next; further fallbacks are counted in bitwise/fallbacks, not logged",
                step, why,
            )
        return recompute(exp), result
