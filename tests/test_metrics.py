"""mismatch_metrics on hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

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


def test_hand_computed_single_row():
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    log_r = [0.0, 0.5, -0.2, LN2]
    train = rollout + torch.tensor([log_r])
    out = mismatch_metrics(rollout, train)
    exp = expected_stats(log_r)
    for k, v in exp.items():
        assert out[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
    # Values computed by hand: mean |d| = (0 + .5 + .2 + ln2) / 4; 2 of 4 ratios (e^.5, 2) are outside the band.
    assert out["abs_logp_diff_mean"] == pytest.approx((0.7 + LN2) / 4)
    assert out["ratio_outside_0.8_1.25"] == 0.5
    assert out["kl_k1"] == pytest.approx(-(0.3 + LN2) / 4)
    assert out["kl_k3"] == pytest.approx((0 + (math.exp(0.5) - 1.5) + (math.exp(-0.2) - 0.8) + (1 - LN2)) / 4)
    # Quantiles of r, linear interpolation (numpy's default), as an independent check.
    r = np.exp(np.array(log_r))
    for q in (0.01, 0.05, 0.5, 0.95, 0.99):
        assert out[f"ratio_q{int(q * 100):02d}"] == pytest.approx(float(np.quantile(r, q)), rel=1e-6)
    assert out["ratio_q50"] == pytest.approx((1.0 + math.exp(0.5)) / 2)  # median of {e^-.2, 1, e^.5, 2}


def test_k_estimators_are_consistent():
    # k3 >= 0 always, k2 ~ k3 ~ KL for small gaps, k1 may be negative per token.
    torch.manual_seed(0)
    rollout = -torch.rand(4, 300) * 3
    train = rollout + 0.01 * torch.randn(4, 300)
    out = mismatch_metrics(rollout, train)
    assert out["kl_k3"] >= 0 and out["kl_k2"] >= 0
    assert out["kl_k2"] == pytest.approx(out["kl_k3"], rel=0.05)
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
    for k, v in exp.items():
        assert out[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
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
    assert out["pos_0-1/abs_logp_diff_mean"] == pytest.approx(0.05)  # positions 0,1 in both rows
    assert out["pos_2-3/abs_logp_diff_mean"] == pytest.approx(0.25)
    assert out["pos_4-5/abs_logp_diff_mean"] == pytest.approx(0.45)  # only row 0 reaches here
    assert out["pos_4-5/abs_logp_diff_max"] == pytest.approx(0.5)
    assert out["pos_0-1/kl_k3"] == pytest.approx((0 + 2 * (math.exp(0.1) - 1.1)) / 4, rel=1e-5)
    # e^0.2 = 1.22 is inside the band, e^0.3 = 1.35 is not: half of bucket 2-3, all of bucket 4-5.
    assert out["pos_2-3/ratio_outside_0.8_1.25"] == pytest.approx(0.5)
    assert out["pos_4-5/ratio_outside_0.8_1.25"] == 1.0
    assert out["pos_0-1/ratio_outside_0.8_1.25"] == 0.0
    # max_buckets caps the count: the width grows so 6 positions fit in 2 buckets.
    capped = mismatch_metrics(rollout, train, mask, bucket_size=1, max_buckets=2)
    assert sorted({k.split("/")[0] for k in capped if k.startswith("pos_")}) == ["pos_0-2", "pos_3-5"]


def test_one_dimensional_input_and_single_token():
    out = mismatch_metrics(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.0 + LN2]))
    assert out["num_tokens"] == 2 and out["abs_logp_diff_max"] == pytest.approx(LN2)
    one = mismatch_metrics(torch.tensor([-1.0]), torch.tensor([-0.5]))
    assert one["ratio_q50"] == pytest.approx(math.exp(0.5)) and one["ratio_q01"] == one["ratio_q99"]


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
