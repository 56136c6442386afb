"""Block-scaled FP8 GEMM backends behind one dispatch.

Every backend computes the "NT" product ``out[M, N] = A[M, K] @ B[N, K]^T`` of two
`QuantizedTensor`s whose groups run along K. The three GEMMs of a linear layer map onto it:

- fprop:  y  = x(1x128)          . W(128x128)
- dgrad:  dX = dY(1x128)         . W^T(128x128, exact transpose of W's blocks)
- wgrad:  dW = dY^T(1x128 along tokens) . X^T(1x128 along tokens)
"""

from .dispatch import (
    BackendUnavailable,
    GemmBackend,
    PreparedGemm,
    available_backends,
    gemm_nt,
    get_backend,
    prepare_gemm,
    register_backend,
    resolve_backend,
    resolve_decode_backend,
)

__all__ = [
    "BackendUnavailable",
    "GemmBackend",
    "PreparedGemm",
    "available_backends",
    "gemm_nt",
    "get_backend",
    "prepare_gemm",
    "register_backend",
    "resolve_backend",
    "resolve_decode_backend",
]
