"""Procedurally generated arithmetic tasks with exactly verifiable answers.

Format (short and regular, so a tiny character-level model can learn it):
    input  "3+4*2="     label "11"
An expression of ``difficulty`` binary operations over single-digit operands (by default
0..9) with ``+``, ``-`` and ``*`` and the usual precedence (``*`` before ``+``/``-``,
left to right otherwise), then ``=``. No spaces, no parentheses. Labels are the exact
integer result as a decimal string; expressions with a negative result are re-drawn, so
every answer is a non-negative integer. ``answer_digits`` keeps only expressions whose
answer has exactly that many digits (the answer-length knob).

Word problems (``make_word_problem_records``) put the same kind of arithmetic into short English
stories ("Ava has 12 stickers and buys 7 more ...") for instruction-tuned models: one or two
operations, whole non-negative answers, the arithmetic kept beside the text as ``expression``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable

__all__ = ["ONE_STEP_KINDS", "OPERATORS", "make_arithmetic_records", "evaluate_expression", "make_word_problem_records", "write_jsonl"]

OPERATORS = ("+", "-", "*")
_MAX_TRIES_PER_RECORD = 2000


def evaluate_expression(operands: list[int], ops: list[str]) -> int:
    """Value of operands[0] ops[0] operands[1] ... with * binding tighter than + and -."""
    if len(operands) != len(ops) + 1:
        raise ValueError(f"{len(operands)} operands need {len(operands) - 1} operators, got {len(ops)}")
    terms: list[int] = [operands[0]]  # signed product terms
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        elif op == "+":
            terms.append(x)
        elif op == "-":
            terms.append(-x)
        else:
            raise ValueError(f"unknown operator {op!r}; supported {OPERATORS}")
    return sum(terms)


def make_arithmetic_records(
    n: int,
    *,
    difficulty: int = 1,
    seed: int = 0,
    answer_digits: int | None = None,
    max_operand: int = 9,
    operators: Iterable[str] = OPERATORS,
) -> list[dict]:
    """``n`` records ``{"input": "3+4*2=", "label": "11", "difficulty": 2}``, deterministic in ``seed``.

    difficulty: number of operations (>= 1). answer_digits: if set, only answers with
    exactly that many digits. max_operand: operands are drawn from 0..max_operand.
    Raises ValueError if the knobs make the requested answers (nearly) impossible.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if difficulty < 1:
        raise ValueError(f"difficulty (number of operations) must be >= 1, got {difficulty}")
    if answer_digits is not None and answer_digits < 1:
        raise ValueError(f"answer_digits must be >= 1, got {answer_digits}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    ops_pool = tuple(operators)
    bad = [o for o in ops_pool if o not in OPERATORS]
    if not ops_pool or bad:
        raise ValueError(f"operators must be a non-empty subset of {OPERATORS}, got {ops_pool}")
    rng = random.Random(f"arith-{seed}-{difficulty}-{answer_digits}-{max_operand}-{''.join(ops_pool)}")
    records: list[dict] = []
    tries = 0
    while len(records) < n:
        tries += 1
        if tries > _MAX_TRIES_PER_RECORD * (len(records) + 1):
            raise ValueError(
                f"could not draw answers with {answer_digits} digits from {difficulty} operations over "
                f"0..{max_operand} with {ops_pool}; change answer_digits, difficulty or max_operand"
            )
        operands = [rng.randint(0, max_operand) for _ in range(difficulty + 1)]
        ops = [rng.choice(ops_pool) for _ in range(difficulty)]
        value = evaluate_expression(operands, ops)
        if value < 0 or (answer_digits is not None and len(str(value)) != answer_digits):
            continue
        expr = "".join(str(x) + op for x, op in zip(operands, ops)) + str(operands[-1])
        records.append({"input": expr + "=", "label": str(value), "difficulty": difficulty})
    return records


_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya")
_ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells", "coins", "cards")


ONE_STEP_KINDS = ("add", "sub", "mul", "div", "compare")


def _one_step(rng: random.Random, name: str, other: str, item: str, top: int, kinds: tuple[str, ...] = ONE_STEP_KINDS) -> tuple[str, str, int]:
    kind = rng.choice(kinds)
    a, b = rng.randint(2, top), rng.randint(2, top)
    if kind == "add":
        return f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?", f"{a}+{b}", a + b
    if kind == "sub":
        a, b = max(a, b), min(a, b)
        return f"{name} has {a} {item} and gives {b} of them away. How many {item} does {name} have left?", f"{a}-{b}", a - b
    if kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        return f"{name} buys {a} boxes of {item} with {b} {item} in each box. How many {item} does {name} buy?", f"{a}*{b}", a * b
    if kind == "div":
        each, friends = rng.randint(2, 12), rng.randint(2, 9)
        total = each * friends
        return (f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?",
                f"{total}/{friends}", each)
    a, b = max(a, b), min(a, b)  # compare
    return f"{name} has {a} {item} and {other} has {b} {item}. How many more {item} does {name} have than {other}?", f"{a}-{b}", a - b


def _two_steps(rng: random.Random, name: str, other: str, item: str, top: int) -> tuple[str, str, int]:
    kind = rng.choice(("add_sub", "start_plus_packs", "packs_minus", "sub_add"))
    a, b = rng.randint(5, top), rng.randint(2, top)
    if kind == "add_sub":
        c = rng.randint(1, a + b)
        return (f"{name} has {a} {item}, finds {b} more, and then loses {c}. How many {item} does {name} have now?",
                f"{a}+{b}-{c}", a + b - c)
    if kind == "start_plus_packs":
        packs, per = rng.randint(2, 9), rng.randint(2, 12)
        return (f"{name} has {a} {item} and buys {packs} packs with {per} {item} in each pack. "
                f"How many {item} does {name} have in total?", f"{a}+{packs}*{per}", a + packs * per)
    if kind == "packs_minus":
        rows, per = rng.randint(2, 9), rng.randint(2, 12)
        c = rng.randint(1, rows * per)
        return (f"A shop has {rows} shelves with {per} {item} on each shelf. It sells {c} {item}. "
                f"How many {item} are left in the shop?", f"{rows}*{per}-{c}", rows * per - c)
    c = rng.randint(1, top)  # sub_add
    a, b = max(a, b), min(a, b)
    return (f"{name} has {a} {item} and gives {b} to {other}. Later {name} gets {c} more. How many {item} does {name} have now?",
            f"{a}-{b}+{c}", a - b + c)


def make_word_problem_records(
    n: int, *, steps: Iterable[int] = (1, 2), seed: int = 0, max_number: int = 30, kinds: Iterable[str] | None = None
) -> list[dict]:
    """``n`` records ``{"input": "Ava has 12 stickers ...?", "label": "19", "expression": "12+7", "steps": 1}``.

    steps: how many operations a problem may take (1, 2 or both; drawn evenly). Numbers in a problem
    stay within 2..max_number (products of up to 9 x 12). kinds: the one-operation stories drawn from
    (a subset of ``ONE_STEP_KINDS``; default all), e.g. ``("add", "sub", "compare")`` for no
    multiplication or division. Deterministic in the arguments.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    steps = tuple(steps)
    if not steps or any(s not in (1, 2) for s in steps):
        raise ValueError(f"steps must be a non-empty subset of (1, 2), got {steps}")
    if max_number < 5:
        raise ValueError(f"max_number must be >= 5, got {max_number}")
    kinds = ONE_STEP_KINDS if kinds is None else tuple(kinds)
    if not kinds or any(k not in ONE_STEP_KINDS for k in kinds):
        raise ValueError(f"kinds must be a non-empty subset of {ONE_STEP_KINDS}, got {kinds}")
    # The default kinds keep the seed string of the records drawn before `kinds` existed.
    rng = random.Random(f"words-{seed}-{steps}-{max_number}" + ("" if kinds == ONE_STEP_KINDS else f"-{kinds}"))
    records = []
    for _ in range(n):
        k = rng.choice(steps)
        name, other = rng.sample(_NAMES, 2)
        item = rng.choice(_ITEMS)
        if k == 1:
            text, expr, value = _one_step(rng, name, other, item, max_number, kinds)
        else:
            text, expr, value = _two_steps(rng, name, other, item, max_number)
        records.append({"input": text, "label": str(value), "expression": expr, "steps": k})
    return records


def write_jsonl(records: Iterable[dict], path: str | Path) -> Path:
    """Write records as JSON lines (creating parent folders); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return p
