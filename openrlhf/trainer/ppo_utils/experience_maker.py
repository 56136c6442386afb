"""Turn rollout samples into training experience.

Order (as in OpenRLHF): rollout -> rewards -> old logprobs recomputed by the actor ->
reference logprobs -> values (gae) -> advantages/returns. The engine's own logprobs are kept
as `rollout_logprobs`: they feed the rollout-train mismatch metrics and IS correction. With
--precision.bitwise an `old_logprobs` hook (`bitwise.EngineLogprobProof`) may take the engine's
logprobs as the old ones, on steps where a sample recompute proves them exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterator, Sequence

import torch

from jetrl_precision import PrecisionRecipe
from jetrl_precision.weight_sync import iter_sync_tensors
from openrlhf.models.utils import compute_approx_kl
from openrlhf.trainer.engines.base import RolloutEngine, RolloutSample, SamplingConfig

from .advantages import compute_advantages

__all__ = ["Experience", "ExperienceMaker", "RewardFn", "AdvantageSettings", "samples_to_tensors", "sample_after_sync"]

# (prompts, responses, labels) -> one scalar reward per response
RewardFn = Callable[[list[str], list[str], list[str | None]], list[float]]


@dataclass
class Experience:
    sequences: torch.Tensor  # [B, P+R]: left-padded prompt | right-padded response
    attention_mask: torch.Tensor  # [B, P+R]
    action_mask: torch.Tensor  # [B, R] bool
    rollout_logprobs: torch.Tensor  # [B, R] the engine's own numbers
    old_logprobs: torch.Tensor | None = None  # [B, R] recomputed by the trainer's actor
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    rewards: torch.Tensor | None = None  # [B] scalar reward fed to the advantages (normalized if asked)
    scores: torch.Tensor | None = None  # [B] raw task reward, for logging
    kl: torch.Tensor | None = None  # [B, R] KL(actor || ref) estimate, for logging / reward shaping
    timings: dict[str, float] = field(default_factory=dict)
    proof: Any = None  # bitwise.ProofResult when an old_logprobs hook decided where the old logprobs came from

    @property
    def num_actions(self) -> int:
        return self.action_mask.shape[1]

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def select(self, idx: torch.Tensor | slice) -> "Experience":
        """Rows `idx`, trimmed to the columns those rows actually use (less padding per micro-batch)."""
        tensors = {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        part = {k: v[idx] for k, v in tensors.items()}
        am = part["attention_mask"]
        left = int((am.sum(0) > 0).nonzero()[0]) if am.any() else 0
        right_r = int(part["action_mask"].sum(0).nonzero().max()) + 1 if part["action_mask"].any() else 1
        cut_r = self.num_actions - right_r
        for k, v in part.items():
            if v.dim() == 2 and v.shape[1] == self.sequences.shape[1]:
                part[k] = v[:, left : v.shape[1] - cut_r]
            elif v.dim() == 2:
                part[k] = v[:, :right_r]
        return replace(self, **part, timings={})

    def micro_batches(self, size: int) -> Iterator["Experience"]:
        for start in range(0, len(self), size):
            yield self.select(slice(start, start + size))

    def to(self, device: torch.device, non_blocking: bool = False) -> "Experience":
        """The tensors on `device`. `non_blocking` stages CPU tensors in pinned memory first, so the copies queue
        behind the GPU's work instead of waiting for it (a pageable copy synchronizes the stream)."""
        stage = non_blocking and torch.device(device).type == "cuda"

        def move(t: torch.Tensor) -> torch.Tensor:
            if stage and t.device.type == "cpu":
                t = t.pin_memory()
            return t.to(device, non_blocking=stage)

        return replace(self, **{f.name: move(getattr(self, f.name)) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)})


def samples_to_tensors(samples: Sequence[RolloutSample], pad_token_id: int) -> Experience:
    P = max(len(s.prompt_ids) for s in samples)
    R = max(max(len(s.response_ids) for s in samples), 1)
    B = len(samples)
    seq = torch.full((B, P + R), pad_token_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    amask = torch.zeros((B, R), dtype=torch.bool)
    rlp = torch.zeros((B, R), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        seq[i, P - p : P] = torch.tensor(s.prompt_ids)
        attn[i, P - p : P + r] = 1
        if r:
            seq[i, P : P + r] = torch.tensor(s.response_ids)
            amask[i, :r] = True if s.action_mask is None else torch.tensor(s.action_mask, dtype=torch.bool)
            rlp[i, :r] = torch.tensor(s.logprobs, dtype=torch.float32)
    return Experience(seq, attn, amask, rlp)


def sample_after_sync(
    trainer: torch.nn.Module, engine: RolloutEngine, recipe: PrecisionRecipe, prompts: list[list[int]],
    sampling: SamplingConfig, pad_token_id: int,
) -> Experience:
    """A run's first rollout in miniature: `trainer` (a model under the recipe's training flow)
    sends its weights to `engine` as training does, and the engine samples `prompts`.
    Returns the samples as tensors, with the engine's log-probs as `rollout_logprobs`."""
    engine.update_weights(iter_sync_tensors(trainer, fp8=recipe.syncs_fp8_weights, layout=engine.sync_layout))
    return samples_to_tensors([s for group in engine.generate(prompts, sampling) for s in group], pad_token_id)


@dataclass(frozen=True)
class AdvantageSettings:
    estimator: str
    n_samples_per_prompt: int
    gamma: float = 1.0
    lambd: float = 1.0
    kl_coef: float = 0.0  # KL in the reward (0 when KL is a loss term)
    kl_estimator: str = "k1"
    temperature: float = 1.0
    std_norm: bool = True  # gae/reinforce/reinforce_baseline: divide by the batch std (--algo.advantage.no_std_norm turns it off)


class ExperienceMaker:
    def __init__(
        self,
        actor: Callable[..., torch.Tensor],
        reward_fn: RewardFn,
        tokenizer,
        settings: AdvantageSettings,
        *,
        ref: Callable[..., torch.Tensor] | None = None,
        critic: Callable[..., torch.Tensor] | None = None,
        micro_batch_size: int = 8,
        device: torch.device | str = "cpu",
        reward_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        max_tokens: int | None = None,
        all_reduce_max: Callable[[int], int] = lambda k: k,
        old_logprobs: Callable[[Experience, Callable[[Experience], torch.Tensor]], tuple[torch.Tensor, Any]] | None = None,
    ) -> None:
        """`max_tokens`: forwards bounded by tokens (--rollout.max_tokens_per_gpu, dynamic batching)
        rather than by `micro_batch_size`; `all_reduce_max` makes every rank run as many.
        `old_logprobs(exp, recompute) -> (old logprobs, proof)` replaces the plain recompute (--precision.bitwise)."""
        self.max_tokens, self.all_reduce_max = max_tokens, all_reduce_max
        self.old_logprobs = old_logprobs
        self.actor, self.ref, self.critic = actor, ref, critic
        self.reward_fn, self.tokenizer, self.s = reward_fn, tokenizer, settings
        self.micro_batch_size, self.device = micro_batch_size, torch.device(device)
        self.reward_transform = reward_transform  # e.g. running normalization (--reward.normalize_enable)

    @torch.no_grad()
    def _forward(self, fn: Callable[..., torch.Tensor], exp: Experience, **kw) -> torch.Tensor:
        if self.max_tokens is not None:
            from openrlhf.utils.seqlen_balancing import synced_partition

            out = torch.zeros(len(exp), exp.num_actions)
            parts = synced_partition(exp.attention_mask.sum(-1).tolist(), self.max_tokens, self.all_reduce_max)
            for idx in parts:
                mb = exp.select(torch.tensor(idx or [0]))  # an empty part still runs: ZeRO-3 gathers collectively
                res = fn(mb.sequences.to(self.device), mb.attention_mask.to(self.device), mb.num_actions, **kw).float().cpu()
                if idx:
                    out[idx, : res.shape[1]] = res
            return out
        outs = []
        for start in range(0, len(exp), self.micro_batch_size):
            sl = slice(start, start + self.micro_batch_size)
            outs.append(fn(exp.sequences[sl].to(self.device), exp.attention_mask[sl].to(self.device), exp.num_actions, **kw).float().cpu())
        return torch.cat(outs)

    @torch.no_grad()
    def make(
        self, samples: Sequence[RolloutSample], prompts: Sequence[str], labels: Sequence[str | None],
        scores: torch.Tensor | None = None, rewards: torch.Tensor | None = None,
    ) -> Experience:
        """`samples` are grouped: the n samples of prompt i are rows [i*n, (i+1)*n). `scores` (task
        score) and `rewards` (what the advantages see), when given, replace the reward function."""
        t0 = time.perf_counter()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        exp = samples_to_tensors(samples, pad)
        n = self.s.n_samples_per_prompt
        if scores is None:
            responses = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
            rep_prompts = [p for p in prompts for _ in range(n)]
            rep_labels = [lab for lab in labels for _ in range(n)]
            scores = torch.as_tensor(self.reward_fn(rep_prompts, responses, rep_labels), dtype=torch.float32).reshape(len(samples))
        exp.scores = scores
        rewards = scores if rewards is None else rewards
        exp.rewards = self.reward_transform(rewards) if self.reward_transform is not None else rewards
        t1 = time.perf_counter()
        recompute = lambda e: self._forward(self.actor, e, temperature=self.s.temperature)  # noqa: E731
        if self.old_logprobs is None:
            exp.old_logprobs = recompute(exp)
        else:
            exp.old_logprobs, exp.proof = self.old_logprobs(exp, recompute)
        t2 = time.perf_counter()
        if self.ref is not None:
            exp.ref_logprobs = self._forward(self.ref, exp, temperature=self.s.temperature)
            exp.kl = compute_approx_kl(exp.old_logprobs, exp.ref_logprobs, self.s.kl_estimator) * exp.action_mask
        t3 = time.perf_counter()
        if self.critic is not None:
            exp.values = self._forward(self.critic, exp) * exp.action_mask
        t4 = time.perf_counter()
        exp.advantages, exp.returns = compute_advantages(
            self.s.estimator,
            exp.rewards,
            exp.action_mask,
            n_samples_per_prompt=n,
            kl=exp.kl if self.s.kl_coef > 0 else None,
            kl_coef=self.s.kl_coef,
            values=exp.values,
            gamma=self.s.gamma,
            lambd=self.s.lambd,
            std_norm=self.s.std_norm,
        )
        exp.timings = {"reward_s": t1 - t0, "old_logprob_s": t2 - t1, "ref_s": t3 - t2, "values_s": t4 - t3}
        return exp
