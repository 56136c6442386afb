"""Agent execution (`--train.agent_func_path`): multi-turn rollouts through a user's Python agent.

The user's file defines `AgentExecutor`, usually a `MultiTurnAgentExecutor` over an
`AgentInstanceBase` subclass whose async `reset(states)` / `step(states)` play the
environment, the same names and call contract as OpenRLHF's agent API, so OpenRLHF agent files
run unchanged. `step` returns a dict with `rewards`, `environment_feedback`, `done` and
optionally `scores` (for dynamic filtering), `sampling_params` and `extra_logs`.

The executor talks to the rollout engine through `llm_engine.generate(token_ids,
sampling_params)` (async, one request); `AgentRollout` serves those requests in batches on our
engines (transformers or vLLM) and turns each finished episode into a `RolloutSample` whose
action mask covers the model's turns only: environment feedback is context, not action.
"""

from __future__ import annotations

import abc
import asyncio
import copy
import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "AgentInstanceBase",
    "AgentExecutorBase",
    "MultiTurnAgentExecutor",
    "SamplingParams",
    "AgentRollout",
    "load_agent_executor",
]

logger = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    """The sampling settings an agent sees and may change between turns (vLLM's attribute names)."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    logprobs: int | None = 0  # not None: return the sampled tokens' log-probs
    stop_token_ids: list[int] = field(default_factory=list)


class AgentInstanceBase(abc.ABC):
    """One environment episode. `reset` returns {"observation": text}; `step` returns the turn's result."""

    @abc.abstractmethod
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs) -> dict:
        return states

    @abc.abstractmethod
    async def step(self, states: dict, **kwargs) -> dict:
        ...


class AgentExecutorBase(abc.ABC):
    @abc.abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None) -> dict:
        """One episode; returns observation_tokens, action_ranges, rollout_log_probs, reward, scores, extra_logs."""


def _as_float(x: Any) -> float:
    return float(x.item()) if hasattr(x, "item") else float(x)


class MultiTurnAgentExecutor(AgentExecutorBase):
    """Alternate model turns and environment steps until the agent says done or the token budget
    (`max_length` tokens of prompt + turns + feedback) runs out. Each model turn generates at most
    the `max_tokens` the executor was called with (--rollout.max_new_tokens) and at most what is
    left of `max_length`."""

    def __init__(self, agent_instance_cls: type) -> None:
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError(f"MultiTurnAgentExecutor needs an AgentInstanceBase subclass, got {agent_instance_cls!r}")
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None) -> dict:
        if images:
            raise ValueError("agent execution here is text-only: the prompt carries images (vision-language training is not supported)")
        agent = self.agent_instance_cls()
        first = await agent.reset({"observation": prompt, "label": label})
        text = first["observation"]
        tokens = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        turn_budget = max(getattr(sampling_params, "max_tokens", 1) or 1, 1)  # per model turn
        if len(tokens) > max_length - turn_budget:  # keep the tail: the question is usually last
            tokens = tokens[-(max_length - turn_budget):]
            text = hf_tokenizer.decode(tokens)
        logps: list[float] = [0.0] * len(tokens)
        ranges: list[tuple[int, int]] = []
        total_reward, scores, extra_logs = 0.0, None, {}
        while True:
            sampling_params.max_tokens = min(turn_budget, max_length - len(tokens))
            if sampling_params.max_tokens <= 0:
                break
            out = (await llm_engine.generate(tokens, copy.deepcopy(sampling_params))).outputs[0]
            action = list(out.token_ids)
            ranges.append((len(tokens), len(tokens) + len(action)))
            logps += [lp[t].logprob for lp, t in zip(out.logprobs, action)] if out.logprobs is not None else [0.0] * len(action)
            result = await agent.step({"observation_text": text, "action_text": out.text, "label": label, "sampling_params": sampling_params})
            total_reward += _as_float(result["rewards"])
            scores = _as_float(result["scores"]) if result.get("scores") is not None else total_reward
            extra_logs = result.get("extra_logs") or {}
            feedback = result.get("environment_feedback") or ""
            feedback_ids = hf_tokenizer(feedback, add_special_tokens=False)["input_ids"] if feedback else []
            text = text + out.text + feedback
            tokens = tokens + action + feedback_ids
            logps += [0.0] * len(feedback_ids)
            if result.get("sampling_params") is not None:
                sampling_params = result["sampling_params"]
            if result["done"]:
                break
        return {
            "prompt": prompt, "label": label, "observation_tokens": tokens, "action_ranges": ranges,
            "rollout_log_probs": logps, "reward": total_reward, "scores": total_reward if scores is None else scores,
            "extra_logs": {k: _as_float(v) for k, v in extra_logs.items()},
        }


def load_agent_executor(path: str) -> AgentExecutorBase:
    """Import the user's agent file and instantiate its `AgentExecutor`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--train.agent_func_path {path}: no such file; pass a .py file that defines AgentExecutor")
    spec = importlib.util.spec_from_file_location(f"jetrl_user_agent_{abs(hash(str(p.resolve())))}", p)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = getattr(module, "AgentExecutor", None)
    if not (isinstance(cls, type) and issubclass(cls, AgentExecutorBase)):
        raise TypeError(
            f"--train.agent_func_path {path} must define `class AgentExecutor(...)` deriving from "
            f"openrlhf.utils.agent.AgentExecutorBase (e.g. MultiTurnAgentExecutor); found {cls!r}"
        )
    return cls()


# ---------------------------------------------------------------------------------------------
# Serving the agents' generate calls from our rollout engines, in batches
# ---------------------------------------------------------------------------------------------
@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Completion:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, _Logprob]] | None
    finish_reason: str


@dataclass
class _RequestOutput:
    outputs: list[_Completion]


class _BatchingClient:
    """`await generate(ids, params)` from many agents; requests wait until every running agent is
    waiting on one (or a short timeout passes), then go to the engine as one batch per sampling
    setting. The longest budget of a batch is generated and each answer cut to its own budget:
    sampling token by token, that is the same distribution as generating the shorter budget."""

    def __init__(self, engine, tokenizer, seed: int) -> None:
        self.engine, self.tokenizer, self.seed = engine, tokenizer, seed
        self.pending: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self.running = 0
        self.flushes = 0

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        if multi_modal_data:
            raise ValueError("agent execution here is text-only (multi_modal_data given)")
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((list(prompt_token_ids), sampling_params, fut))
        return await fut

    def flush(self) -> None:
        from openrlhf.trainer.engines.base import SamplingConfig

        batch, self.pending = self.pending, []
        groups: dict[tuple, list[int]] = {}
        for i, (_, sp, _) in enumerate(batch):
            key = (sp.temperature, sp.top_p, sp.top_k, tuple(sp.stop_token_ids or ()))
            groups.setdefault(key, []).append(i)
        for (temperature, top_p, top_k, stops), idx in groups.items():
            budget = max(batch[i][1].max_tokens for i in idx)
            cfg = SamplingConfig(max_new_tokens=budget, temperature=temperature, top_p=top_p, top_k=top_k, n=1,
                                 seed=self.seed * 7919 + self.flushes, stop_token_ids=stops)
            self.flushes += 1
            results = self.engine.generate([batch[i][0] for i in idx], cfg)
            for i, group in zip(idx, results):
                s, sp = group[0], batch[i][1]
                ids, lps = s.response_ids[: sp.max_tokens], s.logprobs[: sp.max_tokens]
                finish = s.finish_reason if len(s.response_ids) <= sp.max_tokens else "length"
                logprobs = [{t: _Logprob(lp)} for t, lp in zip(ids, lps)] if sp.logprobs is not None else None
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                batch[i][2].set_result(_RequestOutput([_Completion(ids, text, logprobs, finish)]))

    async def run(self, coros: Sequence) -> list:
        async def tracked(c):
            try:
                return await c
            finally:
                self.running -= 1

        self.running = len(coros)
        tasks = [asyncio.ensure_future(tracked(c)) for c in coros]
        idle = 0
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0)
            if self.pending and (len(self.pending) >= self.running or idle > 2000):
                self.flush()
                idle = 0
            elif self.pending:  # some agent awaits something else (a tool, a remote call): give it time
                idle += 1
                if idle % 100 == 0:
                    await asyncio.sleep(0.001)
        return [t.result() for t in tasks]


class AgentRollout:
    """Run the user's executor for every (prompt, sample) and return `RolloutSample`s, grouped per prompt."""

    def __init__(self, executor: AgentExecutorBase, engine, tokenizer, max_length: int) -> None:
        self.executor, self.engine, self.tokenizer, self.max_length = executor, engine, tokenizer, max_length

    def generate(self, prompts: Sequence[str], labels: Sequence, sampling, max_new_tokens: int):
        from openrlhf.trainer.engines.base import RolloutSample

        client = _BatchingClient(self.engine, self.tokenizer, sampling.seed or 0)

        def params() -> SamplingParams:
            return SamplingParams(max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k, 0, list(sampling.stop_token_ids))

        coros = [
            self.executor.execute(p, lab, params(), self.max_length, self.tokenizer, client)
            for p, lab in zip(prompts, labels) for _ in range(sampling.n)
        ]
        results = asyncio.run(client.run(coros))
        samples = []
        for r in results:
            tokens, ranges = r["observation_tokens"], r["action_ranges"]
            start = ranges[0][0] if ranges else len(tokens)
            mask = [False] * (len(tokens) - start)
            for a, b in ranges:
                mask[a - start : b - start] = [True] * (b - a)
            samples.append(RolloutSample(
                prompt_ids=tokens[:start], response_ids=tokens[start:], logprobs=list(r["rollout_log_probs"][start:]),
                finish_reason="stop", action_mask=mask,
                extra={"reward": float(r["reward"]), "score": float(r["scores"]), "extra_logs": r.get("extra_logs", {})},
            ))
        n = sampling.n
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]
