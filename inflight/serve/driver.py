"""RolloutDriver: prompts → groups of n requests → reward → rollout records, continuously, under admission control.

Called by `inflight.serve.app`. A group is admitted only when all of these hold, re-checked whenever something finishes,
is sent, or the learner reports progress:
- requests generating + group_size <= max_inflight;
- outstanding rollouts (generating + finished but not yet handed to ZeroMQ) + group_size <= max_outstanding, so a
  learner that stops reading stops generation with bounded memory and nothing dropped;
- the learner gate: groups admitted − groups consumed < (max_lag + 1) × groups_per_step (max_lag −1 turns it off);
- in `blocking` mode (synchronous RL): at most groups_per_step groups per weight version, so the engine is idle when
  the next update arrives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from inflight.serve.config import ServeConfig
from inflight.serve.stream import RolloutStream
from inflight.tasks.base import Problem
from inflight.tasks.loading import AsyncReward
from inflight.wire.rollouts import Sampling, Times, encode_rollout, make_rollout

log = logging.getLogger("inflight.serve")


@dataclass
class DriverStats:
    groups_admitted: int = 0
    groups_finished: int = 0
    requests_inflight: int = 0  # admitted and not finished generating
    samples_open: int = 0  # admitted and not yet handed to the rollout stream (generating, waiting on a tool, scoring)
    reward_errors: int = 0
    rewards_sum: float = 0.0
    rollouts_made: int = 0


class RolloutDriver:
    def __init__(self, engine, cfg: ServeConfig, problems: Iterable[Problem], reward: AsyncReward,
                 stream: RolloutStream, tokenizer, tool_latency: Callable[[], float] | None = None):  # fmt: skip
        self.engine, self.cfg, self.reward, self.stream = engine, cfg, reward, stream
        self.tokenizer, self.tool_latency = tokenizer, tool_latency
        # One incarnation per process: a serve restarted under the same --server-id is a new stream to the learner,
        # so its group ids and consumed counts start afresh instead of colliding with those of its previous life.
        self.server_id = f"{cfg.resolved_server_id()}@{secrets.token_hex(4)}"
        self._problems = iter(problems)
        self.stats = DriverStats()
        self.groups_consumed = 0
        # None: waiting for the learner's first Progress (--wait-for-learner); then the version to have committed.
        self.required_version: int | None = None if cfg.wait_for_learner else cfg.version
        self._admitted_at = (0, 0)  # (engine version, groups admitted under it): blocking mode's gate
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.stopping = False

    def notify(self) -> None:
        """Something that admission depends on changed (a request finished, a record was sent, progress arrived)."""
        self._changed.set()

    def learner_published(self, version: int) -> None:
        """The learner's latest published version, from its first Progress: admission waits until it is committed."""
        if self.required_version is None:
            self.required_version = version
            if version > self.engine.version:
                log.info("the learner has published v%d; this serve has v%d: waiting for the update before admitting",
                         version, self.engine.version)  # fmt: skip
            self.notify()

    def set_consumed(self, groups_consumed: int) -> None:
        if groups_consumed > self.groups_consumed:
            self.groups_consumed = groups_consumed
            self.notify()

    @property
    def outstanding(self) -> int:
        return self.stats.samples_open + len(self.stream.outbox) + self.stream.retained_records

    def can_admit(self) -> bool:
        cfg, n = self.cfg, self.cfg.group_size
        if self.required_version is None or self.engine.version < self.required_version:
            return False
        if self.stopping or (cfg.max_groups and self.stats.groups_admitted >= cfg.max_groups):
            return False
        if self.stats.requests_inflight + n > cfg.max_inflight or self.outstanding + n > cfg.max_outstanding:
            return False
        if cfg.max_lag >= 0 and (self.stats.groups_admitted - self.groups_consumed
                                 >= (cfg.max_lag + 1) * cfg.groups_per_step):  # fmt: skip
            return False
        return not (
            cfg.mode == "blocking"
            and self._admitted_at[0] == self.engine.version
            and self._admitted_at[1] >= cfg.groups_per_step
        )

    async def run(self) -> None:
        """Admit groups for as long as the driver runs; each group is its own task."""
        for group_index in itertools.count():
            while not self.can_admit():
                self._changed.clear()
                await self._changed.wait()
            problem = next(self._problems)
            self.stats.groups_admitted += 1
            self.stats.requests_inflight += self.cfg.group_size  # counted now: the group's tasks start later
            self.stats.samples_open += self.cfg.group_size
            version = self.engine.version
            at, count = self._admitted_at
            self._admitted_at = (version, count + 1 if at == version else 1)
            task = asyncio.create_task(self._run_group(group_index, problem))
            self._tasks.add(task)
            task.add_done_callback(self._group_done)
            await asyncio.sleep(0)  # let the group submit its requests before admitting the next

    def _group_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("group failed: %r", task.exception())
        self.notify()

    async def wait_idle(self) -> None:
        """Until no group is generating (used by blocking mode before it accepts an update)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def _run_group(self, group_index: int, problem: Problem) -> None:
        group_id = f"{self.server_id}-g{group_index}"
        prompt_ids = self._prompt_ids(problem)
        await asyncio.gather(*(self._run_sample(group_id, i, problem, prompt_ids) for i in range(self.cfg.group_size)))
        self.stats.groups_finished += 1

    async def _run_sample(self, group_id: str, index: int, problem: Problem, prompt_ids: list[int]) -> None:
        try:
            await self._generate_and_send(group_id, index, problem, prompt_ids)
        finally:
            self.stats.samples_open -= 1
            self.notify()

    async def _generate_and_send(self, group_id: str, index: int, problem: Problem, prompt_ids: list[int]) -> None:
        from vllm import SamplingParams

        cfg = self.cfg
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                top_k=cfg.top_k, min_p=cfg.min_p, logprobs=0)  # fmt: skip
        submitted = time.time()
        try:
            done = await self.engine.generate(prompt_ids, params, f"{group_id}-{index}")
        finally:
            self.stats.requests_inflight -= 1
            self.notify()
        finished = time.time()
        if self.tool_latency is not None:
            await asyncio.sleep(self.tool_latency())
        score = await self._score(done.text, problem)
        record = make_rollout(
            prompt_ids=prompt_ids, completion_ids=done.token_ids, logprobs=done.logprobs, versions=done.versions,
            kv_versions=done.kv_versions,
            rollout_id=f"{group_id}-{index}", group_id=group_id, group_size=cfg.group_size, index=index,
            server_id=self.server_id, model=cfg.model, reward=score, finish_reason=done.finish_reason,
            sampling=Sampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_tokens, cfg.min_p),
            times=Times(submitted, done.first_token_time or finished, finished),
            problem_id=problem.id, resubmissions=done.resubmissions,
        )  # fmt: skip
        self.stats.rollouts_made += 1
        self.stats.rewards_sum += score
        self.stream.offer(encode_rollout(record), group_id)

    async def _score(self, text: str, problem: Problem) -> float:
        try:
            return await self.reward(text, problem)
        except Exception as exc:  # a buggy reward must not lose the sample: score 0, count, log
            self.stats.reward_errors += 1
            log.error("reward failed on %s (scored 0.0): %r", problem.id, exc)
            return 0.0

    def _prompt_ids(self, problem: Problem) -> list[int]:
        messages = [{"role": "user", "content": problem.question}]
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))  # fmt: skip

    async def stop(self) -> None:
        """Stop admitting; cancel generating groups (their partial samples are not rollouts)."""
        self.stopping = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
