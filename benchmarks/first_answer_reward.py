"""The long-rollout study's reward (benchmarks/fidelity_gpu.py long), given to the trainer as
`--reward.remote_url benchmarks/first_answer_reward.py`.

Its rollouts run to a fixed length past EOS (`--rollout.ignore_eos`), so a response is the model's answer followed by
whatever it samples after its end of turn, which may hold more numbers. The reward is math-verify's verdict on the
first answer: the number after the first "The answer is" (the format the task's solved examples show), or else the
response's first number.
"""

from __future__ import annotations

import re
from typing import Sequence

from openrlhf.rewards.math_reward import math_reward_one

__all__ = ["first_answer", "reward_func"]

_NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?"
_ANSWER = re.compile(rf"answer is\s*\$?({_NUMBER})", re.IGNORECASE)


def first_answer(response: str) -> str | None:
    m = _ANSWER.search(response) or re.search(_NUMBER, response)
    if m is None:
        return None
    return m.group(m.lastindex or 0).replace(",", "")


def reward_func(queries: Sequence[str], prompts: Sequence[str], labels: Sequence[str | None], **_) -> list[float]:
    out = []
    for q, p, label in zip(queries, prompts, labels):
        if not q.startswith(p):
            raise ValueError("a query does not start with its prompt: this reward expects queries = prompt + response")
        answer = first_answer(q[len(p):])
        out.append(0.0 if answer is None else math_reward_one(answer, label))
    return out
