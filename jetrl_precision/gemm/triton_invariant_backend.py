"""The `triton_invariant` backend: a batch-invariant, decode-fast block-scaled FP8 GEMM (kernels.invariant_gemm).

Row m of the result has the same bits whatever M is and whichever rows run beside it: the kernel's split-K and
reduction order depend on K only, and its tile (which follows N and M's bucket) does not change the bits. That is
what lets a rollout engine decoding a few rows through a fused qkv or gate_up weight and a trainer multiplying
thousands through the separate projections produce identical outputs on a GPU (the bitwise mode). Its swap-AB
tiling reads each weight byte once per M tile, so decode-sized GEMMs stream the FP8 weight near memory speed.

Never picked by `auto`: ask for it with `gemm_backend="triton_invariant"` (recipe or --precision.gemm_backend).
Asking where it cannot run (no CUDA, no Triton, pre-sm89) fails with one line saying why.

A weight shape whose cuBLASLt GEMM gave this kernel's bits at every probed M on this device runs on cuBLASLt
instead (`vendor_route`, on unless `JETRL_INVARIANT_VENDOR_GEMM=off`): the same bits, at about twice the speed.
"""

from __future__ import annotations

import torch

from ..formats import QuantizedTensor
from ._triton_common import k_contiguous_operands, triton_unavailable
from .dispatch import GemmBackend, register_backend
from .vendor_route import routed

__all__ = ["NAME", "triton_invariant_gemm_nt", "invariant_kernel_gemm_nt", "unavailable_reason"]

NAME = "triton_invariant"


def invariant_kernel_gemm_nt(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The invariant kernel itself, never routed (what the vendor probe compares against)."""
    a_data, b_data = k_contiguous_operands(a, b, NAME)
    from ..kernels.invariant_gemm import fp8_gemm_nt_invariant

    return fp8_gemm_nt_invariant(a_data, a.scale, b_data, b.scale, b.block[0], out_dtype)


def triton_invariant_gemm_nt(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    if routed(a, b, out_dtype):
        from .torch_backend import torch_gemm_nt

        return torch_gemm_nt(a, b, out_dtype)
    return invariant_kernel_gemm_nt(a, b, out_dtype)


def unavailable_reason(device: torch.device) -> str | None:
    return triton_unavailable(device, NAME)


register_backend(GemmBackend(NAME, triton_invariant_gemm_nt, unavailable_reason))
