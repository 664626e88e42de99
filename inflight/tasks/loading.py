"""Turn the serve flags `--task` (with `--prompt-key`, `--answer-key`, `--system-prompt`) and `--reward` into a problem
stream and its rewards.

`--task arithmetic` (the embedded default; `--max-operand` sets its difficulty), or a table: `jsonl:<path>`,
`parquet:<path>`, `hf:<saved dir or dataset name>[@split]` (inflight/tasks/rows.py), or
`reasoning-gym:<dataset>[,<dataset>...]` (inflight/tasks/reasoning_gym.py; `--task-args` its JSON options).
`--reward module:function[,...]` or a built-in name (`math`) names the rewards (inflight/tasks/rewards.py: both
conventions, weights, how failures count).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import replace

from inflight.tasks.arithmetic import ArithmeticTask
from inflight.tasks.base import Problem
from inflight.tasks.reasoning_gym import PREFIX as REASONING_GYM
from inflight.tasks.reasoning_gym import ReasoningGymTask
from inflight.tasks.rewards import call, import_function
from inflight.tasks.rows import RowTask, TaskFileError, load_rows, rows_to_problems

AsyncReward = Callable[[str, Problem], Awaitable[float]]
TABLE_REWARD = "inflight.tasks.jsonl:reward_fn"


class SystemPrompted:
    """A task whose every prompt starts with `system_prompt` (for tasks that build their own problems)."""

    def __init__(self, task: Iterable[Problem], system_prompt: str):
        self.task, self.system_prompt = task, system_prompt

    def __iter__(self) -> Iterator[Problem]:
        for p in self.task:
            yield replace(p, messages=({"role": "system", "content": self.system_prompt}, *p.chat()))


def load_task(
    spec: str,
    seed: int,
    max_operand: int = 9,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    system_prompt: str = "",
    shuffle: bool = True,
    terms: int = 2,
    ops: str = "+",
    task_args: str = "",
) -> tuple[Iterable[Problem], str]:
    """The problem stream for `spec` and the `module:function` of its default reward. `shuffle` False keeps a
    table's order (an eval pass); the arithmetic stream is seeded either way (`terms`, `ops`: its shape).
    `task_args`: the task's JSON options, read by Reasoning Gym tasks only (refused for the others)."""
    if spec.startswith(REASONING_GYM):
        task = ReasoningGymTask(spec, seed, task_args, shuffle=shuffle, system_prompt=system_prompt)
        return task, "inflight.tasks.reasoning_gym:reward_fn"
    if task_args.strip():
        raise TaskFileError(f"--task-args is {task_args!r} but --task {spec!r} takes no options: drop --task-args")
    if spec == "arithmetic":
        task = ArithmeticTask(seed, max_operand=max_operand, ops=tuple(ops), terms=terms)
        return (SystemPrompted(task, system_prompt) if system_prompt else task), "inflight.tasks.arithmetic:reward_fn"
    rows, name = load_rows(spec)
    problems = rows_to_problems(rows, name, prompt_key, answer_key, system_prompt)
    return RowTask(problems, seed=seed if shuffle else None), TABLE_REWARD


def load_reward(spec: str) -> AsyncReward:
    """One per-sample reward `f(completion_text, problem)` as an async callable returning a float (its errors
    propagate: inflight/tasks/rewards.py:score_group is what counts and logs them)."""
    fn = import_function(spec)

    async def score(text: str, problem: Problem) -> float:
        return float(await call(fn, text, problem))

    return score
