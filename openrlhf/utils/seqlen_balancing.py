"""Dynamic batching: micro-batches bounded by tokens instead of by sample count.

`--train.dynamic_batch_enable` splits each optimizer step's samples into micro-batches of at
most `--train.max_tokens_per_gpu` real tokens (packed, so padding costs nothing), and the
experience maker's forward passes use `--rollout.max_tokens_per_gpu`. Parts are balanced by
longest-first greedy assignment, so long samples do not all land in one micro-batch.

Under ZeRO-3 every forward gathers parameters collectively, so all ranks must run the same
number of micro-batches: `synced_partition` agrees on the largest count over ranks, and a rank
with fewer samples than that count gets empty parts, which the trainer runs as zero-weight
passes.
"""

from __future__ import annotations

import heapq
import logging
import math
from typing import Callable, Sequence

__all__ = ["token_budget_partition", "synced_partition"]

logger = logging.getLogger(__name__)


def _greedy(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Longest first, each into the part with the fewest tokens so far (ties: lower part index)."""
    heap = [(0, j) for j in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, j = heapq.heappop(heap)
        parts[j].append(i)
        heapq.heappush(heap, (total + lengths[i], j))
    return [sorted(p) for p in parts]


def token_budget_partition(lengths: Sequence[int], max_tokens: int, min_parts: int = 1) -> list[list[int]]:
    """Indices of `lengths` split into the fewest parts (at least `min_parts`) whose token sums
    are <= `max_tokens`. A sample longer than the budget gets a part of its own. Parts may be
    empty only when `min_parts` exceeds the number of samples."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    n = len(lengths)
    if n == 0:
        return [[] for _ in range(max(min_parts, 0))]
    over = [i for i, length in enumerate(lengths) if length > max_tokens]
    if over:
        logger.warning(
            "%d sample(s) longer than the micro-batch token budget (%d > %d): each runs as a micro-batch of its own; "
            "raise --train.max_tokens_per_gpu / --rollout.max_tokens_per_gpu to at least --data.max_len",
            len(over), max(lengths[i] for i in over), max_tokens,
        )
    fitting = sum(length for length in lengths if length <= max_tokens)
    k = max(min_parts, len(over) + math.ceil(fitting / max_tokens), 1)
    while k < n:
        parts = _greedy(lengths, k)
        if all(sum(lengths[i] for i in p) <= max_tokens or len(p) == 1 for p in parts):
            return parts
        k += 1
    parts = [[i] for i in range(n)]
    return parts + [[] for _ in range(k - n)]


def synced_partition(
    lengths: Sequence[int], max_tokens: int, all_reduce_max: Callable[[int], int]
) -> list[list[int]]:
    """`token_budget_partition` with the same number of parts on every rank."""
    k = all_reduce_max(len(token_budget_partition(lengths, max_tokens)))
    return token_budget_partition(lengths, max_tokens, min_parts=k)
