"""Loss, KL, log-prob and advantage math against hand-computed cases (CPU, pure torch)."""

from __future__ import annotations

import math

import pytest
import torch

from precision_testutil import LIBM_ULPS, assert_within, gamma, log_softmax_bound, sum_bound, unit_roundoff
from openrlhf.models import loss as loss_mod
from openrlhf.models import utils as mutils
from openrlhf.models.loss import ISCorrection, PolicyLoss, ValueLoss, aggregate_loss, kl_loss
from openrlhf.models.utils import compute_approx_kl, log_probs_from_logits, masked_mean, masked_sum, masked_whiten
from openrlhf.trainer.ppo_utils.advantages import (
    ESTIMATORS,
    GROUP_ESTIMATORS,
    compute_advantages,
    compute_token_rewards,
    discounted_returns,
    gae_advantages,
)

L = math.log


def _lengths_mask(lengths, t):
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]


# ---------------------------------------------------------------- log-probs


# log_softmax in fp32 against float64: log_softmax_bound covers the x / T rounding, the
# exp/sum/log of logsumexp in any order and with any libm (the row shifted by -1e3 makes the
# absolute error scale with |x / T|, which the bound carries).
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_from_logits_matches_float64_log_softmax(temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 37, generator=g) * 4
    logits[0, 1, 3] = 80.0  # an outlier logit
    logits[2, 4, :] -= 1e3  # a row shifted far from zero
    labels = torch.randint(0, 37, (3, 5), generator=g)
    z = logits.double() / temperature
    ref = torch.log_softmax(z, -1).gather(-1, labels[..., None]).squeeze(-1)
    got = log_probs_from_logits(logits, labels, temperature)
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    bound = log_softmax_bound(z, divided=temperature != 1.0).gather(-1, labels[..., None]).squeeze(-1)
    assert_within(got, ref, bound, "log-probs")
    assert bound.max() < 1e-3  # still tight enough to catch a wrong label or temperature


def _log_softmax_grad_bound(z: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """Bound on the fp32 gradient of sum_t w_t (z_t,label - lse(z_t)) with respect to the logits x = z * T.

    Per logit: w / T (onehot - p) with p = exp(z - lse). The argument of that exp is off by the
    forward bound of lse plus the rounding of z and of z - lse; exp adds its libm error; the
    product with w, the onehot subtraction and the division by T are one rounding each.
    """
    u = unit_roundoff(torch.float32)
    p = torch.softmax(z, -1)
    big_m = z.abs().amax(-1, keepdim=True)
    lse_err = log_softmax_bound(z, divided=temperature != 1.0).amax(-1, keepdim=True)
    arg_err = lse_err + u * big_m + u * (z - torch.logsumexp(z, -1, keepdim=True)).abs()
    p_err = p * (torch.expm1(arg_err) + 2 * LIBM_ULPS * u * (1 + arg_err))
    w = w.double().abs()[..., None]
    return (w * (p_err + gamma(3) * (1 + p))) / temperature + 1e-300


def test_log_probs_chunked_path_and_gradient(monkeypatch):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 7, 11, generator=g) * 3).requires_grad_(True)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    weights = torch.arange(14.0).reshape(2, 7)
    full = log_probs_from_logits(logits, labels, 0.9)
    (gfull,) = torch.autograd.grad((full * weights).sum(), logits)
    monkeypatch.setattr(mutils, "_FP32_CHUNK_ELEMS", 3 * 11)  # 3 tokens per chunk, ragged last chunk
    chunked = log_probs_from_logits(logits, labels, 0.9)
    (gchunk,) = torch.autograd.grad((chunked * weights).sum(), logits)
    z = logits.detach().double() / 0.9
    ref = torch.log_softmax(z, -1).gather(-1, labels[..., None]).squeeze(-1)
    (gref,) = torch.autograd.grad((torch.log_softmax(logits.double() / 0.9, -1).gather(-1, labels[..., None]).squeeze(-1) * weights.double()).sum(), logits)
    fwd, bwd = log_softmax_bound(z, divided=True).gather(-1, labels[..., None]).squeeze(-1), _log_softmax_grad_bound(z, weights, 0.9)
    # Chunks change which elements take the vectorized or the scalar exp path: each side is within
    # the bound of float64, so they are within twice the bound of each other (not bitwise).
    assert_within(chunked, ref, fwd, "chunked log-probs")
    assert_within(full, ref, fwd, "full log-probs")
    assert_within(chunked, full, 2 * fwd, "chunked vs full")
    assert_within(gchunk, gref, bwd, "chunked gradient")
    assert_within(gfull, gref, bwd, "full gradient")


def test_log_probs_of_a_response_slice_read_it_row_by_row(monkeypatch):
    """The actor scores `logits[:, -A - 1 : -1]`, a slice that cannot be flattened without copying every logit
    (gigabytes at 4k-token rollouts): it is read one sequence at a time, with the same values and gradient as a
    contiguous copy, and no fp32 block larger than the chunk is made."""
    g = torch.Generator().manual_seed(4)
    full = (torch.randn(3, 9, 13, generator=g) * 3).requires_grad_(True)
    labels = torch.randint(0, 13, (3, 5), generator=g)
    sliced = full[:, -6:-1]
    assert not mutils._viewable(sliced)
    widest = []
    real_float = torch.Tensor.float

    def spy(t, *a, **k):
        widest.append(t.shape[0] if t.dim() == 2 else -1)
        return real_float(t, *a, **k)

    # One token per chunk on both sides, so both run the same per-token arithmetic and must agree bit for bit.
    monkeypatch.setattr(mutils, "_FP32_CHUNK_ELEMS", 13)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "float", spy)
        got = log_probs_from_logits(sliced, labels, 0.8)
    assert widest and max(widest) == 1
    want = log_probs_from_logits(sliced.contiguous(), labels, 0.8)
    assert torch.equal(got, want)
    (g_got,) = torch.autograd.grad(got.sum(), full)
    (g_want,) = torch.autograd.grad(want.sum(), full)
    assert torch.equal(g_got, g_want) and g_got[:, :3].abs().sum() == 0 and g_got[:, -1].abs().sum() == 0


def test_log_probs_bf16_input_upcast():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 4, 50, generator=g) * 5).bfloat16()
    labels = torch.randint(0, 50, (2, 4), generator=g)
    got = log_probs_from_logits(logits, labels)
    z = logits.double()  # bf16 values are exact in fp32: the upcast adds no rounding
    ref = torch.log_softmax(z, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert got.dtype == torch.float32
    assert_within(got, ref, log_softmax_bound(z).gather(-1, labels[..., None]).squeeze(-1), "bf16 log-probs")


def test_log_probs_shape_and_temperature_errors():
    with pytest.raises(ValueError, match="do not match"):
        log_probs_from_logits(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        log_probs_from_logits(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), 0.0)


# ---------------------------------------------------------------- KL + masked reductions


def test_approx_kl_hand_values_and_clamp():
    logp = torch.tensor([[-1.0, -2.0, 0.0, -40.0]])
    ref = torch.tensor([[-1.5, -1.0, -50.0, 0.0]])
    # log-ratios: 0.5, -1.0, clamp(50)=10, clamp(-40)=-10
    torch.testing.assert_close(compute_approx_kl(logp, ref, "k1"), torch.tensor([[0.5, -1.0, 10.0, -10.0]]))
    torch.testing.assert_close(compute_approx_kl(logp, ref, "k2"), torch.tensor([[0.125, 0.5, 50.0, 50.0]]))
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0, math.exp(-10) - 1 + 10, math.exp(10) - 1 - 10]
    torch.testing.assert_close(compute_approx_kl(logp, ref, "k3"), torch.tensor([k3]))
    m = torch.tensor([[1, 0, 1, 0]])
    torch.testing.assert_close(compute_approx_kl(logp, ref, "k1", mask=m), torch.tensor([[0.5, 0.0, 10.0, 0.0]]))
    with pytest.raises(ValueError, match="--algo.kl.estimator"):
        compute_approx_kl(logp, ref, "k4")


def test_k1_k3_unbiased_on_samples_from_pi():
    g = torch.Generator().manual_seed(4)
    pi = torch.softmax(torch.randn(20, generator=g) * 2, -1)
    ref = torch.softmax(torch.randn(20, generator=g) * 2, -1)
    true_kl = (pi * (pi.log() - ref.log())).sum()
    idx = torch.multinomial(pi, 400_000, replacement=True, generator=g)
    lp, lr = pi.log()[idx], ref.log()[idx]
    for est in ("k1", "k3"):
        assert abs(compute_approx_kl(lp, lr, est).mean() - true_kl) < 0.02 * max(1.0, true_kl.item())
    assert (compute_approx_kl(lp, lr, "k3") >= 0).all()


def test_masked_reductions_ignore_garbage_and_empty():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), -6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_sum(x, m).item() == 1.0
    torch.testing.assert_close(masked_mean(x, m), torch.tensor(0.25))
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.tensor([1.5, -1.0]))
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0
    w = masked_whiten(x, m)
    vals = torch.tensor([1.0, 2.0, 4.0, -6.0])
    exp = (vals - vals.mean()) / torch.sqrt(vals.var(unbiased=False) + 1e-8)
    torch.testing.assert_close(w[m.bool()], exp)
    assert (w[~m.bool()] == 0).all()


# ---------------------------------------------------------------- policy loss


def _policy_inputs():
    # ratios 1.5, 0.5, 1.5, 0.5, 1.1 and one masked-out token (huge ratio, must not matter)
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.2, -1.0]])
    ratios = torch.tensor([[1.5, 0.5, 1.5, 0.5, 1.1, 1e3]])
    logp = old + ratios.log()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    return logp, old, adv, mask


def test_policy_loss_hand_cases_and_gradients():
    logp, old, adv, mask = _policy_inputs()
    logp = logp.clone().requires_grad_(True)
    out = PolicyLoss(0.2, 0.2)(logp, old, adv, mask)
    # r=1.5,A=+1 -> clip 1.2 -> -1.2 (clipped); r=.5,A=+1 -> -0.5; r=1.5,A=-1 -> 1.5;
    # r=.5,A=-1 -> clip .8 -> 0.8 (clipped); r=1.1,A=2 -> -2.2; masked -> 0
    torch.testing.assert_close(out.token_loss, torch.tensor([[-1.2, -0.5, 1.5, 0.8, -2.2, 0.0]]))
    torch.testing.assert_close(out.clip_frac, torch.tensor(2 / 5))
    torch.testing.assert_close(out.approx_ratio_mean, torch.tensor((1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5))
    assert out.is_weight_mean is None
    (grad,) = torch.autograd.grad(out.token_loss.sum(), logp)
    # d/dlogp of -r*A = -r*A on unclipped tokens, 0 on clipped and masked tokens
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, 1.5, 0.0, -2.2, 0.0]]))


def test_policy_loss_clip_higher():
    logp, old, adv, mask = _policy_inputs()
    out = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28)(logp, old, adv, mask)
    torch.testing.assert_close(out.token_loss, torch.tensor([[-1.28, -0.5, 1.5, 0.8, -2.2, 0.0]]))


def test_policy_loss_dual_clip():
    old = torch.zeros(1, 4)
    ratios = torch.tensor([[5.0, 2.0, 5.0, 0.1]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])
    out = PolicyLoss(0.2, 0.2, dual_clip=3.0)(ratios.log(), old, adv, torch.ones(1, 4))
    # A<0: loss = min(max(r, clip r)*|A|, 3|A|): r=5 -> 3; r=2 -> 2; r=.1 -> clip .8*2=1.6; A>0 untouched: -1.2
    torch.testing.assert_close(out.token_loss, torch.tensor([[3.0, 2.0, -1.2, 1.6]]))
    torch.testing.assert_close(out.dual_clip_frac, torch.tensor(0.25))
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLoss(dual_clip=0.9)


def test_policy_loss_is_correction_tis_and_icepop():
    logp, old, adv, mask = _policy_inputs()
    base = torch.tensor([[-1.2, -0.5, 1.5, 0.8, -2.2, 0.0]])
    # w = exp(old - rollout): 0.25, 2, 8, 1, 0.5, (masked) 100
    w_raw = torch.tensor([[0.25, 2.0, 8.0, 1.0, 0.5, 100.0]])
    rollout = old - w_raw.log()
    tis = PolicyLoss(is_correction=ISCorrection("tis", 0.5, 5.0))(logp, old, adv, mask, rollout)
    w_tis = torch.tensor([[0.5, 2.0, 5.0, 1.0, 0.5, 0.0]])
    torch.testing.assert_close(tis.token_loss, base * w_tis)
    torch.testing.assert_close(tis.is_weight_mean, torch.tensor((0.5 + 2 + 5 + 1 + 0.5) / 5))
    torch.testing.assert_close(tis.is_outside_frac, torch.tensor(2 / 5))
    ice = PolicyLoss(is_correction=ISCorrection("icepop", 0.5, 5.0))(logp, old, adv, mask, rollout)
    w_ice = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.5, 0.0]])  # 0.5 is inside (inclusive bounds)
    torch.testing.assert_close(ice.token_loss, base * w_ice)
    # weight is detached: gradient is w * d(base)
    lp = logp.clone().requires_grad_(True)
    out = PolicyLoss(is_correction=ISCorrection("tis", 0.5, 5.0))(lp, old, adv, mask, rollout)
    (grad,) = torch.autograd.grad(out.token_loss.sum(), lp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, 1.5, 0.0, -2.2, 0.0]]) * w_tis)


def test_policy_loss_is_requires_rollout_logprobs_and_validates():
    logp, old, adv, mask = _policy_inputs()
    with pytest.raises(ValueError, match="rollout_log_probs"):
        PolicyLoss(is_correction=ISCorrection("tis"))(logp, old, adv, mask)
    with pytest.raises(ValueError, match="is_correction_type"):
        ISCorrection("seq")
    with pytest.raises(ValueError, match="low < high"):
        ISCorrection("tis", 2.0, 1.0)


def test_policy_loss_extreme_log_ratio_stays_finite():
    old = torch.tensor([[0.0, 0.0]])
    logp = torch.tensor([[80.0, -80.0]])  # clamped to +-20 before exp
    out = PolicyLoss()(logp, old, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))
    assert torch.isfinite(out.token_loss).all()
    torch.testing.assert_close(out.token_loss, torch.tensor([[math.exp(20.0), -math.exp(-20.0)]]))


# ---------------------------------------------------------------- value / KL loss


def test_value_loss_hand_cases():
    values = torch.tensor([[2.0, 1.2, 0.0, 3.0]])
    old = torch.tensor([[1.0, 1.0, 0.3, -50.0]])
    ret = torch.tensor([[2.2, 0.0, -1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # tok0: (2-2.2)^2=.04, vclip=1.5 -> .49 => .245 ; tok1: 1.44, vclip=1.2 -> 1.44 => .72
    # tok2: (0+1)^2=1, vclip=0.3-0.3=0.0 -> same => .5 ; masked -> 0
    got = ValueLoss(0.5)(values, old, ret, mask)
    torch.testing.assert_close(got, torch.tensor([[0.245, 0.72, 0.5, 0.0]]))
    torch.testing.assert_close(ValueLoss(None)(values, old, ret, mask), torch.tensor([[0.02, 0.72, 0.5, 0.0]]))


def test_kl_loss_k3_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.3]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -7.0]])
    mask = torch.tensor([[1, 1, 0]])
    tl = kl_loss(logp, ref, mask, "k3")
    (g,) = torch.autograd.grad(tl.sum(), logp)
    # d/dlogp [e^(ref-logp) - 1 - (ref-logp)] = 1 - e^(ref-logp)
    torch.testing.assert_close(g, torch.tensor([[1 - math.exp(-0.5), 1 - math.exp(1.0), 0.0]]))
    assert tl[0, 2] == 0


# ---------------------------------------------------------------- token-level aggregation


def test_aggregate_loss_equals_global_token_mean_over_microbatches_and_ranks():
    """Each rank runs `gas` micro-batches with uneven token counts; DeepSpeed divides each
    micro-batch loss by gas and averages gradients over ranks. With global_num_tokens = all
    tokens and scale = world * gas, the step gradient is the single-batch token-mean gradient."""
    g = torch.Generator().manual_seed(5)
    world, gas, t, d = 3, 2, 9, 4
    theta = torch.randn(d, generator=g, dtype=torch.float64)
    micro = []  # micro[rank][j] = (x [b,t,d], y [b,t], mask [b,t])
    for r in range(world):
        row = []
        for j in range(gas):
            b = 1 + (r + 2 * j) % 3
            lengths = torch.randint(1, t + 1, (b,), generator=g)
            lengths[0] = 1 if (r + j) % 2 else t  # very uneven counts
            x = torch.randn(b, t, d, generator=g, dtype=torch.float64)
            x[0, 0] *= 30  # an outlier token
            row.append((x, torch.randn(b, t, generator=g, dtype=torch.float64), _lengths_mask(lengths.tolist(), t)))
        micro.append(row)

    def token_loss(p, x, y):
        return (x @ p - y) ** 2

    # reference: token mean over the whole step batch
    p = theta.clone().requires_grad_(True)
    all_loss = torch.cat([token_loss(p, x, y)[m] for row in micro for (x, y, m) in row])
    (ref_grad,) = torch.autograd.grad(all_loss.mean(), p)

    n_global = sum(int(m.sum()) for row in micro for (_, _, m) in row)
    rank_grads = []
    naive_rank_grads = []
    for row in micro:
        acc = torch.zeros(d, dtype=torch.float64)
        naive = torch.zeros(d, dtype=torch.float64)
        for x, y, m in row:
            p = theta.clone().requires_grad_(True)
            loss = aggregate_loss(token_loss(p, x, y), m, n_global, scale=world * gas)
            acc += torch.autograd.grad(loss / gas, p)[0]  # DeepSpeed: loss scaled by 1/gas
            p2 = theta.clone().requires_grad_(True)
            naive += torch.autograd.grad(masked_mean(token_loss(p2, x, y), m) / gas, p2)[0]
        rank_grads.append(acc)
        naive_rank_grads.append(naive)
    step_grad = torch.stack(rank_grads).mean(0)  # all-reduce average over ranks
    # Equal in real arithmetic; in float64 both sum the same N per-token terms 2 (x.p - y) x / N in
    # different orders (d-term dot products, scalings by gas/world): gamma_{N + d + 8} of sum |term| each.
    magnitude = sum(
        (2 * x[mk].abs() * ((x[mk].abs() @ theta.abs()) + y[mk].abs())[:, None]).sum(0) for row in micro for (x, y, mk) in row
    ) / n_global
    assert_within(step_grad, ref_grad, 2 * gamma(n_global + d + 8, torch.float64) * magnitude, "step gradient")
    # The per-micro-batch mean is NOT the global token mean with uneven counts (the test has teeth).
    assert not torch.allclose(torch.stack(naive_rank_grads).mean(0), ref_grad, rtol=1e-3, atol=1e-6)


def test_aggregate_loss_value_and_errors():
    tl = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 4.0, 5.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    torch.testing.assert_close(aggregate_loss(tl, m, 10.0, scale=4.0), torch.tensor((1 + 2 + 3 + 5) * 4 / 10.0))
    with pytest.raises(ValueError, match="global_num_tokens"):
        aggregate_loss(tl, m, 0)


# ---------------------------------------------------------------- advantages

# Two prompts x 3 samples, ragged lengths; the padding holds garbage that must never leak.
REWARDS = torch.tensor([1.0, 0.0, 5.0, 4.0, -2.0, 1.0])
LENGTHS = [2, 4, 1, 3, 4, 2]
T = 4
MASK = _lengths_mask(LENGTHS, T)


def _broadcast(per_row):
    return torch.tensor(per_row, dtype=torch.float32)[:, None] * MASK.float()


def test_compute_token_rewards_hand():
    kl = torch.full((6, T), 99.0)
    kl[MASK] = torch.arange(1, 17, dtype=torch.float32) / 10  # 0.1 .. 1.6 in row order
    tr = compute_token_rewards(REWARDS, MASK, None, 0.0)
    exp = torch.zeros(6, T)
    for i, n in enumerate(LENGTHS):
        exp[i, n - 1] = REWARDS[i]
    torch.testing.assert_close(tr, exp)
    tr = compute_token_rewards(REWARDS, MASK, kl, 0.5)
    torch.testing.assert_close(tr, exp - 0.5 * torch.where(MASK, kl, torch.zeros_like(kl)))
    assert tr[0, 0].item() == pytest.approx(-0.05) and tr[0, 1].item() == pytest.approx(1.0 - 0.1)
    with pytest.raises(ValueError, match="no response token"):
        compute_token_rewards(torch.ones(2), torch.tensor([[1, 0], [0, 0]]), None, 0.0)


def test_group_norm_hand():
    adv, ret = compute_advantages("group_norm", REWARDS, MASK, n_samples_per_prompt=3)
    # group 1: [1,0,5] mean 2, sample std sqrt(7); group 2: [4,-2,1] mean 1, sample std 3
    s7 = math.sqrt(7) + 1e-6
    exp = _broadcast([-1 / s7, -2 / s7, 3 / s7, 3 / (3 + 1e-6), -3 / (3 + 1e-6), 0.0])
    torch.testing.assert_close(adv, exp)
    torch.testing.assert_close(ret, exp)


def test_group_norm_identical_rewards_give_zero():
    adv, _ = compute_advantages("group_norm", torch.tensor([2.0, 2.0, 2.0, 7.0]), MASK[:4], n_samples_per_prompt=2)
    torch.testing.assert_close(adv[:2], torch.zeros(2, T))
    assert adv[2:][MASK[2:4]].abs().min() > 0.5


def test_dr_grpo_and_rloo_hand():
    adv, _ = compute_advantages("dr_grpo", REWARDS, MASK, n_samples_per_prompt=3)
    torch.testing.assert_close(adv, _broadcast([-1.0, -2.0, 3.0, 3.0, -3.0, 0.0]))
    adv, ret = compute_advantages("rloo", REWARDS, MASK, n_samples_per_prompt=3)
    # r - mean(others): 1-2.5, 0-3, 5-0.5 | 4-(-0.5), -2-2.5, 1-1
    torch.testing.assert_close(adv, _broadcast([-1.5, -3.0, 4.5, 4.5, -4.5, 0.0]))
    torch.testing.assert_close(ret, adv)


def test_rloo_is_rescaled_dr_grpo_on_random_groups():
    g = torch.Generator().manual_seed(6)
    n = 5
    r = torch.randn(4 * n, generator=g) * 3
    r[3] = 40.0
    m = _lengths_mask(torch.randint(1, 7, (4 * n,), generator=g).tolist(), 6)
    a_rloo, _ = compute_advantages("rloo", r, m, n_samples_per_prompt=n)
    a_dr, _ = compute_advantages("dr_grpo", r, m, n_samples_per_prompt=n)
    # Exactly n / (n - 1) (r_i - mean) in real arithmetic. fp32: each side sums its group (gamma_{n-1}
    # sum|r|) and adds <= 3 roundings of values <= |r_i| + |sum|; the rescale adds 2 more.
    grp = r.double().reshape(-1, n)
    exact = (n / (n - 1)) * (grp - grp.mean(1, keepdim=True))
    s_abs = grp.abs().sum(1, keepdim=True)
    per_row = (2 * sum_bound(grp, dim=1)[:, None] + gamma(5) * (grp.abs() + s_abs)) / (n - 1) + gamma(5) * exact.abs()
    bound = (per_row.reshape(-1)[:, None] * m).double()
    assert_within(a_rloo, a_dr * n / (n - 1), 2 * bound, "rloo vs rescaled dr_grpo")
    assert_within(a_rloo, exact.reshape(-1)[:, None] * m, bound, "rloo vs float64")


def test_reinforce_baseline_hand():
    adv, ret = compute_advantages("reinforce_baseline", REWARDS, MASK, n_samples_per_prompt=3)
    torch.testing.assert_close(ret, _broadcast([-1.0, -2.0, 3.0, 3.0, -3.0, 0.0]))
    # 16 tokens: -1 x2, -2 x4, 3 x1, 3 x3, -3 x4, 0 x2 -> mean -10/16, E[x^2] 90/16
    mean, var = -0.625, 90 / 16 - 0.625**2
    exp = _broadcast([(v - mean) / math.sqrt(var + 1e-8) for v in [-1.0, -2.0, 3.0, 3.0, -3.0, 0.0]])
    torch.testing.assert_close(adv, exp)


def test_reinforce_hand():
    adv, ret = compute_advantages("reinforce", REWARDS, MASK, n_samples_per_prompt=1)
    torch.testing.assert_close(ret, _broadcast(REWARDS.tolist()))
    # tokens: 1 x2, 0 x4, 5 x1, 4 x3, -2 x4, 1 x2 -> mean 13/16, E[x^2] 93/16
    mean = 13 / 16
    var = 93 / 16 - mean**2
    exp = _broadcast([(v - mean) / math.sqrt(var + 1e-8) for v in REWARDS.tolist()])
    torch.testing.assert_close(adv, exp)


@pytest.mark.parametrize("estimator,n", [("reinforce", 1), ("reinforce_baseline", 3)])
def test_no_std_norm_subtracts_the_batch_mean_only(estimator, n):
    """--algo.advantage.no_std_norm (OpenRLHF v0.11): the batch normalization keeps the scale, only the mean goes."""
    whitened, returns = compute_advantages(estimator, REWARDS, MASK, n_samples_per_prompt=n)
    centered, _ = compute_advantages(estimator, REWARDS, MASK, n_samples_per_prompt=n, std_norm=False)
    m = MASK.bool()
    x = returns[m].double()  # the normalized quantity (exact small numbers here)
    k = int(m.sum())
    ref = x - x.mean()
    # fp32: the masked mean (k-term sum, one division) and the subtraction
    bound_c = gamma(k + 2) * (x.abs() + x.abs().max())
    assert_within(centered[m], ref, bound_c, f"{estimator} centered")
    assert not centered[~m].any()
    # whitening divides the same centered values by sqrt(var + 1e-8): var's k squares, sum and division, the rsqrt and
    # the product add a relative gamma(k + 8) on top of the centered values' own error
    std = (ref.pow(2).mean() + 1e-8).sqrt()
    assert_within(whitened[m], ref / std, bound_c / std + gamma(k + 8) * (ref / std).abs(), f"{estimator} whitened")
    assert abs(std.item() - 1) > 0.5  # so the two results differ, and the first check would catch a division


def test_reinforce_discounted_return_hand():
    ret = discounted_returns(compute_token_rewards(REWARDS, MASK, None, 0.0), MASK, gamma=0.5)
    # row 3: length 3, reward 4 -> [1, 2, 4, 0]; row 1: length 4, reward 0 -> 0
    torch.testing.assert_close(ret[3], torch.tensor([1.0, 2.0, 4.0, 0.0]))
    torch.testing.assert_close(ret[4], torch.tensor([-0.25, -0.5, -1.0, -2.0]))
    _, ret2 = compute_advantages("reinforce", REWARDS, MASK, n_samples_per_prompt=1, gamma=0.5)
    torch.testing.assert_close(ret2, ret)


def test_group_estimator_kl_in_reward_is_return_to_go():
    kl = torch.full((6, T), -77.0)  # garbage on padding
    kl[MASK] = torch.tensor([0.2, 0.4, 0.1, -0.3, 0.5, 0.2, 1.0, 0.3, 0.1, 0.0, 0.7, 0.2, 0.6, 0.9, 0.8, 0.4])
    adv, ret = compute_advantages("dr_grpo", REWARDS, MASK, n_samples_per_prompt=3, kl=kl, kl_coef=0.1)
    # row 0: shaped -1, kl [0.2, 0.4] -> [-1 - 0.1*0.6, -1 - 0.1*0.4]
    torch.testing.assert_close(adv[0], torch.tensor([-1.06, -1.04, 0.0, 0.0]))
    # row 1: shaped -2, kl [0.1,-0.3,0.5,0.2] -> suffix sums [0.5, 0.4, 0.7, 0.2]
    torch.testing.assert_close(adv[1], torch.tensor([-2.05, -2.04, -2.07, -2.02]))
    # row 2: shaped 3, kl [1.0]
    torch.testing.assert_close(adv[2], torch.tensor([2.9, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(ret, adv)
    # group statistics see only the task reward: KL coefficient 0 == no KL
    a0, _ = compute_advantages("group_norm", REWARDS, MASK, n_samples_per_prompt=3, kl=kl, kl_coef=0.0)
    a1, _ = compute_advantages("group_norm", REWARDS, MASK, n_samples_per_prompt=3)
    torch.testing.assert_close(a0, a1)
    a2, _ = compute_advantages("group_norm", REWARDS, MASK, n_samples_per_prompt=3, kl=kl, kl_coef=0.1)
    s7 = math.sqrt(7) + 1e-6
    torch.testing.assert_close(a2[0], torch.tensor([-1 / s7 - 0.06, -1 / s7 - 0.04, 0.0, 0.0]))


def test_gae_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    values = torch.tensor([[0.5, 0.6, 0.7, 5.0], [0.2, -0.3, 5.0, 5.0]])
    rewards = torch.tensor([1.0, -1.0])
    tr = compute_token_rewards(rewards, mask, None, 0.0)
    adv, ret = gae_advantages(tr, values, mask, gamma=1.0, lambd=0.95)
    # row 0: d2=1-.7=.3; d1=.7-.6=.1 -> .1+.95*.3=.385; d0=.1 -> .1+.95*.385=.46575
    torch.testing.assert_close(adv[0], torch.tensor([0.46575, 0.385, 0.3, 0.0]))
    torch.testing.assert_close(ret[0], torch.tensor([0.96575, 0.985, 1.0, 0.0]))
    adv, ret = gae_advantages(tr, values, mask, gamma=0.9, lambd=0.8)
    # row 0: A2=.3; d1=.9*.7-.6=.03 -> .03+.72*.3=.246; d0=.9*.6-.5=.04 -> .04+.72*.246=.21712
    # row 1: A1=-1+.3=-.7; d0=.9*(-.3)-.2=-.47 -> -.47+.72*(-.7)=-.974
    exp_adv = torch.tensor([[0.21712, 0.246, 0.3, 0.0], [-0.974, -0.7, 0.0, 0.0]])
    torch.testing.assert_close(adv, exp_adv)
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0, 0.0], [-0.774, -1.0, 0.0, 0.0]]))
    wadv, wret = compute_advantages(
        "gae", rewards, mask, n_samples_per_prompt=1, values=values, gamma=0.9, lambd=0.8
    )
    v = exp_adv[mask]
    torch.testing.assert_close(wadv[mask], (v - v.mean()) / torch.sqrt(v.var(unbiased=False) + 1e-8))
    torch.testing.assert_close(wret, ret)


def test_gae_lambda_one_is_monte_carlo_minus_value():
    g = torch.Generator().manual_seed(7)
    m = _lengths_mask([5, 1, 3, 6], 6)
    values = torch.randn(4, 6, generator=g)
    kl = torch.rand(4, 6, generator=g)
    r = torch.tensor([2.0, -1.0, 0.5, 10.0])
    tr = compute_token_rewards(r, m, kl, 0.05)
    adv, ret = gae_advantages(tr, values, m, gamma=1.0, lambd=1.0)
    mc = discounted_returns(tr, m, 1.0)
    # With gamma = lambda = 1 the values telescope away in real arithmetic, not in fp32: each
    # delta_t = r_t + V_{t+1} - V_t takes 2 roundings and each carry A_t = delta_t + A_{t+1} one,
    # so A_t is off by at most the suffix sum of gamma_2 (|r| + |V_{t+1}| + |V_t|) + u |A_s|.
    # (Multiplying by gamma = lambda = 1 is exact.) mc_t sums r with one rounding per step.
    u = unit_roundoff(torch.float32)
    r64 = torch.where(m, tr.double(), torch.zeros_like(tr, dtype=torch.float64))
    v64 = torch.where(m, values.double(), torch.zeros_like(r64))
    v_next = torch.cat([v64[:, 1:], torch.zeros_like(v64[:, :1])], 1)
    mc64 = r64.flip(1).cumsum(1).flip(1)
    a64 = mc64 - v64
    suffix = lambda x: x.flip(1).cumsum(1).flip(1)  # noqa: E731
    adv_bound = suffix(gamma(2) * (r64.abs() + v_next.abs() + v64.abs()) + u * a64.abs()) * (1 + 1e-6)
    mc_bound = suffix(u * mc64.abs()) * (1 + 1e-6)
    assert_within(adv, torch.where(m, a64, torch.zeros_like(a64)), adv_bound * m, "GAE(1, 1) advantages")
    assert_within(mc, torch.where(m, mc64, torch.zeros_like(mc64)), mc_bound * m, "Monte-Carlo returns")
    # returns = A + V: one more rounding.
    assert_within(ret, torch.where(m, mc64, torch.zeros_like(mc64)), (adv_bound + u * mc64.abs()) * (1 + 1e-6) * m, "GAE returns")
    assert_within(adv, torch.where(m, mc - values, torch.zeros_like(mc)), (adv_bound + mc_bound + u * a64.abs()) * (1 + 1e-6) * m, "GAE vs MC - V")


def test_advantage_validation_errors():
    for est in GROUP_ESTIMATORS:
        with pytest.raises(ValueError, match="--rollout.n_samples_per_prompt"):
            compute_advantages(est, REWARDS, MASK, n_samples_per_prompt=1)
        with pytest.raises(ValueError, match="--rollout.n_samples_per_prompt"):
            compute_advantages(est, REWARDS, MASK, n_samples_per_prompt=4)  # 6 % 4 != 0
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", REWARDS, MASK, n_samples_per_prompt=1)
    with pytest.raises(ValueError, match="--algo.advantage.estimator"):
        compute_advantages("ppo", REWARDS, MASK, n_samples_per_prompt=1)
    assert set(GROUP_ESTIMATORS) < set(ESTIMATORS)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_all_estimators_zero_outside_mask_and_finite(estimator):
    g = torch.Generator().manual_seed(8)
    m = _lengths_mask([3, 7, 1, 5], 7)
    out = compute_advantages(
        estimator,
        torch.randn(4, generator=g) * 5,
        m,
        n_samples_per_prompt=2,
        kl=torch.randn(4, 7, generator=g),
        kl_coef=0.02,
        values=torch.randn(4, 7, generator=g),
        gamma=0.99,
        lambd=0.95,
    )
    for x in out:
        assert x.dtype == torch.float32 and torch.isfinite(x).all()
        assert (x[~m] == 0).all()
        assert x[m].abs().sum() > 0


def test_loss_module_exports():
    assert set(loss_mod.__all__) >= {"ISCorrection", "PolicyLoss", "PolicyLossOutput", "ValueLoss", "kl_loss", "aggregate_loss"}


@pytest.mark.parametrize("name,first,last", [
    ("constant", 1.0, 1.0),  # no warmup, as transformers (and OpenRLHF) define it
    ("constant_with_warmup", 0.0, 1.0),
    ("linear", 0.0, 1 / 9),  # one warmup step, then down to 0 over 9: the last step taken is at 1/9 of the peak
    ("cosine_with_min_lr", 0.0, None),
])
def test_lr_schedules_follow_their_names(name, first, last):
    from openrlhf.config import parse_config
    from openrlhf.trainer.ppo_trainer import make_lr_scheduler

    cfg = parse_config(["--actor.model_name_or_path", "m", "--data.prompt_dataset", "d", "--actor.lr_scheduler", name,
                        "--actor.lr_warmup_ratio", "0.1", "--actor.min_lr_ratio", "0.25"], exit_on_error=False)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = make_lr_scheduler(opt, cfg.actor, total_updates=10)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"] / 2.0)
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(first, abs=1e-12)
    assert max(lrs) == pytest.approx(1.0)
    if name == "cosine_with_min_lr":  # cosine from the peak toward 0.25 of it, never below
        assert min(lrs[1:]) >= 0.25 - 1e-12 and lrs[-1] < 0.3
    else:
        assert lrs[-1] == pytest.approx(last, abs=1e-12)
