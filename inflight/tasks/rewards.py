"""Rewards: load `--reward mod:f1,mod:f2`, call each in its convention, combine them with `--reward-weights`.

Two conventions, told apart by the function's signature (`convention_of`), or forced with `--reward-convention`:

- `sample`: `f(completion_text, problem) -> float`, sync or async, once per completion. `problem` is
  `inflight.tasks.base.Problem`: `.question`, `.answer`, `.columns` (the whole dataset row), `.id`.
- `group` (TRL's): `f(prompts, completions, **columns) -> list[float | None]`, sync or async, once per group.
  `prompts[i]` is the prompt (text, or the chat messages when the dataset's prompts are messages), `completions[i]`
  the completion (text, or `[{"role": "assistant", "content": text}]` for a chat dataset), each column of the row but
  `prompt`/`completion` a keyword argument holding one value per completion, and `completion_ids` the token ids.

Built-in rewards are named without a module (`--reward math`: math-verify, inflight/tasks/math_reward.py).

Picked by signature: a function with a parameter named `prompts` or `completions`, or with `**kwargs`, is `group`;
one that takes exactly two positional arguments is `sample`; anything else is refused with the fix.

Combination: a sample's reward is Σ weight_k × r_k over the rewards that scored it. `None` from a group reward means
"not applicable" (TRL's meaning): that reward is left out of the sum for that sample (a sample no reward applies to
scores 0.0). A reward that raises, returns a non-number, a non-finite number, or (group) a list of the wrong length
scores 0.0 on the samples concerned; each such failure is counted in `errors` and logged, never raised.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inflight.tasks.base import Problem

log = logging.getLogger("inflight.rewards")
CONVENTIONS = ("auto", "sample", "group")
RESERVED = ("prompt", "completion", "prompts", "completions", "completion_ids")  # never passed as a column
# `--reward <name>`: rewards shipped here, named without a module -> (module:function, the optional package it needs)
BUILTIN_REWARDS = {"math": ("inflight.tasks.math_reward:reward_fn", "math_verify")}


@dataclass
class Reward:
    """One loaded reward function: `name` keys its metrics; `convention` is `sample` or `group`."""

    name: str
    fn: Callable
    convention: str
    weight: float = 1.0
    failures: int = field(default=0, compare=False)  # so far, in this process (`failed`)

    def failed(self, where: str, exc: Exception) -> None:
        """Count a failure; log the first with its traceback (what the reward's author needs), then the 10th, 100th,
        ... with the count: a broken reward fails on every sample, and a line per sample buried the run's terminal.
        Every failure is counted all the same (the serve's progress line: `reward errors`)."""
        self.failures += 1
        if self.failures == 1:
            first = "reward %s failed on %s (scored 0.0; its next failures are logged at the 10th, 100th, ...): %r"
            log.error(first, self.name, where, exc, exc_info=exc)
        elif str(self.failures).rstrip("0") == "1":
            again = "reward %s has failed %d times (each scored 0.0), the latest on %s: %r"
            log.error(again, self.name, self.failures, where, exc)


@dataclass
class GroupScores:
    """A group's rewards: `total[i]` the weighted sum for completion i, `each[name][i]` each reward's own value
    (None: not applicable, or failed), `errors` the failures counted while scoring it."""

    total: list[float]
    each: dict[str, list[float | None]]
    errors: int = 0


def convention_of(fn: Callable, spec: str) -> str:
    """`group` or `sample` by `fn`'s signature (module docstring); raises naming `--reward-convention` if unclear."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = None
    if params is not None:
        names = {p.name for p in params}
        if {"prompts", "completions"} & names or any(p.kind is p.VAR_KEYWORD for p in params):
            return "group"
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p for p in positional if p.default is p.empty]
        if len(required) <= 2 <= len(positional) or any(p.kind is p.VAR_POSITIONAL for p in params):
            return "sample"
    raise ValueError(
        f"--reward {spec!r}: cannot tell its convention from its signature; name its parameters "
        "(prompts, completions, **kwargs) or (completion_text, problem), or pass "
        "--reward-convention group|sample"
    )


def load_rewards(specs: str, weights: str = "", convention: str = "auto") -> list[Reward]:
    """`--reward mod:f1,mod:f2`, `--reward-weights 1.0,0.5` (empty: all 1.0) and `--reward-convention`."""
    names = [s.strip() for s in specs.split(",") if s.strip()]
    if not names:
        raise ValueError("--reward is empty, expected module:function[,module:function...]")
    values = _weights(weights, len(names))
    if convention not in CONVENTIONS:
        raise ValueError(f"--reward-convention is {convention!r}, expected one of {CONVENTIONS}")
    rewards = []
    for spec, weight in zip(names, values, strict=True):
        fn = import_function(spec)
        kind = convention_of(fn, spec) if convention == "auto" else convention
        rewards.append(Reward(spec.partition(":")[2] or spec, fn, kind, weight))
    if len({r.name for r in rewards}) < len(rewards):  # two modules' `reward`: key the metrics by the whole spec
        for r, spec in zip(rewards, names, strict=True):
            r.name = spec
    return rewards


def _weights(text: str, n: int) -> list[float]:
    if not text.strip():
        return [1.0] * n
    try:
        values = [float(w) for w in text.split(",")]
    except ValueError as exc:
        raise ValueError(f"--reward-weights is {text!r}, expected {n} comma-separated numbers") from exc
    if len(values) != n or not all(math.isfinite(w) for w in values):
        raise ValueError(
            f"--reward-weights is {text!r}: {len(values)} weights for {n} rewards, expected {n} "
            "finite numbers, one per --reward"
        )
    return values


def import_function(spec: str) -> Callable:
    """The callable `module:function` (or a built-in name, BUILTIN_REWARDS) names; a ValueError naming `--reward`
    and the fix otherwise."""
    if spec in BUILTIN_REWARDS:
        name, (spec, package) = spec, BUILTIN_REWARDS[spec]
        if importlib.util.find_spec(package) is None:  # refused at load, before the engine starts
            raise ValueError(f"--reward {name!r} needs the {package} package: pip install 'inflight[envs]'")
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"--reward is {spec!r}, expected 'module:function' (e.g. inflight.tasks.arithmetic:reward_fn) or a "
            f"built-in reward: {', '.join(BUILTIN_REWARDS)}"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--reward {spec!r} could not be imported: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"--reward {spec!r} is a {type(fn).__name__}, expected a function")
    return fn


async def call(fn: Callable, *args, **kwargs) -> Any:
    """Await an async reward; run a sync one in a worker thread so a slow reward never blocks the event loop."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


async def score_group(
    rewards: list[Reward], problem: Problem, texts: list[str], completion_ids: list[list[int]] | None = None
) -> GroupScores:
    """Every reward on one group's completions, combined (module docstring). Never raises for a reward's fault."""
    scores = GroupScores(total=[0.0] * len(texts), each={})
    for r in rewards:
        if r.convention == "group":
            values, errors = await _group_values(r, problem, texts, completion_ids)
        else:
            pairs = await asyncio.gather(*(_sample_value(r, problem, t) for t in texts))
            values, errors = [v for v, _ in pairs], sum(e for _, e in pairs)
        scores.each[r.name], scores.errors = values, scores.errors + errors
        for i, v in enumerate(values):
            if v is not None:
                scores.total[i] += r.weight * v
    return scores


async def _sample_value(r: Reward, problem: Problem, text: str) -> tuple[float, int]:
    try:
        return _number(await call(r.fn, text, problem), allow_none=False), 0
    except Exception as exc:  # a buggy reward must not lose the sample: score 0, count, log
        r.failed(problem.id, exc)
        return 0.0, 1


async def _group_values(
    r: Reward, problem: Problem, texts: list[str], completion_ids: list[list[int]] | None
) -> tuple[list[float | None], int]:
    n = len(texts)
    columns = {k: [v] * n for k, v in (problem.columns or {"answer": problem.answer}).items() if k not in RESERVED}
    completions: list[Any] = (
        [[{"role": "assistant", "content": t}] for t in texts] if problem.conversational else list(texts)
    )
    try:
        out = await call(
            r.fn, [problem.trl_prompt()] * n, completions, completion_ids=completion_ids or [[]] * n, **columns
        )
        if not isinstance(out, list | tuple) or len(out) != n:
            raise TypeError(f"returned {out!r:.80}, expected a list of {n} floats or None (one per completion)")
        return [_number(v, allow_none=True) for v in out], 0
    except Exception as exc:
        r.failed(f"group of {problem.id}", exc)
        return [0.0] * n, 1


def _number(value: Any, allow_none: bool) -> float | None:
    """A reward's value as a float (bools and numpy/torch scalars too); None where allowed; else TypeError."""
    if value is None and allow_none:
        return None
    if value is None or isinstance(value, str | bytes):  # float("1") would quietly accept a string
        raise TypeError(f"returned {value!r:.80}, expected a finite number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"returned {value!r:.80}, expected a finite number") from None
    if not math.isfinite(number):
        raise TypeError(f"returned {value!r}, expected a finite number")
    return number


@dataclass
class RewardMeans:
    """Running sums behind the per-reward means in the serve's progress lines (None values left out)."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, scores: GroupScores) -> None:
        for name, values in scores.each.items():
            scored = [v for v in values if v is not None]
            self.sums[name] = self.sums.get(name, 0.0) + sum(scored)
            self.counts[name] = self.counts.get(name, 0) + len(scored)

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums if self.counts[k]}


class ConstantRewardWatch:
    """Warns once per reward that gave one same value to every sample of `steps` consecutive steps.

    A step is `groups_per_step` finished groups, as the learner batches them. A reward that never varies gives every
    group a zero advantage: the run learns nothing from it. All 0.0 is usually a reward that never recognises a right
    answer (the answer column holds more than the answer, the completion is cut by --max-tokens, a format the model
    does not follow); `steps` 0 turns the watch off.
    """

    def __init__(self, groups_per_step: int, steps: int):
        self.groups_per_step, self.steps = groups_per_step, steps
        self._values: dict[str, set[float]] = {}  # this step's distinct values per reward
        self._groups = 0
        self._run: dict[str, int] = {}  # consecutive steps with one same value, per reward
        self._constant: dict[str, float | None] = {}  # that value (None: the last step varied)
        self.warned: set[str] = set()

    def add(self, scores: GroupScores) -> list[str]:
        """Account one group; returns the warnings due now (each reward warns at most once)."""
        if self.steps <= 0:
            return []
        for name, values in scores.each.items():
            self._values.setdefault(name, set()).update(v for v in values if v is not None)
        self._groups += 1
        if self._groups < self.groups_per_step:
            return []
        warnings = []
        for name, seen in self._values.items():
            value = next(iter(seen)) if len(seen) == 1 else None
            same = value is not None and self._constant.get(name) == value
            self._run[name] = self._run.get(name, 0) + 1 if same else int(value is not None)
            self._constant[name] = value
            if self._run[name] >= self.steps and name not in self.warned:
                self.warned.add(name)
                warnings.append(self._message(name, value))
        self._values, self._groups = {}, 0
        return warnings

    def _message(self, name: str, value: float) -> str:
        span = f"every sample of the last {self.steps} steps ({self.steps * self.groups_per_step} groups)"
        if value == 0.0:
            return (
                f"reward {name} was 0.0 on {span}: it probably never recognises a right answer. Check what it "
                "compares: the answer column (--answer-key; a GSM8K answer is a rationale ending in '#### 72', "
                "so parse what follows '####'), the completion's format, and whether --max-tokens cuts the "
                "answer off (run scripts/task_accuracy.py with the same flags)"
            )
        return (
            f"reward {name} was {value} on {span}: a constant reward gives every group a zero advantage, so "
            "nothing is learned from it; check that it depends on the completion"
        )
