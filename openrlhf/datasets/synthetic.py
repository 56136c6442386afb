"""Procedurally generated arithmetic tasks with exactly verifiable answers.

Format (short and regular, so a tiny character-level model can learn it):
    input  "3+4*2="     label "11"
An expression of ``difficulty`` binary operations over single-digit operands (by default
0..9) with ``+``, ``-`` and ``*`` and the usual precedence (``*`` before ``+``/``-``,
left to right otherwise), then ``=``. No spaces, no parentheses. Labels are the exact
integer result as a decimal string; expressions with a negative result are re-drawn, so
every answer is a non-negative integer. ``answer_digits`` keeps only expressions whose
answer has exactly that many digits (the answer-length knob).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable

__all__ = ["OPERATORS", "make_arithmetic_records", "evaluate_expression", "write_jsonl"]

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


def write_jsonl(records: Iterable[dict], path: str | Path) -> Path:
    """Write records as JSON lines (creating parent folders); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return p
