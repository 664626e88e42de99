"""Turn the serve flags `--task` and `--reward` into a problem stream and an async reward function.

`--task arithmetic` (the embedded default; `--max-operand` sets its difficulty) or `--task jsonl:<path>`.
`--reward module:function` names any importable callable `f(completion_text, problem) -> float`, sync or async; a sync
one runs in a worker thread so a slow reward never blocks the engine's event loop.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Awaitable, Callable, Iterable

from inflight.tasks.arithmetic import ArithmeticTask
from inflight.tasks.base import Problem

AsyncReward = Callable[[str, Problem], Awaitable[float]]


def load_task(spec: str, seed: int, max_operand: int = 9) -> tuple[Iterable[Problem], str]:
    """The problem stream for `spec` and the `module:function` of its default reward."""
    if spec == "arithmetic":
        return ArithmeticTask(seed, max_operand=max_operand), "inflight.tasks.arithmetic:reward_fn"
    if spec.startswith("jsonl:"):
        from inflight.tasks.jsonl import JsonlTask

        return JsonlTask(spec.removeprefix("jsonl:"), seed=seed), "inflight.tasks.jsonl:reward_fn"
    raise ValueError(f"--task is {spec!r}, expected 'arithmetic' or 'jsonl:<path to a .jsonl file>'")


def load_reward(spec: str) -> AsyncReward:
    """Import `module:function` and wrap it as an async callable returning a float."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--reward is {spec!r}, expected 'module:function', e.g. inflight.tasks.arithmetic:reward_fn")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--reward {spec!r} could not be imported: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"--reward {spec!r} is a {type(fn).__name__}, expected a function")

    async def score(text: str, problem: Problem) -> float:
        value = (
            await fn(text, problem) if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn, text, problem)
        )
        return float(value)

    return score
