"""What an environment is: `reset(problem) -> messages`, then `step(state, completion) -> Feedback`, turn after turn.

The serve's driver (inflight/serve/episodes.py) runs an episode as: messages = `reset(problem)`; generate the policy's
turn; `step(state, completion_text)`; if the feedback has messages and is not done, append them and generate the next
turn; at most `--max-turns` policy turns. Both calls may be plain functions or coroutines; each runs under
`--env-timeout-s`. An environment that raises, times out or returns something that is not a `Feedback` (or, from
`reset`, a list of messages) ends its episode: reward 0, counted and logged as an environment error, never the serve's.

Environments see text, never tokens: the driver turns their messages into the exact token ids the next turn's prompt
appends (earlier turns are never re-tokenised), marks those ids as environment tokens (version -1, no logprob, no
loss) and records each policy token with the weight version that sampled it.

The episode's reward is the sum of the `Feedback.reward`s the environment gave plus the task's rewards (`--reward`,
inflight/tasks/rewards.py) on the last policy turn's text; `--reward none` leaves only the environment's.
Nothing here knows about engines, tokens or weights.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

from inflight.tasks.base import Message, Problem

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Feedback:
    """What an environment answers to one policy turn.

    `messages`: appended after the policy's turn as the next turn's prompt (role and content strings, roles from
    `ROLES`); None or empty ends the episode, as does `done`. `reward`: this step's reward, added to the episode's
    (None: nothing). `tool_errors`: malformed tool calls in this turn, for the serve's metrics (the episode goes on).
    """

    messages: list[Message] | None = None
    reward: float | None = None
    done: bool = False
    tool_errors: int = 0


@dataclass
class EpisodeState:
    """One episode as the environment sees it: the problem, every message so far (the policy's turns as assistant
    messages, the environment's as they were given), the number of policy turns taken, and `data`, the
    environment's own scratch space for the episode."""

    problem: Problem
    messages: list[Message]
    turn: int = 0
    data: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """The interface `--env module:Class` loads; `Class(**env_args)` builds one per serve (shared by its episodes,
    so per-episode data belongs in `EpisodeState.data`). `stop`: optional strings that end a policy turn (e.g. the
    closing tag of a tool call); they stay in the turn's text. `run_inline`: optional, True for plain-function
    environments that are quick and never block, called on the serve's event loop instead of a thread of their own
    (and then under no timeout: a blocking one would stall the serve)."""

    stop: tuple[str, ...]
    run_inline: bool

    def reset(self, problem: Problem) -> list[Message] | Awaitable[list[Message]]: ...

    def step(self, state: EpisodeState, completion: str) -> Feedback | Awaitable[Feedback]: ...


class EnvError(ValueError):
    """An environment answered something the driver cannot use; the message names what and the expected shape."""


def check_messages(value: Any, where: str) -> list[Message]:
    """`value` as a list of {"role", "content"} string messages, or `EnvError` naming the bad entry."""
    if not isinstance(value, list | tuple):
        raise EnvError(f"{where} returned {value!r:.80}, expected a list of {{'role', 'content'}} messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise EnvError(f"{where} message {i} is {m!r:.80}, expected {{'role': one of {ROLES}, 'content': str}}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def check_feedback(value: Any) -> Feedback:
    """`value` as a `Feedback` with usable messages and a finite reward, or `EnvError`."""
    if not isinstance(value, Feedback):
        raise EnvError(f"step returned {value!r:.80}, expected inflight.envs.base.Feedback")
    messages = check_messages(value.messages, "step") if value.messages else None
    reward = value.reward
    if reward is not None and (
        isinstance(reward, bool)
        or not isinstance(reward, int | float)
        or reward != reward
        or abs(reward) == float("inf")
    ):
        raise EnvError(f"step returned reward {reward!r:.40}, expected a finite number or None")
    return Feedback(messages, None if reward is None else float(reward), bool(value.done), int(value.tool_errors))
