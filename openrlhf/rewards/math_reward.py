"""Rule-based math reward: 1.0 if the response's final answer equals the label, else 0.0.

Equivalence is decided by `math_verify` (parse both sides, then a symbolic/numeric
comparison), so "1/2" matches "0.5" and "\\boxed{19}" matches "19". A numeric label needs a number as the
answer: an unevaluated expression ("9 + 4") does not match it. The reward never raises:
unparsable or pathological text scores 0.0.
"""

from __future__ import annotations

import re
import threading
from typing import Sequence

__all__ = ["DEFAULT_STOP_STRINGS", "extract_final_number", "math_reward", "math_reward_one"]

# End-of-sequence markers tokenizers decode into text; the answer is what comes before them.
DEFAULT_STOP_STRINGS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<eos>", "<end_of_turn>")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?")
_MAX_CHARS = 20_000  # longer responses are cut to their tail: sympy on megabytes of text can hang


def _strip_at_stop(text: str, stop: Sequence[str]) -> str:
    cut = len(text)
    for s in stop:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def extract_final_number(text: str, stop: Sequence[str] = DEFAULT_STOP_STRINGS) -> str | None:
    """The last number in ``text`` (before any EOS marker), normalised: "19", "-3", "0.5", "1/2".

    For the tiny-model format the response is just the number, possibly followed by EOS
    text: "19</s><pad>" -> "19". Thousands separators are removed ("1,234" -> "1234").
    Returns None when there is no number.
    """
    if not isinstance(text, str):
        return None
    matches = _NUMBER.findall(_strip_at_stop(text, stop))
    if not matches:
        return None
    num = re.sub(r"\s+", "", matches[-1]).replace(",", "")
    if num.startswith("+"):
        num = num[1:]
    return num or None


def _is_number(x) -> bool:
    """A sympy number, or a plain fraction: "1/2" in text parses to the unevaluated 1 * 2**-1 ("12 * 3" is no number)."""
    if getattr(x, "is_Number", False):
        return True
    inverse = lambda a: bool(getattr(a, "is_Pow", False) and a.base.is_Number and a.exp == -1)  # noqa: E731
    if inverse(x):
        return True
    if getattr(x, "is_Mul", False) and len(x.args) == 2:
        return any(a.is_Number for a in x.args) and any(inverse(a) for a in x.args)
    return False


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def math_reward_one(response: str, label: str | None) -> float:
    """Reward of one response against one label (see `math_reward`)."""
    if label is None or not str(label).strip() or not isinstance(response, str):
        return 0.0  # no reference answer: nothing can be verified
    try:
        from math_verify import parse, verify

        # math_verify's timeouts use signal.alarm, which only works in the main thread;
        # elsewhere (Ray actor threads, thread pools) run without its timeout.
        main = _in_main_thread()
        parse_timeout = 5 if main else None
        verify_timeout = 5 if main else None
        text = _strip_at_stop(response, DEFAULT_STOP_STRINGS)[-_MAX_CHARS:]
        gold = parse(str(label), parsing_timeout=parse_timeout)
        if not gold:  # a label math_verify cannot parse: compare as plain text
            return float(str(label).strip() == text.strip())
        pred = parse(text, parsing_timeout=parse_timeout)
        if not pred:
            return 0.0
        if any(_is_number(g) for g in gold) and not any(_is_number(p) for p in pred):
            # A numeric label needs a number: math_verify evaluates an expression it extracts, so "9 + 4 = ?", an echo
            # of a word problem's arithmetic, would otherwise score as the answer 13.
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=verify_timeout) else 0.0
    except Exception:  # noqa: BLE001 - a reward must never crash the training step
        return 0.0


def math_reward(responses: list[str], labels: list[str]) -> list[float]:
    """1.0 for each response whose final answer is equivalent to its label, else 0.0."""
    if len(responses) != len(labels):
        raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
    return [math_reward_one(r, l) for r, l in zip(responses, labels)]
