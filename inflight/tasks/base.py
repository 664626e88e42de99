"""What every task is, whatever it asks: a stream of `Problem`s and a reward that scores a completion of one.

A task is any iterable of `Problem` (the arithmetic generator, a JSONL file); iterating it again restarts the stream.
A reward is `f(completion_text, problem) -> float`, sync or async, named on the command line as `module:function`
(inflight/tasks/loading.py turns it into an async callable). Nothing here knows about engines, tokens or weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Problem:
    """One question with its reference answer; `id` is stable for a given task seed and position (rollouts and the
    learner's exactly-once bookkeeping name problems by it)."""

    id: str
    question: str
    answer: int | str


RewardFn = Callable[[str, Problem], float]


class Task(Protocol):
    """An iterable of problems; a second `iter()` starts the same stream again (same seed, same order)."""

    def __iter__(self) -> Iterator[Problem]: ...
