"""The batch-invariant Triton kernels (jetrl_precision.kernels.invariant_norm / _softmax / _attention), run for real
on CPU by Triton's interpreter, and the model wiring around them (make_batch_invariant(..., kernels="triton")).

What is proved here: each kernel against a float64 reference with a worst-case bound derived from the sizes
(docs/testing.md, kind 2), on data with outliers; rows and queries that give the same bits alone, in other batches
and at other positions; a prefill row equal to the paged-KV decode of that token with shuffled physical blocks
(kind 1, exact). The interpreter evaluates tl.dot and exp with numpy, not the GPU's instructions, so this checks the
kernels' logic (block order, masking, online softmax, addressing, rounding points); tests/gpu/
test_invariant_kernels_gpu.py checks the same properties on the hardware.

Skipped where Triton is not installed (the CI venv has none: importorskip) and on a machine with CUDA (the GPU
tests cover the kernels there, and the interpreter would take over every later Triton kernel of the process).
This module turns on TRITON_INTERPRET=1 for its process when Triton is installed but not yet imported. Run it in
any venv with Triton (`pip install triton`; the CPU wheel's interpreter is enough), on its own:
    python -m pytest -q tests/precision/test_invariant_kernels.py      (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_invariant_kernels_gpu.py runs these kernels natively", allow_module_level=True)
# The interpreter must be on before Triton is imported (triton.language's own jit helpers are built at import).
if importlib.util.find_spec("triton") is not None and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton was imported without TRITON_INTERPRET=1; run this file in its own process", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from precision_testutil import (  # noqa: E402
    assert_same_bits, assert_within, attention_bound, gamma, log_softmax_bound, outlier_data, unit_roundoff,
)
from jetrl_precision.kernels import invariant_attention as ia  # noqa: E402
from jetrl_precision.kernels import invariant_norm as inorm  # noqa: E402
from jetrl_precision.kernels import invariant_softmax as isoft  # noqa: E402

if not isinstance(inorm._rms_norm_kernel, InterpretedFunction):  # imported earlier in this process, compiled for a GPU
    pytest.skip("the kernel modules were imported before TRITON_INTERPRET=1; run this file in its own process", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]


# ---- RMSNorm ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_has_the_rounding_points_of_llama_rmsnorm(dtype):
    """Given the kernel's rstd (read off a probe column), the result is transformers' formula step by step: x * rstd
    in fp32, cast to the input dtype, then the weight multiply in fp32, rounded to the output dtype. The data's sum
    of squares is exact in fp32 in any order, so the probe's rstd is the one every dtype's run uses; how rstd
    itself rounds is the float64-bound test's business."""
    g = torch.Generator().manual_seed(0)
    hidden, eps = 1500, 1e-6  # two HIDDEN_BLOCK chunks, the second partial
    x = (torch.randint(-16, 17, (9, hidden), generator=g) * 0.125).to(dtype)  # squares are multiples of 2^-6
    x[:, 0] = 1.0
    w = outlier_data((hidden,), generator=g, sigma=0.5, spike_factor=8.0, dtype=dtype)
    rstd = inorm.rms_norm(x.float(), torch.ones(hidden), eps)[:, :1]  # x[:, 0] * rstd * 1 = rstd, exactly
    expected = w * (x.float() * rstd).to(dtype)
    assert_same_bits(inorm.rms_norm(x, w, eps), expected, "rms_norm")
    if dtype == torch.bfloat16:  # the test can tell the rounding points apart: multiplying before the cast differs
        assert not torch.equal((w.float() * x.float() * rstd).to(dtype), expected)
    r = (torch.randint(-16, 17, (9, hidden), generator=g) * 0.125).to(dtype)
    y, res = inorm.fused_add_rms_norm(x, r, w, eps)
    assert_same_bits(res, x + r, "residual sum")  # the decoder layer's own add
    assert_same_bits(y, inorm.rms_norm(x + r, w, eps), "fused norm")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_within_the_rounding_bound_of_float64(dtype):
    """|y - w x / sqrt(mean(x^2) + eps)| <= ((1 + gamma_{H+5}) (1 + u_x)(1 + u)(1 + u_y) - 1) |y*|: squares, the
    H-term sum, the division by H, + eps, sqrt, 1/., x * rstd (gamma_{H+5}); the cast to x's dtype (u_x); the weight
    product in fp32 (u); the output rounding (u_y). Every step is a relative error of a positive quantity."""
    g = torch.Generator().manual_seed(1)
    hidden, eps = 2100, 1e-5
    x = outlier_data((11, hidden), generator=g, dtype=dtype)
    w = outlier_data((hidden,), generator=g, sigma=0.5, spikes=2, spike_factor=30.0, dtype=dtype)
    y = inorm.rms_norm(x, w, eps)
    x64, w64 = x.double(), w.double()
    exact = w64 * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps)
    u, ux = unit_roundoff(torch.float32), unit_roundoff(dtype)
    rel = (1 + gamma(hidden + 5)) * (1 + ux) * (1 + u) * (1 + ux) - 1
    bound = rel * exact.abs() + 1e-300
    assert_within(y, exact, bound, "rms_norm")
    wrong = w64 * x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) / (0.9 * hidden) + eps)  # a wrong mean
    assert ((wrong - exact).abs() > bound).any(), "the bound must catch a wrong normalisation"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_rows_do_not_depend_on_the_batch(dtype):
    g = torch.Generator().manual_seed(2)
    x = outlier_data((37, 576), generator=g, dtype=dtype)  # SmolLM2's hidden size
    r = outlier_data((37, 576), generator=g, dtype=dtype)
    w = outlier_data((576,), generator=g, sigma=0.3, spikes=1, spike_factor=10.0, dtype=dtype)
    full = inorm.rms_norm(x, w, 1e-5)
    fused, res = inorm.fused_add_rms_norm(x, r, w, 1e-5)
    for rows in ([0], [36], [5, 6, 7], list(range(36, -1, -3))):
        assert_same_bits(inorm.rms_norm(x[rows], w, 1e-5), full[rows], f"rows {rows}")
        y, s = inorm.fused_add_rms_norm(x[rows], r[rows], w, 1e-5)
        assert_same_bits(y, fused[rows], f"fused rows {rows}")
        assert_same_bits(s, res[rows], f"residual rows {rows}")
    assert_same_bits(inorm.rms_norm(x.view(37, 1, 576), w, 1e-5).view(37, 576), full, "decode-shaped [B, 1, H]")


# ---- log-softmax ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_softmax_within_the_bound_of_float64(dtype, temperature):
    """log_softmax_bound (docs/testing.md) of z = logits / T; the gathered log-prob is the same value, bit for bit."""
    g = torch.Generator().manual_seed(3)
    vocab = 9000  # three VOCAB_BLOCK chunks, the last partial
    x = (outlier_data((6, vocab), generator=g, sigma=0.5, spikes=6, spike_factor=20.0) * 2).to(dtype)
    z = x.double() / temperature
    ls = isoft.log_softmax(x, temperature)
    bound = log_softmax_bound(z, divided=temperature != 1.0)
    exact = torch.log_softmax(z, -1)
    assert_within(ls, exact, bound, "log_softmax")
    wrong = torch.log_softmax(x.double() / (temperature * 1.01), -1)
    assert ((wrong - exact).abs() > bound).any(), "the bound must catch a wrong temperature"
    labels = torch.randint(0, vocab, (6,), generator=g)
    labels[0] = int(x[0].float().argmax())
    lp = isoft.logprobs_of_labels(x, labels, temperature)
    assert_same_bits(lp, ls.gather(-1, labels[:, None])[:, 0], "gathered vs full")


def test_log_probs_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(4)
    x = outlier_data((3, 7, 5000), generator=g, sigma=0.5, spikes=3, spike_factor=20.0).bfloat16()
    labels = torch.randint(0, 5000, (3, 7), generator=g)
    full = isoft.logprobs_of_labels(x, labels, 0.9)
    assert full.shape == (3, 7) and full.dtype == torch.float32
    for b, t in ((0, 0), (2, 6), (1, 3)):
        assert_same_bits(isoft.logprobs_of_labels(x[b, t : t + 1], labels[b, t : t + 1], 0.9), full[b, t : t + 1], f"({b}, {t})")
    assert_same_bits(isoft.logprobs_of_labels(x.flip(0), labels.flip(0), 0.9), full.flip(0), "reordered batch")
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5000\)"):
        isoft.logprobs_of_labels(x, labels + 5000, 1.0)


def test_log_probs_do_not_depend_on_the_logits_dtype_or_alignment():
    """The engine scores generate's fp32 logits, the trainer its model's bf16 ones (the same values), and a B = 1
    slice can start at any offset. The interpreter has no register layouts, so this passes here by construction;
    tests/precision/test_invariant_reductions_sm90_compile.py and the GPU twin of this test check the compiled kernel."""
    g = torch.Generator().manual_seed(5)
    x = outlier_data((4, 5001), generator=g, sigma=0.5, spikes=3, spike_factor=20.0).bfloat16()
    labels = torch.randint(0, 5001, (4,), generator=g)
    ref = isoft.logprobs_of_labels(x, labels, 0.9)
    assert_same_bits(isoft.logprobs_of_labels(x.float(), labels, 0.9), ref, "fp32 copy of bf16 logits")
    odd = torch.empty(4 * 5001 + 3, dtype=torch.bfloat16)[3:].view(4, 5001)  # 6 bytes past an aligned start
    odd.copy_(x)
    assert_same_bits(isoft.logprobs_of_labels(odd, labels, 0.9), ref, "unaligned view")
    assert_same_bits(isoft.log_softmax(x.float(), 0.9), isoft.log_softmax(x, 0.9), "log_softmax, fp32 copy")


# ---- attention ------------------------------------------------------------------------------------------------------
H, HKV, D = 9, 3, 64  # SmolLM2-135M's attention: 9 query heads sharing 3 KV heads, head_dim 64


def _qkv(total: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    mk = lambda heads: outlier_data((total, heads, D), generator=g, sigma=0.5, spikes=3, spike_factor=8.0, dtype=dtype)  # noqa: E731
    return mk(H), mk(HKV), mk(HKV)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_attention_prefill_within_the_bound_of_float64(dtype):
    lens = [37, 70, 5]  # none a multiple of the key block (32) or the query tile (16)
    q, k, v = _qkv(sum(lens), dtype, seed=5)
    cu = _cu(lens)
    out = ia.varlen_attention(q, k, v, cu, cu, max(lens))
    assert out.shape == q.shape and out.dtype == dtype
    caught = False
    for s, length in enumerate(lens):
        sl = slice(int(cu[s]), int(cu[s + 1]))
        exact, bound = attention_bound(q[sl], k[sl], v[sl], D**-0.5, key_block=ia.KEY_BLOCK)
        assert_within(out[sl], exact, bound, f"sequence {s}")
        if length > 1:
            wrong, _ = attention_bound(q[sl], k[sl], v[sl], D**-0.5, key_block=ia.KEY_BLOCK, drop_diagonal=True)
            caught |= bool(((wrong - exact).abs() > bound).any())
    assert caught, "the bound must catch a mask that drops the query's own key"


def _paged_cache(k, v, length, page, n_blocks, seed):
    """The keys/values 0..length-1 of one sequence in a paged cache with shuffled physical blocks; every other slot
    holds NaN, so a kernel that read a masked key would show it."""
    perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))
    kc = torch.full((n_blocks, page, HKV, D), math.nan, dtype=k.dtype)
    vc = torch.full_like(kc, math.nan)
    for t in range(length):
        kc[perm[t // page], t % page] = k[t]
        vc[perm[t // page], t % page] = v[t]
    return kc, vc, perm[: -(-length // page)].to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("page", [16, 40])  # smaller and larger than the key block
def test_prefill_row_equals_paged_decode_with_shuffled_blocks(dtype, page):
    """Token t of a 45-token prefill == the decode of token t against KV 0..t in a paged cache, for every t, all
    decoded in one batch (45 sequences sharing one block table row)."""
    length = 45
    q, k, v = _qkv(length, dtype, seed=6)
    cu = _cu([length])
    prefill = ia.varlen_attention(q, k, v, cu, cu, length)
    kc, vc, row = _paged_cache(k, v, length, page, n_blocks=8, seed=page)
    table = row[None].expand(length, -1).contiguous()
    decode = ia.paged_attention(q, kc, vc, torch.arange(length + 1, dtype=torch.int32), torch.arange(1, length + 1), table, 1)
    assert_same_bits(decode, prefill, "decode vs prefill")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_chunked_prefill_and_batch_composition_do_not_change_a_row(dtype):
    """Chunks of a sequence against its paged cache, batched with another sequence's decode; the same sequence
    alone, second in a packed batch, or in a padded layout with gaps: the same bits."""
    lens = [53, 21]
    q, k, v = _qkv(sum(lens), dtype, seed=7)
    cu = _cu(lens)
    both = ia.varlen_attention(q, k, v, cu, cu, max(lens))
    alone = ia.varlen_attention(q[53:], k[53:], v[53:], _cu([21]), _cu([21]), 21)
    assert_same_bits(alone, both[53:], "second sequence alone vs packed")
    swapped = ia.varlen_attention(torch.cat([q[53:], q[:53]]), torch.cat([k[53:], k[:53]]), torch.cat([v[53:], v[:53]]), _cu([21, 53]), _cu([21, 53]), 53)
    assert_same_bits(swapped[21:], both[:53], "first sequence moved to second place")
    # Padded layout [2, 64] with left padding on row 0 and right padding on row 1 (the trainer's batches).
    width = 64
    qp, kp, vp = (torch.zeros(2 * width, t.shape[1], D, dtype=dtype) for t in (q, k, v))
    for t_pad, t_src in ((qp, q), (kp, k), (vp, v)):
        t_pad[width - 53 : width] = t_src[:53]
        t_pad[width : width + 21] = t_src[53:]
    starts = torch.tensor([width - 53, width])
    padded = ia.attention_segments(qp, kp, vp, starts, torch.tensor(lens), starts, torch.tensor(lens), 53)
    assert_same_bits(padded[width - 53 : width], both[:53], "padded row 0")
    assert_same_bits(padded[width : width + 21], both[53:], "padded row 1")
    assert not padded[:width - 53].any() and not padded[width + 21 :].any()  # padding rows are zeros
    # Sequence 0 in chunks [0, 20), [20, 45), [45, 53) against its paged cache, each batched with sequence 1's
    # decode of its last token.
    kc0, vc0, row0 = _paged_cache(k[:53], v[:53], 53, 16, n_blocks=6, seed=1)
    kc1, vc1, row1 = _paged_cache(k[53:], v[53:], 21, 16, n_blocks=6, seed=2)
    kc, vc = torch.cat([kc0, kc1]), torch.cat([vc0, vc1])
    width_bt = max(row0.numel(), row1.numel())
    table = torch.zeros(2, width_bt, dtype=torch.int32)
    table[0, : row0.numel()], table[1, : row1.numel()] = row0, row1 + 6
    for lo, hi in ((0, 20), (20, 45), (45, 53)):
        qq = torch.cat([q[lo:hi], q[73:74]])
        out = ia.paged_attention(qq, kc, vc, torch.tensor([0, hi - lo, hi - lo + 1]), torch.tensor([hi, 21]), table, hi - lo)
        assert_same_bits(out[: hi - lo], both[lo:hi], f"chunk [{lo}, {hi})")
        assert_same_bits(out[hi - lo :], both[73:74], "decode next to a chunk")


def test_heads_per_tile_takes_the_largest_group_divisor_that_fits():
    assert [ia.heads_per_tile(g) for g in (1, 3, 4, 6, 7, 8, 16, 24, 32)] == [1, 3, 4, 6, 7, 8, 16, 12, 16]


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (4, 4), (12, 1)], ids=["group3", "group4", "mha", "mqa12"])
def test_packing_a_gqa_group_into_one_tile_keeps_every_rows_bits(heads, kv_heads):
    """Query heads sharing a KV head are rows of one tile; each row's bits are those it has in a tile of its own:
    prefill (rows of 16 // group positions, a padded last row where the group does not divide 16), and decode
    against a paged cache with shuffled blocks."""
    g = torch.Generator().manual_seed(11)
    lens = [37, 5, 20]
    mk = lambda n: outlier_data((sum(lens), n, D), generator=g, sigma=0.5, spikes=3, spike_factor=8.0, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = mk(heads), mk(kv_heads), mk(kv_heads)
    cu = _cu(lens)
    packed = ia.varlen_attention(q, k, v, cu, cu, max(lens))
    assert_same_bits(packed, ia.varlen_attention(q, k, v, cu, cu, max(lens), pack_heads=False), "packed vs one head per tile")
    length = 37
    kc = torch.full((6, 16, kv_heads, D), math.nan, dtype=torch.bfloat16)
    vc = torch.full_like(kc, math.nan)
    perm = torch.randperm(6, generator=g)
    for t in range(length):
        kc[perm[t // 16], t % 16], vc[perm[t // 16], t % 16] = k[t], v[t]
    table = perm[:3].to(torch.int32)[None].expand(length, -1).contiguous()
    steps, seen = torch.arange(length + 1, dtype=torch.int32), torch.arange(1, length + 1)
    decode = ia.paged_attention(q[:length], kc, vc, steps, seen, table, 1)
    assert_same_bits(decode, ia.paged_attention(q[:length], kc, vc, steps, seen, table, 1, pack_heads=False), "decode packed vs not")
    assert_same_bits(decode, packed[:length], "decode vs prefill")


def test_attention_refuses_bad_shapes_in_one_line():
    q, k, v = _qkv(8, torch.float32, seed=8)
    with pytest.raises(ValueError, match="9 query heads for 4 KV heads"):
        ia.varlen_attention(q, torch.zeros(8, 4, D), torch.zeros(8, 4, D), _cu([8]), _cu([8]), 8)
    with pytest.raises(TypeError, match="one dtype in bf16/fp32"):
        ia.varlen_attention(q, k.bfloat16(), v.bfloat16(), _cu([8]), _cu([8]), 8)
    with pytest.raises(ValueError, match="block_table"):
        ia.paged_attention(q, k[None], v[None], _cu([8]), torch.tensor([8]), torch.zeros(2, 1, dtype=torch.int32), 8)


# ---- the model wiring ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_tiny_llama_full_forward_equals_token_by_token_decoding(dtype):
    """make_batch_invariant(kernels="triton"): a padded full forward, a packed one and a KV-cached decode (transformers'
    DynamicCache, one token per step) give the same logits and log-probs, bit for bit."""
    pytest.importorskip("transformers")
    from precision_testutil import prefill_then_decode, tiny_causal_lm

    from jetrl_precision.batch_invariant import InvariantRMSNorm, TRITON_ATTENTION, invariant_log_probs, make_batch_invariant, numerics_of

    model = tiny_causal_lm(hidden=128, intermediate=256, heads=2, kv_heads=1, vocab=300, dtype=dtype).eval()  # head_dim 64
    make_batch_invariant(model, kernels="triton")
    report = numerics_of(model)
    assert report.batch_invariant and report.attention == TRITON_ATTENTION and report.norm == "triton", report.detail()
    assert report.linear == ("triton_invariant" if dtype == torch.bfloat16 else "fp64")  # bf16: the invariant GEMM
    assert sum(isinstance(m, InvariantRMSNorm) for m in model.modules()) == 2 * 2 + 1
    g = torch.Generator().manual_seed(9)
    lens, width = [19, 12], 19
    ids = torch.randint(0, 300, (2, width), generator=g)
    mask = torch.zeros(2, width, dtype=torch.long)
    mask[0], mask[1, width - 12 :] = 1, 1  # row 1 left-padded, as a generation batch is
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        packed_ids = torch.cat([ids[0], ids[1, width - 12 :]])[None]
        packed_pos = torch.cat([torch.arange(19), torch.arange(12)])[None]
        packed = model(input_ids=packed_ids, position_ids=packed_pos, use_cache=False).logits[0]
        assert_same_bits(packed[:19], full[0], "packed vs padded, row 0")
        assert_same_bits(packed[19:], full[1, width - 12 :], "packed vs padded, row 1")
    # As generation runs it: a prefill of the (left-padded) prompts, then one token per step against the cache.
    decoded = prefill_then_decode(model, ids, mask, pos, prompt=10)
    assert_same_bits(decoded[0], full[0], "row 0: prefill + decode vs full forward")
    assert_same_bits(decoded[1, width - 12 :], full[1, width - 12 :], "row 1 (left-padded): prefill + decode vs full forward")
    labels = ids[:, 1:]
    lp_full = invariant_log_probs(full[:, :-1], labels, 0.8)
    lp_dec = torch.cat([invariant_log_probs(decoded[0, t : t + 1], labels[0, t : t + 1], 0.8) for t in range(width - 1)])
    assert_same_bits(lp_dec, lp_full[0], "log-probs, one token at a time vs the whole row")


def test_triton_path_backward_matches_the_eager_model():
    """The backwards are ordinary (SDPA and transformers' RMSNorm recomputed): gradients equal the eager model's
    up to float noise (kind 4: max difference <= 1e-4 of the largest entry), padding included."""
    pytest.importorskip("transformers")
    from precision_testutil import tiny_causal_lm

    from jetrl_precision.batch_invariant import InvariantLinear, invariant_log_probs, make_batch_invariant

    eager = tiny_causal_lm(hidden=128, intermediate=256, heads=2, kv_heads=1, vocab=300, dtype=torch.float32)
    model = tiny_causal_lm(hidden=128, intermediate=256, heads=2, kv_heads=1, vocab=300, dtype=torch.float32)
    for m in eager.modules():  # the same float64 linears on both sides, so only attention and norm differ
        for name, child in list(m.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(m, name, InvariantLinear.from_linear(child))
    make_batch_invariant(model, kernels="triton")
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(0, 300, (2, 14), generator=g)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    grads = []
    for mdl in (eager, model):
        logits = mdl(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        lp = invariant_log_probs(logits[:, :-1], ids[:, 1:]) if mdl is model else torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        (lp * (mask[:, 1:] * mask[:, :-1])).sum().backward()  # real tokens predicted from real positions
        grads.append({n: p.grad.clone() for n, p in mdl.named_parameters()})
    for name, ref in grads[0].items():
        got = grads[1][name]
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), name


@pytest.mark.parametrize(("recipe", "dtype"), [("bf16", torch.float32), ("jet_fp8", torch.float32), ("bf16", torch.bfloat16)],
                         ids=["bf16-fp32", "jet_fp8-fp32", "bf16-bf16"])
def test_engine_logprobs_are_the_trainers_on_the_triton_kernels(tmp_path, recipe, dtype):
    """The transformers engine on the Triton kernels (KV-cached sampling, log-probs by invariant_log_probs on the
    device) against the trainer's Actor on the same kernels, padded and packed: every sampled token's log-prob
    has the same bits. (On CPU the FP8 linears run the emulated GEMM, on CUDA triton_invariant; a bf16 model's
    lm_head runs the batch-invariant BF16 GEMM, an fp32 one float64.)"""
    pytest.importorskip("transformers")
    from precision_testutil import tiny_causal_lm

    from jetrl_precision import convert_to_fp8, get_recipe
    from jetrl_precision.batch_invariant import make_batch_invariant
    from openrlhf.models.actor import Actor, load_causal_lm
    from openrlhf.trainer.engines import hf_engine
    from openrlhf.trainer.engines.base import SamplingConfig
    from openrlhf.trainer.ppo_utils.experience_maker import sample_after_sync

    tiny_causal_lm(hidden=128, intermediate=256, heads=2, kv_heads=1, vocab=300, dtype=dtype).save_pretrained(tmp_path)
    r = get_recipe(recipe)
    engine = hf_engine.HFEngine(str(tmp_path), r, dtype=dtype, batch_invariant=True, invariant_kernels="triton",
                                generate_batch_size=3)
    trainer = make_batch_invariant(convert_to_fp8(load_causal_lm(str(tmp_path), dtype, "sdpa"), r, side="train"), kernels="triton").eval()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, 300, (int(n),), generator=g).tolist() for n in torch.randint(3, 10, (5,), generator=g)]
    exp = sample_after_sync(trainer, engine, r, prompts, SamplingConfig(max_new_tokens=8, temperature=0.9, n=1, seed=1), 0)
    mask = exp.action_mask
    assert mask.sum() >= 20
    for packing in (False, True):
        with torch.no_grad():
            lp = Actor(trainer, packing=packing)(exp.sequences, exp.attention_mask, exp.num_actions, temperature=0.9).float()
        assert_same_bits(lp[mask], exp.rollout_logprobs[mask].float(), f"packing={packing}")


def test_bitwise_probe_names_the_first_module_that_differs(tmp_path, monkeypatch):
    """benchmarks/bitwise_probe_gpu.py (the GPU diagnostic) on CPU: with one output channel of layer 1's down_proj
    scaled in the engine after the weight sync, it reports differing log-probs and names that module first, with
    every module before it equal in its bits."""
    pytest.importorskip("transformers")
    import importlib.util
    import json
    from pathlib import Path

    from openrlhf.trainer.engines import hf_engine

    spec = importlib.util.spec_from_file_location("bitwise_probe_gpu", Path(__file__).resolve().parents[2] / "benchmarks" / "bitwise_probe_gpu.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    sync = hf_engine.HFEngine.update_weights

    def sync_then_break(self, tensors):
        sync(self, tensors)
        with torch.no_grad():
            self.model.model.layers[1].mlp.down_proj.weight[5] *= 1.5

    monkeypatch.setattr(hf_engine.HFEngine, "update_weights", sync_then_break)
    out = tmp_path / "probe.json"
    rc = probe.main(["--device", "cpu", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
                     "--vocab", "300", "--prompts", "3", "--max-new-tokens", "3", "--generate-batch-size", "2", "--out", str(out)])
    found = json.loads(out.read_text())
    assert rc == 1 and found["packing=False"]["differ"] > 0, found
    assert found["first_module_that_differs"] == "model.layers.1.mlp.down_proj", found
    names = [m["module"] for m in found["modules"]]
    before = found["modules"][: names.index("model.layers.1.mlp.down_proj")]
    assert len(before) > 20 and all(m["compared"] and m["differ"] == 0 for m in before), before
