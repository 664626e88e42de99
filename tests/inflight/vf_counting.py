"""A verifiers 0.4 environment written the way its docs show, for tests/inflight/test_verifiers_env.py: a taskset of a
few problems, rewards, and a harness that runs its multi-turn loop in-process (no container, no program to install).

The harness asks the model, answers with a tool-like message, three times. A task's `kind` makes it misbehave: its
setup raises or hangs, its reward raises, its harness raises or hangs, its harness's program exits 1 before its first
model call, or (`pause`) its harness waits after the first
turn until the test sets `GATE["go"]` (a commit in the middle of an episode).
"""

from __future__ import annotations

import asyncio

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult

TURNS = 3
GATE: dict[str, asyncio.Event] = {}  # "paused" set by the harness, "go" by the test


class CountData(vf.TaskData):
    answer: str
    kind: str = "behaves"


class CountTask(vf.Task[CountData]):
    async def setup(self, trace: vf.Trace, runtime) -> None:
        if self.data.kind == "task-raises":
            raise RuntimeError("the task's setup crashed")
        if self.data.kind == "task-hangs":
            await asyncio.Event().wait()  # never returns: the serve's --env-timeout-s ends the episode

    @vf.reward
    async def all_turns_taken(self, trace: vf.Trace) -> float:
        if self.data.kind == "reward-raises":
            raise RuntimeError("the reward crashed")
        return float(trace.num_turns == TURNS)

    @vf.reward(weight=0.5)
    async def replied(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages) > 0)


class CountConfig(vf.TasksetConfig):
    kinds: list[str] = ["behaves"]


class CountTaskset(vf.Taskset[CountTask, CountConfig]):
    def load(self) -> list[CountTask]:
        if "load-raises" in self.config.kinds:
            raise RuntimeError("the taskset crashed")
        return [
            CountTask(CountData(idx=i, prompt=f"Count to {i + 2}.", answer=str(i + 2), kind=kind), self.config.task)
            for i, kind in enumerate(self.config.kinds)
        ]


class ToolLoopConfig(vf.HarnessConfig):
    turns: int = TURNS


class ToolLoopHarness(vf.Harness[ToolLoopConfig]):
    """The model speaks, the harness answers as a tool would, `turns` times; every call goes through `endpoint`."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> ProgramResult:
        if data.kind == "harness-raises":
            raise RuntimeError("the harness crashed")
        if data.kind == "harness-exits":  # its program failed before the model's first turn, as a program does
            return ProgramResult(1, "", "Traceback (most recent call last):\n  File \"chat.py\", line 1\n"
                                        "RuntimeError: no tool renderer\n")  # fmt: skip
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        messages = [{"role": "user", "content": data.prompt}]
        try:
            for turn in range(1, self.config.turns + 1):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                text = reply.choices[0].message.content or ""
                if turn == self.config.turns:
                    break
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": f"tool output {turn}: {len(text)} chars"}]  # fmt: skip
                await _between_turns(data.kind)
        finally:
            await client.close()
        return ProgramResult(0, "", "")


async def _between_turns(kind: str) -> None:
    if kind == "harness-hangs":
        await asyncio.Event().wait()  # never returns: the serve's --env-timeout-s ends the episode
    if kind == "pause" and "go" in GATE:
        GATE["paused"].set()
        await GATE["go"].wait()


__all__ = ["CountTaskset", "ToolLoopHarness"]
