"""The e4m3 cache's split-KV decode attention (jetrl_precision.kernels.decode_attention) on the GPU.

1. Llama-3.1-8B's attention shape (32 query heads on 8 KV heads, head_dim 128, pages of 16) through a shuffled
   block table, contexts from 1 to 1,100 keys, one slice and several: every decode row within the worst-case bound
   of the float64 attention of the dequantized cache (tests/precision_testutil.attention_bound), and within the same
   bound as vLLM's own Triton kernel (`unified_attention`) on the same cache, whose rows must be inside it too.
2. A CUDA graph captured once replays with the next step's queries, context lengths and blocks (what vLLM's decode
   graphs do): the same bits as an eager call on those inputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from precision_testutil import attention_bound, outlier_data  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
LENS = [1, 17, 64, 65, 300, 777, 1100]


def _case(seed: int = 0, lens=LENS, blocks: int = 400):
    from jetrl_precision.formats import E4M3_MAX, FP8_DTYPE

    g = torch.Generator().manual_seed(seed)
    q = outlier_data((len(lens), HEADS, DIM), group=DIM, generator=g).to(torch.bfloat16)
    kv = outlier_data((blocks, PAGE, KV_HEADS, 2 * DIM), group=DIM, generator=g).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    pages = -(-max(lens) // PAGE)
    perm = torch.randperm(blocks, generator=g)
    table = torch.stack([perm[(i * 11 + torch.arange(pages)) % blocks] for i in range(len(lens))]).to(torch.int32)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return (q.to(dev), kv.to(dev), torch.arange(len(lens) + 1, dtype=torch.int32, device=dev),
            torch.tensor(lens, dtype=torch.int32, device=dev), table.to(dev))


def _reference(q, kv, table, lens, s):
    """Row s's float64 attention and bound (on the GPU, in float64: the 1,100-key contexts are large for the CPU)."""
    n = lens[s]
    pos = torch.arange(n, device=q.device)
    keys = kv[table[s, pos // PAGE].long(), pos % PAGE].float()  # [n, Hkv, 2D], dequantized exactly
    qs = torch.zeros(n, HEADS, DIM, dtype=torch.bfloat16, device=q.device)
    qs[-1] = q[s]
    # key_block 32: one rescaling per 64-key tile and one for the merge of slices, counted generously
    ref, bound = attention_bound(qs, keys[..., :DIM].contiguous(), keys[..., DIM:].contiguous(), DIM**-0.5, key_block=32)
    return ref[-1], bound[-1]


def _vllm_rows(q, kv, cu, seq_lens, table):
    ua = pytest.importorskip("vllm.v1.attention.ops.triton_unified_attention")
    k, v = kv[..., :DIM], kv[..., DIM:]
    out = torch.empty_like(q)
    one = torch.ones((len(LENS), KV_HEADS), dtype=torch.float32, device=q.device)
    ua.unified_attention(q=q, k=k, v=v, out=out, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=seq_lens, max_seqlen_k=max(LENS),
                         softmax_scale=DIM**-0.5, causal=True, window_size=(-1, -1), block_table=table, softcap=0,
                         q_descale=None, k_descale=one, v_descale=one)
    return out


@pytest.mark.parametrize("splits", [1, 4, None])
def test_decode_rows_within_the_bound_beside_vllms_kernel(splits):
    from jetrl_precision.kernels.decode_attention import decode_attention

    q, kv, cu, seq_lens, table = _case()
    out = decode_attention(q, kv[..., :DIM], kv[..., DIM:], cu, seq_lens, table, splits=splits)
    theirs = _vllm_rows(q, kv, cu, seq_lens, table)
    for s in range(len(LENS)):
        ref, bound = _reference(q, kv, table, LENS, s)
        for name, rows in (("decode_attention", out), ("vLLM unified_attention", theirs)):
            err = (rows[s].double() - ref).abs()
            assert (err <= bound).all(), f"{name}, context {LENS[s]}, splits {splits}: {int((err > bound).sum())} outside, max {err.max():.3e}"


def test_a_captured_graph_replays_the_next_steps_inputs():
    from jetrl_precision.kernels.decode_attention import decode_attention

    q, kv, cu, seq_lens, table = _case(seed=1)
    out = torch.empty_like(q)
    decode_attention(q, kv[..., :DIM], kv[..., DIM:], cu, seq_lens, table, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, kv[..., :DIM], kv[..., DIM:], cu, seq_lens, table, out=out)
    q2, kv2, _, lens2, table2 = _case(seed=2, lens=[n + 1 for n in LENS])
    q.copy_(q2), kv.copy_(kv2), seq_lens.copy_(lens2), table.copy_(table2)
    graph.replay()
    eager = decode_attention(q, kv[..., :DIM], kv[..., DIM:], cu, seq_lens, table)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
