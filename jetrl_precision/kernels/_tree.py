"""A sum whose order does not follow the register layout.

`tl.sum` adds in an order set by how a tensor's elements are spread over threads, and Triton picks that spread
from the input's dtype, alignment and strides: the same row loaded from a bf16 tensor and from an fp32 copy, or
from an aligned tensor and an unaligned view, can be summed in different orders. The batch-invariant kernels end
their row reductions with `pairwise_sum` instead: each level adds the named elements 2i and 2i+1, and a sum of two
values is the same in any layout.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["pairwise_sum"]


@triton.jit
def pairwise_sum(x, LEVELS: tl.constexpr):
    # x has 2**LEVELS elements; each level halves it by adding neighbours.
    for _ in tl.static_range(LEVELS):
        a, b = tl.split(tl.reshape(x, (x.shape[0] // 2, 2)))
        x = a + b
    return tl.sum(x, axis=0)  # one element left: no addition
