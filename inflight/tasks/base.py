"""What every task is, whatever it asks: a stream of `Problem`s and rewards that score completions of one.

A task is any iterable of `Problem` (the arithmetic generator, a JSONL/parquet file, a local `datasets` dataset);
iterating it again restarts the stream. Rewards come in two conventions, named on the command line as `module:function`
(inflight/tasks/rewards.py loads and combines them):

- per sample: `f(completion_text, problem) -> float`, `problem` being the `Problem` below;
- per group (TRL's): `f(prompts, completions, **columns) -> list[float | None]`, once per group.

Nothing here knows about engines, tokens or weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer.

    `id` is stable for a given task seed and position (rollouts and the learner's exactly-once bookkeeping name
    problems by it). `question` is the user's text; `messages` the whole chat the model is prompted with when the
    dataset gave messages or a system prompt was added (None: one user message, `question`). `columns` is the row the
    problem came from, every column included: what a per-group reward receives as keyword arguments.
    """

    id: str
    question: str
    answer: Any
    messages: tuple[Message, ...] | None = None
    columns: dict[str, Any] = field(default_factory=dict, compare=False)
    conversational: bool = False  # the dataset's prompt was chat messages (TRL then passes messages, not text)

    def chat(self) -> list[Message]:
        """The messages the chat template turns into prompt tokens."""
        return [dict(m) for m in self.messages] if self.messages else [{"role": "user", "content": self.question}]

    def trl_prompt(self) -> str | list[Message]:
        """The prompt as TRL hands it to a reward: the messages for a conversational dataset, else the text."""
        return self.chat() if self.conversational else self.question


RewardFn = Callable[[str, Problem], float]


class Task(Protocol):
    """An iterable of problems; a second `iter()` starts the same stream again (same seed, same order)."""

    def __iter__(self) -> Iterator[Problem]: ...
