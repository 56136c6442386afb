"""Batch-invariant numerics: each row's result does not depend on how many rows run with it.

A rollout engine decodes one token per sequence against a KV cache; the trainer recomputes the
whole sequence in one forward. With ordinary kernels the two reduce in shape-dependent orders
and differ by float noise, which e4m3 rounding turns into flipped FP8 codes (docs/precision.md,
"Bitwise mode"). When every op that feeds a quantizer or the logits is batch-invariant, decode
and full forward give the same bits, and the engine's log-probs *are* the trainer's.

`make_batch_invariant(model, device=...)` converts a model for the device it will run on.

On CPU:
- `fp64_attention`: scores, softmax and the weighted sum in float64, rounded once (transformers'
  attention-function signature; `openrlhf.models.invariant_attention` registers it as
  `jetrl_invariant`);
- `InvariantLinear`: the high-precision linears (lm_head, everything under the bf16 recipe) with
  float64 accumulation, rounded once; its backward uses ordinary kernels;
- the FP8 linears need the `emulated` GEMM backend (float64 accumulation as well);
- RMSNorm stays transformers' (CPU reduces each row on its own, in one order).

On CUDA (Triton kernels, `jetrl_precision.kernels.invariant_*`; one program per row or per query tile, fixed
blocks whatever the launch):
- `triton_attention` (registered as `jetrl_invariant_triton`): causal GQA attention whose prefill row equals the
  KV-cached decode of that token, the same kernel the engine's paged path runs;
- `InvariantRMSNorm` replaces the Llama-family RMSNorm modules (same Parameter, transformers' rounding points);
- `invariant_log_probs`: log-softmax and the chosen token's log-prob in fp32, one fixed order per row;
- the high-precision linears are `InvariantLinear` (float64, as on CPU) until an M-invariant BF16 GEMM replaces
  them; the FP8 linears need the M-invariant `triton_invariant` backend. The backwards use ordinary kernels.

Float64 accumulation is invariant in practice, not by construction: two orders of a float64 sum
differ by ~1e-16 relative, which changes the value rounded to fp32/bf16 only when it lies that
close to a rounding midpoint. That is why the trainer proves equality on a sample of tokens
every step before it uses the engine's log-probs. Elementwise ops (SiLU*mul, residual adds,
rotary with the same cos/sin) are invariant by nature.
"""


from .attention import fp64_attention, register_triton_attention, triton_attention
from .common import (
    CUDA_INVARIANT_GEMM_BACKENDS, INVARIANT_ATTENTION, INVARIANT_GEMM_BACKENDS, TRITON_ATTENTION,
    BitwiseUnavailable,
)
from .convert import NumericsReport, make_batch_invariant, numerics_of
from .linear import InvariantLinear
from .logprobs import invariant_log_probs, uses_triton_kernels
from .norm import InvariantRMSNorm

__all__ = [
    "INVARIANT_ATTENTION",
    "TRITON_ATTENTION",
    "INVARIANT_GEMM_BACKENDS",
    "CUDA_INVARIANT_GEMM_BACKENDS",
    "BitwiseUnavailable",
    "InvariantLinear",
    "InvariantRMSNorm",
    "NumericsReport",
    "fp64_attention",
    "invariant_log_probs",
    "make_batch_invariant",
    "numerics_of",
    "register_triton_attention",
    "triton_attention",
    "uses_triton_kernels",
]
