"""The embedded default task: seeded synthetic arithmetic with a verifiable reward.

`ArithmeticTask(seed)` yields `Problem`s such as "What is 3 + 4? Reply with only the number." with answer 7; the same
seed always yields the same problems in the same order. `reward(text, answer)` scores one completion; `reward_fn(text,
problem)` is the same score in the `module:function` shape a reward loader calls:
`inflight.tasks.arithmetic:reward_fn`.

What counts as correct (reward 1.0; everything else is 0.0):
- The completion is scanned for numbers: ASCII digits, optionally grouped in thousands by commas ("1,234" is 1234; "3,4"
  is two numbers), optionally with a decimal part ("7.5"), optionally signed by a "-" that does not directly follow a
  digit ("-7" is negative, "10-3" is 10 and 3). A trailing "." is punctuation ("7." is 7).
- Only the LAST number counts, and it must equal the answer exactly ("7.0" equals 7; "7.5" never equals an integer).
- No number at all (or an empty completion) scores 0.0.
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Callable, Iterator
from decimal import Decimal
from itertools import islice

from inflight.tasks.base import Problem

OPERATORS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
NUMBER = re.compile(r"(?<![0-9])-?(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?")


class ArithmeticTask:
    """An endless seeded stream of `a op b` problems (`terms` > 2: `a op b op c ...`, usual precedence), operands in
    [0, max_operand]. Iterating restarts the stream; two terms draw exactly what they always drew."""

    def __init__(self, seed: int, max_operand: int = 9, ops: tuple[str, ...] = ("+",), terms: int = 2):
        if max_operand < 1:
            raise ValueError(f"max_operand is {max_operand}, expected >= 1: pass a positive largest operand")
        unknown = [op for op in ops if op not in OPERATORS]
        if not ops or unknown:
            raise ValueError(f"ops is {ops!r}, expected a non-empty tuple drawn from {tuple(OPERATORS)}")
        if terms < 2:
            raise ValueError(f"terms is {terms}, expected >= 2 operands per problem")
        self.seed, self.max_operand, self.ops, self.terms = seed, max_operand, tuple(ops), terms

    def __iter__(self) -> Iterator[Problem]:
        rng = random.Random(self.seed)
        index = 0
        while True:
            values = [rng.randint(0, self.max_operand) for _ in range(self.terms)]
            ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
            expression = " ".join(f"{op} {v}" for op, v in zip(["", *ops], values, strict=True)).strip()
            question = f"What is {expression}? Reply with only the number."
            yield Problem(f"arith-{self.seed}-{index}", question, evaluate(values, ops))
            index += 1

    def take(self, n: int) -> list[Problem]:
        """The first `n` problems of the stream."""
        return list(islice(self, n))


def evaluate(values: list[int], ops: list[str]) -> int:
    """`values[0] ops[0] values[1] ...` with * before + and -."""
    terms, signs = [values[0]], []
    for op, v in zip(ops, values[1:], strict=True):
        if op == "*":
            terms[-1] *= v
        else:
            terms.append(v)
            signs.append(op)
    total = terms[0]
    for sign, t in zip(signs, terms[1:], strict=True):
        total = OPERATORS[sign](total, t)
    return total


def last_number(text: str) -> Decimal | None:
    """The last number in `text` as the module docstring defines it, or None if there is none."""
    matches = NUMBER.findall(text)
    return Decimal(matches[-1].replace(",", "")) if matches else None


def reward(completion_text: str, answer: int | str) -> float:
    """1.0 if the last number in `completion_text` equals `answer` exactly, else 0.0 (see the module docstring)."""
    found = last_number(completion_text)
    return 1.0 if found is not None and found == Decimal(str(answer).replace(",", "")) else 0.0


def reward_fn(completion_text: str, problem: Problem) -> float:
    """`reward` for a whole `Problem`: the `module:function` entry point, `inflight.tasks.arithmetic:reward_fn`."""
    return reward(completion_text, problem.answer)
