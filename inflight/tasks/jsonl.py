"""Prompts from a JSONL file, and the default reward of every table task (JSONL, parquet, `datasets`).

`JsonlTask(path)` cycles through the file forever (shuffled per pass when `seed` is given); the columns are chosen
as in inflight/tasks/rows.py (`prompt` and `answer` by default). The default reward, `inflight.tasks.jsonl:reward_fn`:
- a reference answer in GSM8K's form (a rationale ending in `#### 72`) is read as what follows `####`;
- a numeric answer is matched like the arithmetic task's (the last number in the completion must equal it);
- any other answer must equal the stripped completion.
Pass `--reward module:function` for anything else.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from inflight.tasks.arithmetic import reward
from inflight.tasks.base import Problem
from inflight.tasks.rows import RowTask, TaskFileError, read_jsonl, rows_to_problems

__all__ = ["JsonlTask", "TaskFileError", "reference_answer", "reward_fn"]


class JsonlTask(RowTask):
    def __init__(
        self,
        path: str | Path,
        seed: int | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        system_prompt: str = "",
    ):
        self.path = Path(path)
        rows = read_jsonl(self.path)
        if not rows:
            raise TaskFileError(f"prompt file {path} has no prompts")
        super().__init__(rows_to_problems(rows, self.path.stem, prompt_key, answer_key, system_prompt), seed)


def reference_answer(answer: Any) -> str:
    """The part of `answer` a completion must reproduce: after the last `####` if there is one (GSM8K), else all."""
    text = str(answer)
    return text.rpartition("####")[2].strip() if "####" in text else text.strip()


def reward_fn(completion_text: str, problem: Problem) -> float:
    """Numeric answers: the last number must equal it; other answers: exact match after stripping whitespace."""
    expected = reference_answer(problem.answer)
    try:
        Decimal(expected.replace(",", ""))
    except InvalidOperation:
        return 1.0 if completion_text.strip() == expected else 0.0
    return reward(completion_text, expected)
