"""A verifiers 0.4 environment as its overview says is often enough: a `vf.Taskset` of tasks with a prompt and an
answer and one `@vf.reward`, no harness of its own (verifiers then picks its default, `bash`; `null` by --env-args).
For tests/inflight/test_verifiers_env.py and test_run.py. The reward is the reply's length, capped, so a random tiny
model's groups differ in reward."""

from __future__ import annotations

import verifiers.v1 as vf


class ReplyData(vf.TaskData):
    answer: str


class ReplyTask(vf.Task[ReplyData]):
    @vf.reward
    async def replied(self, trace: vf.Trace) -> float:
        text = "".join(str(m.content or "") for m in trace.assistant_messages)
        return min(len(text), 40) / 40


class ReplyTaskset(vf.Taskset[ReplyTask, vf.TasksetConfig]):
    def load(self) -> list[ReplyTask]:
        return [ReplyTask(ReplyData(idx=i, prompt=f"What is {i} + {i}?", answer=str(2 * i)), self.config.task)
                for i in range(8)]  # fmt: skip


__all__ = ["ReplyTaskset"]
