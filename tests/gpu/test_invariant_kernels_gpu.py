"""The batch-invariant Triton kernels on the GPU, at the sizes the H200 runs (SmolLM2-135M and Llama-3-8B shapes).

The same properties as tests/precision/test_invariant_kernels.py (which runs the kernels in Triton's CPU
interpreter), now with the hardware's tl.dot, exp2 and reductions:
- RMSNorm, log-softmax and attention rows give the same bits alone, in any batch and at any position (kind 1);
- log-probs of bf16 logits, of their fp32 copy (what transformers' generate returns) and of an unaligned view
  give the same bits (kind 1);
- an attention prefill row equals the paged-KV decode of that token (shuffled physical blocks, pages of 16 and 64),
  and a chunked prefill batched with other sequences' decodes; a GQA group packed into one tile gives each row the
  bits it has in a tile of its own (kind 1);
- each kernel is within its float64 worst-case bound (kind 2; tensor-core sums are given 4u per addition, since
  their fp32 accumulation truncates instead of rounding to nearest);
- a tiny Llama converted by make_batch_invariant on CUDA: a padded full forward, a packed one and a KV-cached
  prefill + decode give the same logits and log-probs (needs transformers; on the H200 it comes with the vLLM kit,
  benchmarks/h200_vllm.sh install);
- the transformers engine's sampled log-probs against the trainer's recompute, bf16 and jet_fp8 (FP8 linears on
  `triton_invariant`): the same bits, as `--precision.bitwise` promises; a failure names the sequences and
  response positions that differ, for the padded and the packed recompute both. benchmarks/bitwise_probe_gpu.py
  pins the first module that differs.
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu_testutil import requires_cuda_reason
from precision_testutil import assert_same_bits, assert_within, attention_bound, gamma, log_softmax_bound, unit_roundoff

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

if torch.cuda.is_available():  # the kernel modules import Triton, which CPU installs do not have
    from jetrl_precision.kernels import invariant_attention as ia
    from jetrl_precision.kernels import invariant_norm as inorm
    from jetrl_precision.kernels import invariant_softmax as isoft

U_TC = 2.0**-22  # tensor-core fp32 accumulation: truncation (2u), doubled for the multi-operand adder's alignment


def _data(shape, dtype, seed, sigma=0.5, spike=8.0):
    """Gaussian x a log-normal factor per row, a few spiked entries; no exact zeros."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, generator=g, device="cuda") * torch.exp(sigma * torch.randn(*shape[:-1], 1, generator=g, device="cuda"))
    x = torch.where(x == 0, torch.full_like(x, 1e-3), x)
    spikes = torch.rand(*shape, generator=g, device="cuda") < 2e-4
    return torch.where(spikes, x * spike, x).to(dtype)


def _subsets(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [[0], [n - 1], list(range(min(n, 7))), torch.randperm(n, generator=g)[: max(1, n // 3)].tolist(), list(range(n - 1, -1, -1))]


# ---- RMSNorm ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", [576, 4096])
def test_rms_norm_rows_do_not_depend_on_the_batch(hidden):
    x = _data((2048, hidden), torch.bfloat16, seed=1)
    r = _data((2048, hidden), torch.bfloat16, seed=2)
    w = _data((hidden,), torch.bfloat16, seed=3, sigma=0.0) * 0.2 + 1
    full = inorm.rms_norm(x, w, 1e-5)
    fused, res = inorm.fused_add_rms_norm(x, r, w, 1e-5)
    for rows in _subsets(2048):
        assert_same_bits(inorm.rms_norm(x[rows], w, 1e-5), full[rows], f"{len(rows)} rows")
        y, s = inorm.fused_add_rms_norm(x[rows], r[rows], w, 1e-5)
        assert_same_bits(y, fused[rows], f"fused, {len(rows)} rows")
        assert_same_bits(s, res[rows], f"residual, {len(rows)} rows")
    assert_same_bits(res, x + r, "the residual sum is the decoder layer's own bf16 add")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_rounding_points_and_bound(dtype):
    """transformers' rounding points given the kernel's rstd (a probe column), and the float64 bound of the CPU test."""
    hidden, eps = 4096, 1e-5
    g = torch.Generator(device="cuda").manual_seed(4)
    x = (torch.randint(-16, 17, (64, hidden), generator=g, device="cuda") * 0.125).to(dtype)
    x[:, 0] = 1.0
    w = _data((hidden,), dtype, seed=5)
    rstd = inorm.rms_norm(x.float(), torch.ones(hidden, device="cuda"), eps)[:, :1]
    assert_same_bits(inorm.rms_norm(x, w, eps), w * (x.float() * rstd).to(dtype), "rounding points")
    x = _data((64, hidden), dtype, seed=6)
    x64, w64 = x.double(), w.double()
    exact = w64 * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps)
    u, ux = unit_roundoff(torch.float32), unit_roundoff(dtype)
    bound = ((1 + gamma(hidden + 5)) * (1 + ux) * (1 + u) * (1 + ux) - 1) * exact.abs() + 1e-300
    assert_within(inorm.rms_norm(x, w, eps), exact, bound, "rms_norm")


# ---- log-softmax ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [49152, 128256])
def test_log_softmax_bound_and_row_invariance(vocab):
    x = (_data((97, vocab), torch.float32, seed=7, spike=20.0) * 3).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (97,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(8))
    for temperature in (1.0, 0.6):
        ls = isoft.log_softmax(x, temperature)
        z = x.double() / temperature
        assert_within(ls, torch.log_softmax(z, -1), log_softmax_bound(z, divided=temperature != 1.0), f"T={temperature}")
        lp = isoft.logprobs_of_labels(x, labels, temperature)
        assert_same_bits(lp, ls.gather(-1, labels[:, None])[:, 0], "gathered vs full")
        for rows in _subsets(97):
            assert_same_bits(isoft.logprobs_of_labels(x[rows], labels[rows], temperature), lp[rows], f"{len(rows)} rows")


@pytest.mark.parametrize("vocab", [4096, 49152, 49153])
def test_log_probs_do_not_depend_on_the_logits_dtype_or_alignment(vocab):
    """The engine scores generate's fp32 logits, the trainer its model's bf16 ones (the same values); a B = 1 slice
    of the trainer's logits may start at any offset. Triton vectorizes the loads by dtype and alignment (8 bf16 or
    4 fp32 elements per thread), so a layout-ordered sum would differ in the last bit (the kernel sums in a fixed
    pairwise tree; tests/precision/test_invariant_reductions_sm90_compile.py checks its TTGIR on CPU)."""
    x = (_data((257, vocab), torch.float32, seed=9, spike=20.0) * 3).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (257,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(10))
    odd = torch.empty(257 * vocab + 3, dtype=torch.bfloat16, device="cuda")[3:].view(257, vocab)
    odd.copy_(x)
    for temperature in (1.0, 0.9):
        ref = isoft.logprobs_of_labels(x, labels, temperature)
        assert_same_bits(isoft.logprobs_of_labels(x.float(), labels, temperature), ref, f"fp32 copy, T={temperature}")
        assert_same_bits(isoft.logprobs_of_labels(odd, labels, temperature), ref,
                         f"unaligned view, T={temperature}")
        assert_same_bits(isoft.log_softmax(x.float(), temperature), isoft.log_softmax(x, temperature), f"log_softmax, T={temperature}")


# ---- attention ------------------------------------------------------------------------------------------------------
SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}


def _qkv(total, shape, dtype, seed):
    h, hkv, d = SHAPES[shape]
    return _data((total, h, d), dtype, seed), _data((total, hkv, d), dtype, seed + 1), _data((total, hkv, d), dtype, seed + 2)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _paged(k, v, length, page, n_blocks, seed):
    """A sequence's keys/values in a paged cache with shuffled physical blocks; every other slot holds NaN."""
    perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).cuda()
    used = -(-length // page)
    kc = torch.full((n_blocks, page, *k.shape[1:]), math.nan, dtype=k.dtype, device="cuda")
    vc = torch.full_like(kc, math.nan)
    t = torch.arange(length, device="cuda")
    kc[perm[t // page], t % page] = k[:length]
    vc[perm[t // page], t % page] = v[:length]
    return kc, vc, perm[:used].to(torch.int32)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_prefill_within_the_bound_of_float64(shape, dtype):
    lens = [1024, 517, 77, 3]
    q, k, v = _qkv(sum(lens), shape, dtype, seed=10)
    cu = _cu(lens)
    out = ia.varlen_attention(q, k, v, cu, cu, max(lens))
    d = q.shape[-1]
    u_acc = U_TC if dtype == torch.bfloat16 else 2.0**-24  # fp32 inputs take IEEE FMA dots
    for s in range(len(lens)):
        sl = slice(int(cu[s]), int(cu[s + 1]))
        exact, bound = attention_bound(q[sl], k[sl], v[sl], d**-0.5, key_block=ia.KEY_BLOCK, u_acc=u_acc)
        assert_within(out[sl], exact, bound, f"sequence {s}")
        if s == 0:
            wrong, _ = attention_bound(q[sl], k[sl], v[sl], d**-0.5, key_block=ia.KEY_BLOCK, drop_diagonal=True)
            assert ((wrong - exact).abs() > bound).any(), "the bound must catch a wrong mask"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("page", [16, 64])
def test_prefill_row_equals_paged_decode(shape, page):
    """Every token of a 1024-token prefill == its decode against KV 0..t in a paged cache (1024 decodes in one batch)."""
    length = 1024
    q, k, v = _qkv(length, shape, torch.bfloat16, seed=20)
    cu = _cu([length])
    prefill = ia.varlen_attention(q, k, v, cu, cu, length)
    kc, vc, row = _paged(k, v, length, page, n_blocks=2 * (length // page), seed=page)
    table = row[None].expand(length, -1).contiguous()
    steps = torch.arange(length + 1, dtype=torch.int32, device="cuda")
    decode = ia.paged_attention(q, kc, vc, steps, steps[1:], table, 1)
    assert_same_bits(decode, prefill, "decode vs prefill")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packing_a_gqa_group_into_one_tile_keeps_every_rows_bits(shape, dtype):
    """A GQA group's heads as rows of one tile (the default) == one head per tile, prefill and paged decode: where a
    row sits in a tile does not change its bits on the tensor cores."""
    lens = [1024, 517, 77, 3]
    q, k, v = _qkv(sum(lens), shape, dtype, seed=40)
    cu = _cu(lens)
    packed = ia.varlen_attention(q, k, v, cu, cu, max(lens))
    assert_same_bits(packed, ia.varlen_attention(q, k, v, cu, cu, max(lens), pack_heads=False), "prefill packed vs not")
    length = 1024
    kc, vc, row = _paged(k, v, length, 16, n_blocks=128, seed=3)
    table = row[None].expand(length, -1).contiguous()
    steps = torch.arange(length + 1, dtype=torch.int32, device="cuda")
    decode = ia.paged_attention(q[:length], kc, vc, steps, steps[1:], table, 1)
    assert_same_bits(decode, ia.paged_attention(q[:length], kc, vc, steps, steps[1:], table, 1, pack_heads=False), "decode packed vs not")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_chunked_prefill_and_batch_composition(shape):
    lens = [700, 333]
    q, k, v = _qkv(sum(lens), shape, torch.bfloat16, seed=30)
    cu = _cu(lens)
    both = ia.varlen_attention(q, k, v, cu, cu, 700)
    assert_same_bits(ia.varlen_attention(q[700:], k[700:], v[700:], _cu([333]), _cu([333]), 333), both[700:], "alone")
    kc0, vc0, row0 = _paged(k[:700], v[:700], 700, 16, n_blocks=64, seed=1)
    kc1, vc1, row1 = _paged(k[700:], v[700:], 333, 16, n_blocks=32, seed=2)
    kc, vc = torch.cat([kc0, kc1]), torch.cat([vc0, vc1])
    table = torch.zeros(2, row0.numel(), dtype=torch.int32, device="cuda")
    table[0], table[1, : row1.numel()] = row0, row1 + 64
    for lo, hi in ((0, 256), (256, 512), (512, 700)):
        qq = torch.cat([q[lo:hi], q[1032:1033]])
        n = hi - lo
        out = ia.paged_attention(qq, kc, vc, torch.tensor([0, n, n + 1], device="cuda"), torch.tensor([hi, 333], device="cuda"), table, n)
        assert_same_bits(out[:n], both[lo:hi], f"chunk [{lo}, {hi})")
        assert_same_bits(out[n:], both[1032:1033], "a decode batched with the chunk")


# ---- the model ---------------------------------------------------------------------------------------------------------
def test_tiny_llama_on_cuda_full_forward_equals_prefill_and_decode():
    pytest.importorskip("transformers")
    from precision_testutil import prefill_then_decode, tiny_causal_lm

    from jetrl_precision.batch_invariant import TRITON_ATTENTION, invariant_log_probs, make_batch_invariant, numerics_of

    model = tiny_causal_lm(hidden=576, intermediate=1536, layers=2, heads=9, kv_heads=3, vocab=4096, dtype=torch.bfloat16)
    model = make_batch_invariant(model.cuda().eval())
    report = numerics_of(model)
    assert report.batch_invariant and report.attention == TRITON_ATTENTION and report.norm == "triton", report.detail()
    assert report.linear == "triton_invariant"  # the lm_head and every linear on the batch-invariant BF16 GEMM
    g = torch.Generator().manual_seed(40)
    width, real1 = 160, 97
    ids = torch.randint(0, 4096, (2, width), generator=g).cuda()
    mask = torch.ones(2, width, dtype=torch.long, device="cuda")
    mask[1, : width - real1] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        packed = model(input_ids=torch.cat([ids[0], ids[1, width - real1 :]])[None],
                       position_ids=torch.cat([torch.arange(width), torch.arange(real1)])[None].cuda(), use_cache=False).logits[0]
        assert_same_bits(packed[:width], full[0], "packed vs padded, row 0")
        assert_same_bits(packed[width:], full[1, width - real1 :], "packed vs padded, row 1")
    decoded = prefill_then_decode(model, ids, mask, pos, prompt=100)
    assert_same_bits(decoded[0], full[0], "row 0: prefill + decode vs full forward")
    assert_same_bits(decoded[1, width - real1 :], full[1, width - real1 :], "row 1 (left-padded)")
    lp_full = invariant_log_probs(full[:, :-1], ids[:, 1:], 0.7)
    lp_steps = torch.stack([invariant_log_probs(decoded[:, t], ids[:, t + 1], 0.7) for t in range(width - 1)], 1)
    assert_same_bits(lp_steps[0], lp_full[0], "log-probs, row 0")


@pytest.mark.parametrize("recipe", ["bf16", "jet_fp8"])
def test_engine_logprobs_are_the_trainers_on_cuda(tmp_path, recipe):
    """The bitwise mode's promise on the GPU, with the transformers engine: KV-cached sampling on the engine and the
    trainer's padded and packed recompute, both on the invariant kernels (FP8 linears on `triton_invariant`, K = 576
    with a partial last scale group), give every sampled token's log-prob the same bits."""
    pytest.importorskip("transformers")
    import dataclasses

    from precision_testutil import tiny_causal_lm

    from jetrl_precision import convert_to_fp8, get_recipe
    from jetrl_precision.batch_invariant import make_batch_invariant
    from openrlhf.models.actor import Actor, load_causal_lm
    from openrlhf.trainer.engines import hf_engine
    from openrlhf.trainer.engines.base import SamplingConfig
    from openrlhf.trainer.ppo_utils.experience_maker import sample_after_sync

    tiny_causal_lm(hidden=576, intermediate=1536, layers=2, heads=9, kv_heads=3, vocab=4096,
                   dtype=torch.bfloat16).save_pretrained(tmp_path)
    r = dataclasses.replace(get_recipe(recipe), gemm_backend="triton_invariant")
    engine = hf_engine.HFEngine(str(tmp_path), r, dtype=torch.bfloat16, batch_invariant=True, generate_batch_size=4,
                                device="cuda")
    trainer = convert_to_fp8(load_causal_lm(str(tmp_path), torch.bfloat16, "sdpa").cuda(), r, side="train")
    trainer = make_batch_invariant(trainer).eval()
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(4, 4096, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (6,), generator=g)]
    exp = sample_after_sync(trainer, engine, r, prompts, SamplingConfig(max_new_tokens=48, temperature=0.9, n=1, seed=1), 0)
    mask, rollout = exp.action_mask.cpu().bool(), exp.rollout_logprobs.float().cpu()
    assert mask.sum() >= 200
    failures = []
    for packing in (False, True):  # both layouts reported, whichever fails
        with torch.no_grad():
            lp = Actor(trainer, packing=packing)(exp.sequences.cuda(), exp.attention_mask.cuda(), exp.num_actions,
                                                 temperature=0.9).float().cpu()
        where = _where_bits_differ(lp, rollout, mask)
        if where:
            failures.append(f"{recipe}, packing={packing}: {where}")
    assert not failures, "\n".join(failures)


def _where_bits_differ(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor, show: int = 12) -> str:
    """'' when the masked [B, T] values have the same bits; else how many differ, in which sequences and at which
    response positions (with each sequence's length: a difference only at its last token, or only after another
    sequence of its generate batch stopped, points elsewhere than one everywhere), and the first few values."""
    diff = (got.view(torch.int32) != want.view(torch.int32)) & mask
    if not diff.any():
        return ""
    lengths = mask.sum(-1).tolist()
    per_seq = {b: torch.nonzero(diff[b])[:, 0].tolist() for b in range(diff.shape[0]) if diff[b].any()}
    seqs = "; ".join(f"seq {b} (len {lengths[b]}): positions {p[:16]}{' ...' if len(p) > 16 else ''}" for b, p in per_seq.items())
    first = [(b, t) for b, t in torch.nonzero(diff).tolist()][:show]
    ulps = [(int(got[b, t].view(torch.int32)) - int(want[b, t].view(torch.int32))) for b, t in first]
    vals = ", ".join(f"({b},{t}) trainer {got[b, t].item():.9g} engine {want[b, t].item():.9g} ({u:+d} ulp)"
                     for (b, t), u in zip(first, ulps))
    return f"{int(diff.sum())} of {int(mask.sum())} values differ in their bits; {seqs}; first: {vals}"
