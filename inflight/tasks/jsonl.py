"""Prompts from a JSONL file: one object per line, `prompt` (the user message) and `answer` (what the reward checks).

`JsonlTask(path)` cycles through the file forever (shuffled per pass when `seed` is given), so serve can draw as many
groups as it likes. The default reward, `inflight.tasks.jsonl:reward_fn`, treats a numeric answer like the arithmetic
task (the last number in the completion must equal it) and any other answer as an exact match of the stripped
completion. Pass `--reward module:function` for anything else.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from pathlib import Path

from inflight.tasks.arithmetic import reward
from inflight.tasks.base import Problem


class TaskFileError(ValueError):
    """A prompt file is missing, empty or has a line without the required fields."""


class JsonlTask:
    def __init__(self, path: str | Path, seed: int | None = None):
        self.path, self.seed = Path(path), seed
        self.problems = _read(self.path)

    def __iter__(self) -> Iterator[Problem]:
        rng = random.Random(self.seed)
        while True:
            order = list(self.problems)
            if self.seed is not None:
                rng.shuffle(order)
            yield from order


def _read(path: Path) -> list[Problem]:
    if not path.is_file():
        raise TaskFileError(f"prompt file {path} does not exist: pass --task jsonl:<path to a .jsonl file>")
    problems = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFileError(f"{path}:{lineno} is not JSON: {exc}") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or "answer" not in obj:
            raise TaskFileError(f"{path}:{lineno} needs a string 'prompt' and an 'answer' field")
        problems.append(Problem(str(obj.get("id", f"{path.stem}-{lineno}")), obj["prompt"], obj["answer"]))
    if not problems:
        raise TaskFileError(f"prompt file {path} has no prompts")
    return problems


def reward_fn(completion_text: str, problem: Problem) -> float:
    """Numeric answers: the last number must equal it; other answers: exact match after stripping whitespace."""
    try:
        Decimal(str(problem.answer).replace(",", ""))
    except InvalidOperation:
        return 1.0 if completion_text.strip() == str(problem.answer).strip() else 0.0
    return reward(completion_text, problem.answer)
