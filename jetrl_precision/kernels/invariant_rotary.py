"""transformers' rotary embedding (neox style, whole head) as one Triton kernel, for the bitwise vLLM engine.

The engine's decode step would otherwise run about twenty small eager kernels per layer for what transformers
computes in `LlamaRotaryEmbedding.forward` + `apply_rotary_pos_emb`. Here the cos/sin of every position come from a
table built once with transformers' own ops (`engine_ops.rope_table`: fp32 `position * inv_freq`, cos/sin scaled,
rounded to the model dtype), so a token's cos/sin are the bits transformers computes for its position; one program
then rotates one head of one token with transformers' rounding points:

    out = bf16( bf16(x * cos) + bf16(rotate_half(x) * sin) )      rotate_half(x) = cat(-x[half:], x[:half])

Each product of two bf16 values is exact in fp32 and the sum of two bf16 values is rounded once, so rounding the
fp32 results to nearest-even (`cast_rn`, also under Triton's CPU interpreter) reproduces eager torch's bf16 `*` and
`+`; the roundings between the products and the sum also keep the compiler from contracting them into an FMA.
bf16 only (the bitwise vLLM engine's dtype); other dtypes use the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._rounding import cast_rn

__all__ = ["rotary_bf16"]


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, pos_ptr, table_ptr, sx, sout, stab, HEAD: tl.constexpr, HALF: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    p = tl.load(pos_ptr + tok).to(tl.int64)
    j = tl.arange(0, HALF)
    src = x_ptr + tok * sx + head * HEAD
    x1 = tl.load(src + j).to(tl.float32)
    x2 = tl.load(src + HALF + j).to(tl.float32)
    row = table_ptr + p * stab  # [cos (HEAD) | sin (HEAD)]
    c1 = tl.load(row + j).to(tl.float32)
    c2 = tl.load(row + HALF + j).to(tl.float32)
    s1 = tl.load(row + HEAD + j).to(tl.float32)
    s2 = tl.load(row + HEAD + HALF + j).to(tl.float32)
    a1 = cast_rn(x1 * c1, tl.bfloat16).to(tl.float32)
    b1 = cast_rn(-x2 * s1, tl.bfloat16).to(tl.float32)
    a2 = cast_rn(x2 * c2, tl.bfloat16).to(tl.float32)
    b2 = cast_rn(x1 * s2, tl.bfloat16).to(tl.float32)
    dst = out_ptr + tok * sout + head * HEAD
    tl.store(dst + j, cast_rn(a1 + b1, tl.bfloat16))
    tl.store(dst + HALF + j, cast_rn(a2 + b2, tl.bfloat16))


def rotary_bf16(positions: torch.Tensor, x: torch.Tensor, table: torch.Tensor, head_size: int) -> torch.Tensor:
    """x [tokens, heads * head_size] bf16 (rows may be strided, as slices of a fused qkv), positions [tokens] int,
    table [max_positions, 2 * head_size] bf16 (cos | sin per position) -> a new contiguous rotated tensor."""
    if x.dtype != torch.bfloat16 or table.dtype != torch.bfloat16:
        raise ValueError(f"rotary_bf16: bf16 query/key and table, got {x.dtype} and {table.dtype}")
    if head_size % 2 or (head_size // 2) & (head_size // 2 - 1):
        raise ValueError(f"rotary_bf16: head_size/2 must be a power of two, got head_size {head_size}")
    if x.dim() != 2 or x.shape[1] % head_size or x.stride(1) != 1 or table.shape[1] != 2 * head_size or table.stride(1) != 1:
        raise ValueError(f"rotary_bf16: x [tokens, heads * {head_size}] with unit column stride and table [P, {2 * head_size}]; "
                         f"got x {tuple(x.shape)} strides {x.stride()}, table {tuple(table.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        grid = (x.shape[0], x.shape[1] // head_size)
        _rotary_kernel[grid](x, out, positions, table, x.stride(0), out.stride(0), table.stride(0),
                             HEAD=head_size, HALF=head_size // 2, num_warps=1)
    return out
