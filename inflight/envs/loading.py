"""`--env` and `--env-args` into an environment: a built-in name or `module:Class`, built with `Class(**env_args)`.

Built-ins: `single-turn` (one policy turn per episode, the task's prompt as is: every task works unchanged) and
`calculator` (inflight/envs/calculator.py). `verifiers:<taskset>` is a verifiers 0.4 environment, `--env-args` its
EnvConfig (inflight/envs/verifiers_env.py); it runs its own episodes (inflight/serve/verifiers_runner.py).
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from inflight.envs.base import Feedback
from inflight.envs.calculator import Calculator
from inflight.envs.verifiers_env import load_verifiers_env
from inflight.tasks.base import Message, Problem


class SingleTurn:
    """One policy turn: the problem's chat is the prompt, the turn is the episode (the task's rewards score it)."""

    stop: tuple[str, ...] = ()
    run_inline = True

    def reset(self, problem: Problem) -> list[Message]:
        return problem.chat()

    def step(self, state, completion: str) -> Feedback:
        return Feedback(done=True)


BUILT_IN = {"single-turn": SingleTurn, "calculator": Calculator}


def parse_env_args(text: str) -> dict[str, Any]:
    """`--env-args`: a JSON object of the environment's own keyword arguments ('' = none)."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"env_args is {text!r:.80}: not JSON ({exc.msg}); pass an object, e.g. '{{\"max_calls\": 4}}'"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"env_args is {text!r:.80}, expected a JSON object of keyword arguments")
    return value


def load_env(spec: str, env_args: str = ""):
    """The environment `spec` names, built with its arguments; `ValueError` naming the flag and the fix."""
    kind, _, name = spec.partition(":")
    if kind == "verifiers":
        if not name:
            raise ValueError(f"env is {spec!r}, expected verifiers:<taskset id>, e.g. verifiers:reverse-text")
        return load_verifiers_env(name, parse_env_args(env_args))
    cls = BUILT_IN.get(spec)
    if cls is None:
        module, sep, name = spec.partition(":")
        if not sep or not module or not name:
            raise ValueError(
                f"env is {spec!r}, expected one of {sorted(BUILT_IN)}, module:Class or verifiers:<taskset>"
            )
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(
                f"env {spec!r} could not be loaded ({exc}); is {module!r} importable from here (PYTHONPATH)?"
            ) from exc
    args = parse_env_args(env_args)
    try:
        env = cls(**args)
    except TypeError as exc:
        raise ValueError(f"env {spec!r} refused env_args {args}: {exc}") from exc
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise ValueError(f"env {spec!r} has no {method}() method: see inflight/envs/base.py:Environment")
    stop = getattr(env, "stop", ())
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"env {spec!r} has stop {stop!r}, expected a tuple of non-empty strings")
    return env
