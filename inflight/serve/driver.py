"""RolloutDriver: prompts → groups of n requests → reward → rollout records, continuously, under admission control.

Called by `inflight.serve.app`. A group is admitted only when all of these hold, re-checked whenever something finishes,
is sent, or the learner reports progress:
- requests generating + group_size <= max_inflight;
- outstanding rollouts (generating + finished but not yet handed to ZeroMQ) + group_size <= max_outstanding, so a
  learner that stops reading stops generation with bounded memory and nothing dropped;
- the learner gate (the serve's admission window): groups admitted − groups consumed < (admit_lag + 1) ×
  groups_per_step (admit_lag −1 turns it off);
- in `blocking` mode (synchronous RL): at most groups_per_step groups per weight version, so the engine is idle when
  the next update arrives.

`Admission` holds that gate's state; `RolloutDriver` admits groups through it, runs their episodes, scores them and
hands their records to the stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm import SamplingParams

from inflight.envs.base import Environment
from inflight.envs.loading import load_env
from inflight.envs.verifiers_env import VerifiersEnv
from inflight.serve.config import ServeConfig
from inflight.serve.episodes import Episode, EpisodeRunner, RunnerContext, VersionedEngine
from inflight.serve.verifiers_runner import VerifiersRunner
from inflight.tasks.base import Problem
from inflight.tasks.rewards import ConstantRewardWatch, GroupScores, Reward, RewardMeans, score_group
from inflight.wire.rollouts import Rollout, RolloutStream, Routes, Sampling, Times, encode_rollout, make_rollout

if TYPE_CHECKING:  # transformers is imported once a serve really starts (inflight/serve/app.py)
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("inflight.serve")
# Groups failed one after another with no rollout made between them (`failed`): admission stops there and the serve
# exits 1 naming the last error (inflight/serve/app.py), instead of admitting and failing groups as fast as they fail.
FAILED_IN_A_ROW_LIMIT = 16


@dataclass
class DriverStats:
    groups_admitted: int = 0
    groups_finished: int = 0  # scored and handed to the stream, or dropped
    groups_dropped: int = 0  # dropped for an episode with no sampled token (`dropped`): never sent, never trained
    groups_failed: int = 0  # ended by an error of the engine or the serve's own code (`failed`): never sent either
    last_failure: str = ""  # the latest of those errors, "Type: message", for the progress line
    failed_in_a_row: int = 0  # groups failed since the last rollout was made (FAILED_IN_A_ROW_LIMIT)
    requests_inflight: int = 0  # admitted and not finished generating
    samples_open: int = 0  # admitted and not yet handed to the rollout stream (generating, waiting on a tool, scoring)
    reward_errors: int = 0  # reward calls that failed (their samples scored 0.0): inflight/tasks/rewards.py
    rewards_sum: float = 0.0
    rollouts_made: int = 0
    reward_means: RewardMeans = field(default_factory=RewardMeans)  # each reward's own mean, over every sample
    # Episodes (inflight/serve/episodes.py), over every rollout made: policy turns, seconds inside environment calls,
    # episodes an environment ended by failing (scored 0), malformed tool calls the environment reported, and the
    # completion tokens by role.
    turns: int = 0
    env_s: float = 0.0
    env_errors: int = 0
    tool_errors: int = 0
    env_tokens: int = 0
    policy_tokens: int = 0
    # environment errors by kind (`Episode.env_error_kind`: "timeout before the first model call", "harness exited 1",
    # ...), over every episode, dropped ones included; and the episodes that ended with no sampled token
    env_error_kinds: Counter[str] = field(default_factory=Counter)
    untrained_episodes: int = 0

    def count(self, ep: Episode) -> None:
        """One finished episode made into a rollout."""
        self.rollouts_made += 1
        self.failed_in_a_row = 0
        self.turns += ep.turns
        self.env_s += ep.env_s
        self.tool_errors += ep.tool_errors
        self.env_tokens += sum(ep.env)
        self.policy_tokens += len(ep.env) - sum(ep.env)

    def count_errors(self, episodes: list[Episode]) -> None:
        """A finished group's environment errors, by kind (its episodes sent or not)."""
        for ep in episodes:
            if ep.env_error:
                self.env_errors += 1
                self.env_error_kinds[ep.env_error_kind or "other"] += 1


class Admission:
    """The gate's state: the version the learner requires, the groups it consumed, the groups admitted per version.
    `can_admit` is re-asked whenever the driver is notified; every other check reads the config or the driver's
    counts."""

    def __init__(self, cfg: ServeConfig, engine: VersionedEngine, stats: DriverStats):
        self.cfg, self.engine, self.stats = cfg, engine, stats
        self.groups_consumed = 0
        # None: waiting for the learner's first Progress (--wait-for-learner); then the version to have committed.
        self.required_version: int | None = None if cfg.wait_for_learner else cfg.version
        self._version_admitted = 0  # the engine version the last group was admitted under: blocking mode's gate
        self._admitted_under_it = 0  # how many groups were admitted under it

    def can_admit(self, outstanding: int, stopping: bool) -> bool:
        cfg, n = self.cfg, self.cfg.group_size
        if self.required_version is None or self.engine.version < self.required_version:
            return False
        if stopping or (cfg.max_groups and self.stats.groups_admitted >= cfg.max_groups):
            return False
        if self.stats.failed_in_a_row >= FAILED_IN_A_ROW_LIMIT:  # the serve is stopping with the error (app.py)
            return False
        if self.stats.requests_inflight + n > cfg.max_inflight or outstanding + n > cfg.max_outstanding:
            return False
        never_sent = self.stats.groups_dropped + self.stats.groups_failed  # so never consumed: not ahead of it
        ahead = self.stats.groups_admitted - never_sent - self.groups_consumed
        if cfg.admit_lag >= 0 and ahead >= (cfg.admit_lag + 1) * cfg.groups_per_step:
            return False
        return not (
            cfg.mode == "blocking"
            and self._version_admitted == self.engine.version
            and self._admitted_under_it >= cfg.groups_per_step
        )

    def dropped(self) -> None:
        """A group admitted under the current version was dropped or failed: blocking mode admits another in its
        place (the learner will not train on it, so no update would ever free its slot)."""
        if self._version_admitted == self.engine.version:
            self._admitted_under_it = max(0, self._admitted_under_it - 1)

    def admitted(self) -> None:
        """A group was admitted now: counted against the engine's current version."""
        version = self.engine.version
        same = self._version_admitted == version
        self._version_admitted, self._admitted_under_it = version, self._admitted_under_it + 1 if same else 1


class RolloutDriver:
    def __init__(
        self,
        engine: VersionedEngine,
        cfg: ServeConfig,
        problems: Iterable[Problem],
        rewards: list[Reward],
        stream: RolloutStream,
        tokenizer: PreTrainedTokenizerBase,
        tool_latency: Callable[[], float] | None = None,
        env: Environment | None = None,
    ):
        """`env`: the environment episodes run in (inflight/envs/); None = `--env` as `cfg` names it."""
        self.engine, self.cfg, self.rewards, self.stream = engine, cfg, rewards, stream
        self.constant_watch = ConstantRewardWatch(cfg.groups_per_step, cfg.reward_constant_steps)
        self.evaluation = None  # an inflight/serve/eval.py:Evaluation when --eval-task is given
        self.tokenizer, self.tool_latency = tokenizer, tool_latency
        # One incarnation per process: a serve restarted under the same --server-id is a new stream to the learner,
        # so its group ids and consumed counts start afresh instead of colliding with those of its previous life.
        self.server_id = f"{cfg.resolved_server_id()}@{secrets.token_hex(4)}"
        self.stats = DriverStats()
        self.env = env if env is not None else load_env(cfg.env, cfg.env_args)
        runner = EpisodeRunner
        if isinstance(self.env, VerifiersEnv):  # its own taskset and rewards (--reward adds to them)
            problems, self.rewards, runner = self.env.problems(), rewards if cfg.reward else [], VerifiersRunner
        self._problems = iter(problems)
        context = RunnerContext(
            engine.generation, tokenizer, cfg, self.stats, self.notify, self._sampling, tool_latency
        )
        self.episodes = runner(self.env, context)
        self.admission = Admission(cfg, engine, self.stats)
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.stopping = False

    def notify(self) -> None:
        """Something that admission depends on changed (a request finished, a record was sent, progress arrived)."""
        self._changed.set()

    @property
    def groups_consumed(self) -> int:
        return self.admission.groups_consumed

    def learner_published(self, version: int) -> None:
        """The learner's latest published version, from its first Progress: admission waits until it is committed."""
        if self.admission.required_version is None:
            self.admission.required_version = version
            if version > self.engine.version:
                log.info(
                    "the learner has published v%d; this serve has v%d: waiting for the update before admitting",
                    version,
                    self.engine.version,
                )
            self.notify()

    def set_consumed(self, groups_consumed: int) -> None:
        if groups_consumed > self.admission.groups_consumed:
            self.admission.groups_consumed = groups_consumed
            self.notify()

    @property
    def outstanding(self) -> int:
        return self.stats.samples_open + len(self.stream.outbox) + self.stream.retained_records

    def can_admit(self) -> bool:
        return self.admission.can_admit(self.outstanding, self.stopping)

    async def run(self) -> None:
        """Admit groups for as long as the driver runs; each group is its own task."""
        for group_index in itertools.count():
            while True:
                if self.evaluation is not None and self.evaluation.due():
                    await self.evaluation.run()  # between groups: admission waits, generating groups go on
                if self.can_admit():
                    break
                self._changed.clear()
                await self._changed.wait()
            problem = next(self._problems)
            self.stats.groups_admitted += 1
            self.stats.requests_inflight += self.cfg.group_size  # counted now: the group's tasks start later
            self.stats.samples_open += self.cfg.group_size
            self.admission.admitted()
            task = asyncio.create_task(self._run_group(group_index, problem))
            self._tasks.add(task)
            task.add_done_callback(self._group_done)
            await asyncio.sleep(0)  # let the group submit its requests before admitting the next

    def _group_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)  # a group's failure was counted by the group itself (`failed`)
        self.notify()

    async def wait_idle(self) -> None:
        """Until no group is generating (used by blocking mode before it accepts an update)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def _run_group(self, group_index: int, problem: Problem) -> None:
        """Run the group's episodes, score it (every reward once per group: TRL's convention needs all completions),
        then hand its records to the stream."""
        group_id = f"{self.server_id}-g{group_index}"
        n = self.cfg.group_size
        try:
            episodes = await asyncio.gather(*(self.episodes.run(problem, f"{group_id}-{i}") for i in range(n)))
            if dropped(self.stats, group_id, episodes, self.admission):
                return
            texts, ids = [e.text for e in episodes], [e.last_ids for e in episodes]
            self._account(scores := await score_group(self.rewards, problem, texts, ids))
            for index, ep in enumerate(episodes):
                # an episode an environment failure ended scores 0, whatever its last turn said
                reward = 0.0 if ep.env_error else scores.total[index] + ep.env_reward
                self.stats.count(ep)
                self.stats.rewards_sum += reward
                record = rollout_record(self.cfg, self.server_id, group_id, index, problem, ep, reward)
                self.stream.offer(encode_rollout(record), group_id)
            self.stats.groups_finished += 1
        except Exception as exc:  # noqa: BLE001 - counted, logged and shown; the serve goes on with other groups
            failed(self.stats, group_id, exc, self.admission)
        finally:
            self.stats.samples_open -= n
            self.notify()

    def _sampling(self, max_tokens: int) -> SamplingParams:
        """One turn's SamplingParams: the serve's sampler, the environment's stop strings (kept in the text)."""
        cfg = self.cfg
        stop = list(getattr(self.env, "stop", ()))
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,  # 0 = off, here as on the learner and in the contract
            min_p=cfg.min_p,
            logprobs=0,
            stop=stop or None,
            include_stop_str_in_output=bool(stop),
        )

    def _account(self, scores: GroupScores) -> None:
        """Per-reward means and failures for the progress lines; the constant-reward warning."""
        self.stats.reward_errors += scores.errors
        self.stats.reward_means.add(scores)
        for warning in self.constant_watch.add(scores):
            log.warning(warning)

    async def stop(self) -> None:
        """Stop admitting; cancel generating groups (their partial samples are not rollouts)."""
        self.stopping = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def dropped(stats: DriverStats, group_id: str, episodes: list[Episode], admission: Admission) -> bool:
    """The group's environment errors counted; True, counted and logged, when an episode of the group ended with no
    sampled token (its environment failed before the model's first turn): such a record has nothing to train, and the
    learner trains whole groups of the agreed size (inflight/wire/contract.py), so the group is dropped, not sent
    short."""
    stats.count_errors(episodes)
    empty = [i for i, ep in enumerate(episodes) if all(ep.env)]  # no token, or environment tokens only
    if not empty:
        return False
    stats.groups_dropped += 1
    stats.groups_finished += 1
    admission.dropped()
    stats.untrained_episodes += len(empty)
    why = "; ".join(sorted({episodes[i].env_error or "no error recorded" for i in empty}))
    what = f"{len(empty)} of its {len(episodes)} episodes ended with no sampled token (nothing to train)"
    log.warning("group %s dropped: %s: %s", group_id, what, why)
    return True


def failed(stats: DriverStats, group_id: str, exc: Exception, admission: Admission) -> None:
    """A group ended by an error that is not its environment's (`EpisodeRunner.run` re-raises the engine's): counted,
    logged with its traceback and shown on the progress line. Like a dropped group it is never sent, so it frees its
    admission slot: a serve whose every group fails keeps saying why instead of idling at 0 tok/s."""
    stats.groups_failed += 1
    stats.failed_in_a_row += 1
    stats.groups_finished += 1
    stats.last_failure = f"{type(exc).__name__}: {exc}"
    admission.dropped()
    log.error("group %s failed (never sent): %s", group_id, stats.last_failure, exc_info=exc)


def prompt_token_ids(tokenizer, problem: Problem) -> list[int]:
    """The chat template applied to the problem's messages (system prompt included), ready for generation."""
    return list(
        tokenizer.apply_chat_template(problem.chat(), add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def rollout_record(
    cfg: ServeConfig, server_id: str, group_id: str, index: int, problem: Problem, ep: Episode, reward: float
) -> Rollout:
    """The rollout of the group's `index`-th episode, finished and scored."""
    return make_rollout(
        prompt_ids=ep.prompt_ids,
        completion_ids=ep.token_ids,
        logprobs=ep.logprobs,
        versions=ep.versions,
        kv_versions=ep.kv_versions,
        roles=ep.env,
        rollout_id=f"{group_id}-{index}",
        group_id=group_id,
        group_size=cfg.group_size,
        index=index,
        server_id=server_id,
        model=cfg.model,
        reward=reward,
        finish_reason=ep.finish_reason,
        sampling=Sampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_tokens, cfg.min_p),
        times=Times(ep.submitted, ep.first_token or ep.finished, ep.finished),
        problem_id=problem.id,
        resubmissions=ep.resubmissions,
        turns=ep.turns,
        routes=None if ep.routes is None else Routes(ep.routes.ids, ep.routes.layers, ep.routes.top_k, ep.routes.dtype),
    )
