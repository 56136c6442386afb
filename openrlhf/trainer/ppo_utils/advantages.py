"""Advantage estimators: turn one scalar reward per response into per-token advantages
and returns.

Layout: rows are responses, and the ``n_samples_per_prompt`` samples of one prompt are
contiguous rows (B = prompts * n). ``mask`` [B, T] marks response tokens (ragged lengths).

KL penalty in the reward (``kl`` given and ``kl_coef > 0``; KL as a loss passes neither):
every estimator uses the same convention. The scalar reward is first shaped (the group
baseline subtracted/normalised, for group estimators), then placed on the last response
token, and ``-kl_coef * kl_t`` is added on every response token (`compute_token_rewards`).
The return is the return-to-go of these token rewards, so token t carries
``shaped_reward - kl_coef * sum_{s >= t} gamma^(s-t) kl_s``. Group statistics therefore
see only the task reward; the KL term is per token and is never group-normalised.

Normalisation:
- group_norm (GRPO): (r - mean_g) / (std_g + 1e-6), std_g the sample (n-1) std of the group;
- dr_grpo: r - mean_g (no std: Dr. GRPO removes the length/std bias);
- rloo: r - mean of the other n-1 samples of the group;
- reinforce_baseline: r - mean_g, then the return is whitened over all masked tokens of the batch;
- reinforce: the return of the raw reward, whitened over all masked tokens;
- gae: GAE(gamma, lambda) with the critic's values; returns = advantages + values (the
  critic target, not whitened); advantages are then whitened over all masked tokens.
Whitening: (x - mean) / sqrt(var + 1e-8), population variance over masked tokens; with
``std_norm=False`` (--algo.advantage.no_std_norm, as OpenRLHF v0.11 defines it) only the mean is
subtracted. It touches only these three; the group estimators keep their own normalisation.
For every estimator except gae, ``returns`` is the (un-whitened) return-to-go.
"""

from __future__ import annotations

import torch

from openrlhf.models.utils import masked_mean, masked_whiten

__all__ = [
    "ESTIMATORS",
    "GROUP_ESTIMATORS",
    "compute_token_rewards",
    "compute_advantages",
    "group_baseline",
    "discounted_returns",
    "gae_advantages",
]

ESTIMATORS = ("gae", "group_norm", "rloo", "reinforce", "reinforce_baseline", "dr_grpo")
GROUP_ESTIMATORS = ("group_norm", "rloo", "reinforce_baseline", "dr_grpo")
GROUP_STD_EPS = 1e-6


def _last_token_index(mask: torch.Tensor) -> torch.Tensor:
    m = mask.bool()
    if m.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(m.shape)}")
    empty = ~m.any(dim=1)
    if empty.any():
        rows = empty.nonzero().flatten().tolist()
        raise ValueError(f"rows {rows} have no response token in the mask; every response needs >= 1 token")
    t = m.shape[1]
    # Position of the last set entry: flip, find the first set entry.
    return (t - 1) - m.flip(dims=[1]).to(torch.int8).argmax(dim=1)


def compute_token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float
) -> torch.Tensor:
    """Scalar reward on the last masked token of each row, minus kl_coef * kl on every masked
    token. Pass kl=None or kl_coef=0 when KL is a loss term instead. Returns fp32 [B, T]."""
    if rewards.dim() != 1 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards must be [B] matching mask [B, T]; got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    m = mask.bool()
    last = _last_token_index(m)
    out = torch.zeros(m.shape, dtype=torch.float32, device=mask.device)
    out.scatter_(1, last.unsqueeze(1), rewards.detach().float().unsqueeze(1))
    if kl is not None and kl_coef != 0.0:
        if kl.shape != m.shape:
            raise ValueError(f"kl {tuple(kl.shape)} must match mask {tuple(m.shape)}")
        out = out - kl_coef * torch.where(m, kl.detach().float(), torch.zeros_like(out))
    return out


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} along each row; 0 outside the mask."""
    m = mask.bool()
    r = torch.where(m, token_rewards.float(), torch.zeros_like(token_rewards, dtype=torch.float32))
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return torch.where(m, out, torch.zeros_like(out))


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lambd: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016).

    delta_t = r_t + gamma * V_{t+1} - V_t with V = 0 past the last response token;
    A_t = delta_t + gamma * lambd * A_{t+1}. Returns (advantages, returns = A + V), un-whitened.
    """
    m = mask.bool()
    zeros = torch.zeros_like(token_rewards, dtype=torch.float32)
    r = torch.where(m, token_rewards.float(), zeros)
    v = torch.where(m, values.detach().float(), zeros)
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    next_adv = torch.zeros_like(next_value)
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lambd * next_adv
        # Padding positions pass the carry through untouched (keeps interior padding harmless).
        mt = m[:, t]
        adv[:, t] = torch.where(mt, a, zeros[:, t])
        next_adv = torch.where(mt, a, next_adv)
        next_value = torch.where(mt, v[:, t], next_value)
    returns = torch.where(m, adv + v, zeros)
    return adv, returns


def _check_groups(estimator: str, batch: int, n: int) -> None:
    if n is None or n <= 1:
        raise ValueError(
            f"advantage estimator '{estimator}' compares samples of the same prompt and needs "
            f"--rollout.n_samples_per_prompt > 1 (got {n}); use e.g. --rollout.n_samples_per_prompt 8, "
            "or a non-group estimator (reinforce, gae)"
        )
    if batch % n != 0:
        raise ValueError(
            f"batch of {batch} responses is not a whole number of groups of --rollout.n_samples_per_prompt={n}; "
            "samples of one prompt must be contiguous rows"
        )


def group_baseline(estimator: str, rewards: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """Shape scalar rewards [B] with the per-prompt group statistics of a group estimator."""
    _check_groups(estimator, rewards.shape[0], n_samples_per_prompt)
    n = n_samples_per_prompt
    g = rewards.detach().float().reshape(-1, n)
    mean = g.mean(dim=1, keepdim=True)
    if estimator == "group_norm":
        shaped = (g - mean) / (g.std(dim=1, keepdim=True) + GROUP_STD_EPS)
    elif estimator in ("dr_grpo", "reinforce_baseline"):
        shaped = g - mean
    elif estimator == "rloo":
        shaped = g - (g.sum(dim=1, keepdim=True) - g) / (n - 1)
    else:
        raise ValueError(f"'{estimator}' is not a group estimator; group estimators are {GROUP_ESTIMATORS}")
    return shaped.reshape(-1)


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    n_samples_per_prompt: int,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    std_norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B, T], returns [B, T]), fp32, 0 outside the mask. See the module docstring."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ESTIMATORS} (--algo.advantage.estimator)")
    if rewards.dim() != 1 or mask.dim() != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards must be [B] and mask [B, T]; got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    m = mask.bool()

    if estimator == "gae":
        if values is None:
            raise ValueError(
                "advantage estimator 'gae' needs critic values: set --critic.model_name_or_path, "
                "or use a critic-free estimator (group_norm, rloo, reinforce_baseline, dr_grpo, reinforce)"
            )
        if values.shape != m.shape:
            raise ValueError(f"values {tuple(values.shape)} must match mask {tuple(m.shape)}")
        token_rewards = compute_token_rewards(rewards, m, kl, kl_coef)
        adv, returns = gae_advantages(token_rewards, values, m, gamma, lambd)
        return _normalize(adv, m, std_norm), returns

    shaped = group_baseline(estimator, rewards, n_samples_per_prompt) if estimator in GROUP_ESTIMATORS else rewards
    returns = discounted_returns(compute_token_rewards(shaped, m, kl, kl_coef), m, gamma)
    if estimator in ("reinforce", "reinforce_baseline"):
        return _normalize(returns, m, std_norm), returns
    return returns.clone(), returns


def _normalize(x: torch.Tensor, m: torch.Tensor, std_norm: bool) -> torch.Tensor:
    if std_norm:
        return masked_whiten(x, m)
    xf = x.float()
    return torch.where(m, xf - masked_mean(xf, m), torch.zeros_like(xf))
