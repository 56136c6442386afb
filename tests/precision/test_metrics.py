"""mismatch_metrics on hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from precision_testutil import LIBM_ULPS, gamma, unit_roundoff
from jetrl_precision import mismatch_metrics

LN2 = math.log(2.0)


def expected_stats(log_r: list[float]) -> dict[str, float]:
    """The formulas written out in plain Python (KL(rollout || train) with log r = logp_train - logp_rollout)."""
    n = len(log_r)
    r = [math.exp(x) for x in log_r]
    return {
        "num_tokens": float(n),
        "abs_logp_diff_mean": sum(abs(x) for x in log_r) / n,
        "abs_logp_diff_max": max(abs(x) for x in log_r),
        "kl_k1": sum(-x for x in log_r) / n,
        "kl_k2": sum(0.5 * x * x for x in log_r) / n,
        "kl_k3": sum(ri - 1 - x for ri, x in zip(r, log_r)) / n,
        "ratio_outside_0.8_1.25": sum(1 for ri in r if ri < 0.8 or ri > 1.25) / n,
    }


def stat_bounds(log_r: list[float], train: list[float]) -> dict[str, float]:
    """Worst-case fp32 error of each statistic against `expected_stats(log_r)`, in any summation order.

    Each log r_i reaches the metric as fl(train_i - rollout_i) where train_i = fl(rollout_i + log r_i)
    was rounded when the test built it: |d log r_i| <= u |train_i| + u |log r_i| (1 + u). A term t(log r)
    then carries |t'| |d log r_i| plus its own roundings (exp: LIBM_ULPS ulps), and the mean adds
    gamma_n sum |t_i| / n and one rounding of the division.
    """
    u = unit_roundoff(torch.float32)
    e = 2 * LIBM_ULPS * u
    n = len(log_r)
    d = [u * abs(t) + u * abs(x) * (1 + u) for t, x in zip(train, log_r)]
    r = [math.exp(x) for x in log_r]

    def mean_bound(terms: list[float], errs: list[float]) -> float:
        mean = abs(sum(terms) / n)
        return ((sum(errs) + gamma(n) * sum(abs(t) for t in terms)) / n + u * mean) * (1 + 1e-6)

    return {
        "abs_logp_diff_mean": mean_bound([abs(x) for x in log_r], d),
        "abs_logp_diff_max": max(d),
        "kl_k1": mean_bound([-x for x in log_r], d),
        "kl_k2": mean_bound([0.5 * x * x for x in log_r], [abs(x) * di * 1.01 + 2 * u * 0.5 * x * x for x, di in zip(log_r, d)]),
        # k3 = exp(x) - 1 - x: exp's error and its argument's, then two roundings.
        "kl_k3": mean_bound(
            [ri - 1 - x for ri, x in zip(r, log_r)],
            [ri * (e + di * 1.01) + di + 2 * u * (abs(ri - 1) + abs(ri - 1 - x)) for ri, x, di in zip(r, log_r, d)],
        ),
    }


def test_hand_computed_single_row():
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    log_r = [0.0, 0.5, -0.2, LN2]
    train = rollout + torch.tensor([log_r])
    out = mismatch_metrics(rollout, train)
    exp = expected_stats(log_r)
    bounds = stat_bounds(log_r, train[0].tolist())
    assert out["num_tokens"] == 4 and out["ratio_outside_0.8_1.25"] == exp["ratio_outside_0.8_1.25"] == 0.5
    for k, b in bounds.items():
        assert abs(out[k] - exp[k]) <= b, (k, out[k], exp[k], b)
    # Values computed by hand: mean |d| = (0 + .5 + .2 + ln2) / 4; 2 of 4 ratios (e^.5, 2) are outside the band.
    # (Double-precision formulas in two orders: <= 20 roundings of values <= 2, far inside rel 1e-12.)
    assert exp["abs_logp_diff_mean"] == pytest.approx((0.7 + LN2) / 4, rel=1e-12)
    assert exp["kl_k1"] == pytest.approx(-(0.3 + LN2) / 4, rel=1e-12)
    assert exp["kl_k3"] == pytest.approx((0 + (math.exp(0.5) - 1.5) + (math.exp(-0.2) - 0.8) + (1 - LN2)) / 4, rel=1e-12)
    # Quantiles of r, linear interpolation (numpy's default), as an independent check: each r is
    # within e + |d log r| (relative) of exp(log r), and the interpolation adds 3 roundings.
    u = unit_roundoff(torch.float32)
    r = np.exp(np.array(log_r))
    r_err = max(ri * (2 * LIBM_ULPS * u + 2.01 * u * (abs(t) + abs(x))) for ri, t, x in zip(r, train[0].tolist(), log_r))
    for q in (0.01, 0.05, 0.5, 0.95, 0.99):
        assert abs(out[f"ratio_q{int(q * 100):02d}"] - float(np.quantile(r, q))) <= r_err + gamma(3) * r.max(), q
    assert float(np.quantile(r, 0.5)) == pytest.approx((1.0 + math.exp(0.5)) / 2, rel=1e-12)  # median of {e^-.2, 1, e^.5, 2}


def test_k_estimators_are_consistent():
    # k3 >= 0 always, k2 ~ k3 ~ KL for small gaps, k1 may be negative per token.
    torch.manual_seed(0)
    rollout = -torch.rand(4, 300) * 3
    train = rollout + 0.01 * torch.randn(4, 300)
    out = mismatch_metrics(rollout, train)
    assert out["kl_k3"] >= 0 and out["kl_k2"] >= 0
    # k3 - k2 = sum (x^3/6 + ...) / n in real arithmetic; the fp32 values sit within their worst-case bounds of it.
    log_r = (train.double() - rollout.double()).reshape(-1).tolist()  # the exact differences of the fp32 inputs
    exp, bounds = expected_stats(log_r), stat_bounds(log_r, [0.0] * len(log_r))
    for k in ("kl_k2", "kl_k3", "kl_k1", "abs_logp_diff_mean"):
        assert abs(out[k] - exp[k]) <= bounds[k], (k, out[k], exp[k], bounds[k])
    assert exp["kl_k2"] == pytest.approx(exp["kl_k3"], rel=0.05)
    assert out["ratio_outside_0.8_1.25"] == 0.0
    assert 0.97 < out["ratio_q01"] < out["ratio_q50"] < out["ratio_q99"] < 1.03


def test_identical_logprobs_give_zero_mismatch():
    lp = -torch.rand(3, 50)
    out = mismatch_metrics(lp, lp.clone())
    for k in ("abs_logp_diff_mean", "abs_logp_diff_max", "kl_k1", "kl_k2", "kl_k3", "ratio_outside_0.8_1.25"):
        assert out[k] == 0.0
    assert all(out[f"ratio_q{q:02d}"] == 1.0 for q in (1, 5, 50, 95, 99))
    assert out["num_tokens"] == 150


def test_mask_excludes_tokens():
    rollout = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-2.0, -2.0, -2.0, -2.0]])
    delta = torch.tensor([[0.1, -0.1, 5.0, 5.0], [0.3, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    train = rollout + delta
    # Padding may hold -inf logprobs: masked out, they must not matter.
    rollout[1, 3] = float("-inf")
    out = mismatch_metrics(rollout, train, mask)
    exp = expected_stats([0.1, -0.1, 0.3])
    bounds = stat_bounds([0.1, -0.1, 0.3], [-0.9, -1.1, -1.7])
    # The count and the division by n are exact and one correctly rounded fp32 division: no tolerance.
    assert out["num_tokens"] == 3 and out["ratio_outside_0.8_1.25"] == (torch.tensor(1.0) / 3).item()
    for k, b in bounds.items():
        # + one rounding of each 0.1 / 0.3 literal into fp32 delta (u |delta| each)
        assert abs(out[k] - exp[k]) <= b + (0.3 + 0.1 + 0.1) * unit_roundoff(torch.float32) * 1.01, (k, out[k], exp[k], b)
    assert mismatch_metrics(rollout, train, torch.zeros_like(mask)) == {"num_tokens": 0.0}


def test_position_buckets():
    # Two rows of 6 tokens; the gap grows with position: |d| = 0.1 * position.
    rollout = torch.zeros(2, 6) - 1.0
    pos = torch.arange(6, dtype=torch.float32)
    train = rollout + 0.1 * pos
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False  # the second row is shorter
    out = mismatch_metrics(rollout, train, mask, bucket_size=2)
    buckets = sorted({k.split("/")[0] for k in out if k.startswith("pos_")})
    assert buckets == ["pos_0-1", "pos_2-3", "pos_4-5"]
    # Each bucket against its hand value within stat_bounds (plus one rounding of 0.1 * pos per token).
    u = unit_roundoff(torch.float32)
    for bucket, gaps, hand in (("0-1", [0.0, 0.1, 0.0, 0.1], 0.05), ("2-3", [0.2, 0.3, 0.2, 0.3], 0.25), ("4-5", [0.4, 0.5], 0.45)):
        b = stat_bounds(gaps, [-1.0 + x for x in gaps])
        slack = 1.01 * u * max(gaps)
        assert expected_stats(gaps)["abs_logp_diff_mean"] == pytest.approx(hand, rel=1e-12)
        assert abs(out[f"pos_{bucket}/abs_logp_diff_mean"] - hand) <= b["abs_logp_diff_mean"] + slack, bucket
        assert abs(out[f"pos_{bucket}/abs_logp_diff_max"] - max(gaps)) <= b["abs_logp_diff_max"] + slack, bucket
    k3 = expected_stats([0.0, 0.1, 0.0, 0.1])["kl_k3"]
    assert k3 == pytest.approx((0 + 2 * (math.exp(0.1) - 1.1)) / 4, rel=1e-12)
    assert abs(out["pos_0-1/kl_k3"] - k3) <= stat_bounds([0.0, 0.1, 0.0, 0.1], [-1.0, -0.9, -1.0, -0.9])["kl_k3"] + 1.01 * u * 0.1 * (math.exp(0.1) - 1)
    # e^0.2 = 1.22 is inside the band, e^0.3 = 1.35 is not: half of bucket 2-3, all of bucket 4-5.
    assert out["pos_2-3/ratio_outside_0.8_1.25"] == pytest.approx(0.5)
    assert out["pos_4-5/ratio_outside_0.8_1.25"] == 1.0
    assert out["pos_0-1/ratio_outside_0.8_1.25"] == 0.0
    # max_buckets caps the count: the width grows so 6 positions fit in 2 buckets.
    capped = mismatch_metrics(rollout, train, mask, bucket_size=1, max_buckets=2)
    assert sorted({k.split("/")[0] for k in capped if k.startswith("pos_")}) == ["pos_0-2", "pos_3-5"]


def test_one_dimensional_input_and_single_token():
    out = mismatch_metrics(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.0 + LN2]))
    assert out["num_tokens"] == 2 and abs(out["abs_logp_diff_max"] - LN2) <= stat_bounds([0.0, LN2], [-1.0, -2.0 + LN2])["abs_logp_diff_max"] + unit_roundoff() * LN2
    one = mismatch_metrics(torch.tensor([-1.0]), torch.tensor([-0.5]))
    # -0.5 - -1.0 is exact; exp(0.5) is one libm call.
    assert abs(one["ratio_q50"] - math.exp(0.5)) <= 2 * LIBM_ULPS * unit_roundoff() * math.exp(0.5) and one["ratio_q01"] == one["ratio_q99"]


def test_errors():
    a = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"logprob shapes differ: rollout \(2, 5\) vs train \(2, 4\)"):
        mismatch_metrics(a, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"mask shape \(2, 4\)"):
        mismatch_metrics(a, a.clone(), torch.ones(2, 4))
    b = a.clone()
    b[0, 1] = float("-inf")
    with pytest.raises(ValueError, match="non-finite"):
        mismatch_metrics(a, b)
