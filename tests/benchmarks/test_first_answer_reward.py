"""The long-rollout study's reward (benchmarks/first_answer_reward.py): a response sampled past EOS is judged by its
first answer, not by the numbers in the tail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from first_answer_reward import first_answer, reward_func  # noqa: E402

from openrlhf.rewards.remote import load_reward_fn  # noqa: E402


@pytest.mark.parametrize("response,answer", [
    ("9 + 4 = 13. The answer is 13.user\nJo has 5 pens. 5 + 2 = 7. The answer is 7.", "13"),  # the tail's answer ignored
    ("The answer is $1,204. And 5", "1204"),
    ("7 - 3 = 4 so 4 it is", "7"),  # no answer phrase: the first number
    ("no number at all", None),
])
def test_the_first_answer_counts(response, answer):
    assert first_answer(response) == answer


def test_reward_through_the_trainers_loader():
    # The trainer loads it as --reward.remote_url and calls it with prompt + response.
    fn = load_reward_fn(str(Path(__file__).resolve().parents[2] / "benchmarks" / "first_answer_reward.py"))
    prompt = "Solved example: 2 + 2 = 4. The answer is 4.\nJo has 9 pens and gets 4 more."
    tail = " The answer is 99. 13 13"
    assert fn([prompt + " 9 + 4 = 13. The answer is 13." + tail, prompt + " The answer is 12." + " 13"], [prompt, prompt], ["13", "13"]) == [1.0, 0.0]


def test_a_query_without_its_prompt_is_refused():
    with pytest.raises(ValueError, match="does not start with its prompt"):
        reward_func(["13"], ["Jo has 9 pens"], ["13"])
