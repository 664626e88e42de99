"""Held-out eval between groups: every `--eval-every` learner versions the serve scores `--eval-task` at the version
it serves, and writes one `EvalResult` (inflight/wire/records.py) to its metrics file.

Called by the rollout driver (`inflight/serve/driver.py:RolloutDriver.run`), before it admits the next group, once the
engine's version reached the next multiple of `--eval-every`; training groups already generating go on meanwhile.
An eval is valid only if every token it scored carries one version: each completion's per-token versions
(`Completion.versions`) are checked, and an eval that an update committed into is thrown away and run again at the new
version. Greedy by default (`--eval-temperature 0`); one completion per problem; the same rewards as training.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from itertools import islice
from typing import TYPE_CHECKING

from inflight.serve.config import ServeConfig
from inflight.serve.episodes import VersionedEngine
from inflight.tasks.base import Problem
from inflight.tasks.rewards import Reward, RewardMeans, score_group
from inflight.wire.records import EvalResult

if TYPE_CHECKING:  # transformers is imported once a serve really starts
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("inflight.serve")
MAX_ATTEMPTS = 3  # an update committing into every attempt means updates come faster than an eval: skip this one


def load_eval_problems(cfg: ServeConfig) -> list[Problem]:
    """The first `--eval-problems` problems of `--eval-task`, in the table's order (same keys as `--task`)."""
    from inflight.tasks.loading import load_task

    # arithmetic: another seed than training's, so the problems are held out
    task, _ = load_task(
        cfg.eval_task,
        cfg.task_seed + 1000,
        cfg.max_operand,
        cfg.prompt_key,
        cfg.answer_key,
        cfg.system_prompt,
        shuffle=False,
        terms=cfg.arithmetic_terms,
        ops=cfg.arithmetic_ops,
        task_args=cfg.task_args,
    )
    table = getattr(task, "problems", None)  # a table: its rows once, not cycled
    return list(table[: cfg.eval_problems]) if table is not None else list(islice(task, cfg.eval_problems))


class Evaluation:
    """Knows when the next eval is due and runs it; `on_result` receives each `EvalResult`."""

    def __init__(
        self,
        engine: VersionedEngine,
        cfg: ServeConfig,
        problems: list[Problem],
        rewards: list[Reward],
        tokenizer: PreTrainedTokenizerBase,
        server_id: str,
        on_result: Callable[[EvalResult], None],
    ):
        self.engine, self.cfg, self.problems, self.rewards = engine, cfg, problems, rewards
        self.tokenizer, self.server_id, self.on_result = tokenizer, server_id, on_result
        self.next_version = cfg.eval_every  # versions 0..every-1 are the base model's and its first steps
        self.results: list[EvalResult] = []

    def due(self) -> bool:
        return self.engine.version >= self.next_version

    async def run(self) -> EvalResult | None:
        """Score the held-out problems at the served version; None if updates kept committing into it."""
        for _ in range(MAX_ATTEMPTS):
            version = self.engine.version
            result = await self._attempt(version)
            if result is not None:
                self._advance(version)
                self.results.append(result)
                self.on_result(result)
                return result
            log.warning(
                "eval at v%d: an update committed while it ran (v%d now); scoring again at v%d",
                version,
                self.engine.version,
                self.engine.version,
            )
        self._advance(self.engine.version)
        log.warning("eval skipped: updates committed during %d attempts in a row", MAX_ATTEMPTS)
        return None

    def _advance(self, version: int) -> None:
        every = self.cfg.eval_every
        self.next_version = (version // every + 1) * every

    async def _attempt(self, version: int) -> EvalResult | None:
        from vllm import SamplingParams

        from inflight.serve.driver import prompt_token_ids

        started = time.monotonic()
        params = SamplingParams(max_tokens=self.cfg.max_tokens, temperature=self.cfg.eval_temperature)
        done = await asyncio.gather(
            *(
                self.engine.generation.generate(
                    prompt_token_ids(self.tokenizer, p), params, f"eval-v{version}-{k}-{time.time_ns()}"
                )
                for k, p in enumerate(self.problems)
            )
        )
        seen = sorted({v for d in done for v in d.versions})
        if seen and seen != [version]:
            return None
        return await self._score(version, seen or [version], done, time.monotonic() - started)

    async def _score(self, version: int, seen: list[int], done, elapsed_s: float) -> EvalResult:
        means, totals, errors = RewardMeans(), [], 0
        for problem, completion in zip(self.problems, done, strict=True):
            scores = await score_group(self.rewards, problem, [completion.text], [completion.token_ids])
            means.add(scores)
            totals += scores.total
            errors += scores.errors
        n = max(len(totals), 1)
        return EvalResult(
            time=time.time(),
            server_id=self.server_id,
            version=version,
            versions=seen,
            task=self.cfg.eval_task,
            n=len(totals),
            mean_reward=sum(totals) / n,
            accuracy=sum(t > 0 for t in totals) / n,
            reward_means=means.means(),
            temperature=self.cfg.eval_temperature,
            reward_errors=errors,
            eval_s=elapsed_s,
        )
