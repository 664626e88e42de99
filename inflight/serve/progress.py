"""Serve's progress: one line to stderr and one JSON line to `--metrics` every `--progress-s` seconds, plus an event
line per weight update and per held-out eval. The JSONL is what `inflight.run` plots (generation tokens/s over time
with update markers); its lines are the records `ServeProgress`, `UpdateEvent` and `EvalResult` of
inflight/wire/records.py, which the readers decode."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from inflight.wire.records import EvalResult, ServeProgress, UpdateEvent, encode_line

if TYPE_CHECKING:  # the driver imports vLLM
    from inflight.serve.driver import RolloutDriver


# A learner that has not answered in this long is not loading a model: the progress line says what to check.
UNHEARD_HINT_S = 30.0


class ProgressReporter:
    def __init__(self, driver: RolloutDriver, metrics_path: str, interval_s: float, control=None):
        self.driver, self.interval_s, self.control = driver, interval_s, control
        self.path = Path(metrics_path) if metrics_path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last = (time.monotonic(), 0)

    def write(self, record: msgspec.Struct) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(encode_line(record))

    def snapshot(self) -> ServeProgress:
        d, now = self.driver, time.monotonic()
        last_t, last_tokens = self._last
        self._last = (now, d.engine.tokens_generated)
        made = max(d.stats.rollouts_made, 1)
        return ServeProgress(
            time=time.time(),
            server_id=d.server_id,
            version=d.engine.version,
            tokens_per_s=(d.engine.tokens_generated - last_tokens) / max(now - last_t, 1e-9),
            tokens=d.engine.tokens_generated,
            inflight=d.stats.requests_inflight,
            outbox=len(d.stream.outbox),
            retained=d.stream.retained_records,
            resent=d.stream.resent,
            rollouts_sent=d.stream.sent,
            groups_admitted=d.stats.groups_admitted,
            groups_consumed=d.groups_consumed,
            mean_reward=d.stats.rewards_sum / made,
            reward_errors=d.stats.reward_errors,
            idle_s=d.engine.idle_s,
            stalled_s=d.engine.stalled_s,
            resubmitted=d.engine.resubmitted,
            recomputed_tokens=d.engine.recomputed_tokens,
            reward_means=d.stats.reward_means.means(),
            turns=d.stats.turns,
            env_s=d.stats.env_s,
            env_errors=d.stats.env_errors,
            tool_errors=d.stats.tool_errors,
            env_tokens=d.stats.env_tokens,
            policy_tokens=d.stats.policy_tokens,
            rollouts_made=d.stats.rollouts_made,
            env_error_kinds=dict(d.stats.env_error_kinds),
            groups_dropped=d.stats.groups_dropped,
            untrained_episodes=d.stats.untrained_episodes,
            groups_failed=d.stats.groups_failed,
            last_failure=d.stats.last_failure,
            updates_refused=d.engine.updates_refused,
        )

    def update_event(self, done) -> None:
        self.write(
            UpdateEvent(
                time=time.time(),
                server_id=self.driver.server_id,
                version=done.version,
                ok=done.ok,
                error=done.error,
                stall_s=done.stall_s,
                total_s=done.total_s,
                receive_s=done.receive_s,
                commit_s=done.commit_s,
                bytes_kept=done.bytes_kept,
                full_tensors=done.full_tensors,
            )
        )

    def eval_result(self, result: EvalResult) -> None:
        """An eval finished: its record into the metrics file and one line on stderr."""
        self.write(result)
        print(
            f"[serve {result.server_id}] eval v{result.version} | {result.task} | n {result.n} | reward "
            f"{result.mean_reward:.3f}{_each(result.reward_means)} | accuracy {result.accuracy:.3f} | "
            f"{result.eval_s:.1f}s",
            file=sys.stderr,
            flush=True,
        )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            s = self.snapshot()
            self.write(s)
            line = (
                f"[serve {s.server_id}] v{s.version} | {s.tokens_per_s:.1f} tok/s | inflight {s.inflight}"
                f" | outbox {s.outbox} | sent {s.rollouts_sent} | groups {s.groups_admitted}"
                f" (consumed {s.groups_consumed}) | reward {s.mean_reward:.3f}{_each(s.reward_means)}"
                f"{f' | reward errors {s.reward_errors}' if s.reward_errors else ''}{_episodes(s)}{_failed(s)}"
                f"{_unheard(self.control)}"
            )
            print(line, file=sys.stderr, flush=True)


def _each(means: dict[str, float]) -> str:
    """Per-reward means after the combined one, when there are several rewards: " (format 1.000, answer 0.250)"."""
    return f" ({', '.join(f'{k} {v:.3f}' for k, v in means.items())})" if len(means) > 1 else ""


def _episodes(s: ServeProgress) -> str:
    """ " | turns 2.4/episode | env tokens 31% | env errors 1 (...) | tool errors 3" once any episode took a second
    turn; then " | dropped 2 groups (3 episodes with no sampled token)" once a group was dropped."""
    errors = f" | env errors {s.env_errors}{_kinds(s.env_error_kinds)}" if s.env_errors else ""
    dropped = (
        f" | dropped {s.groups_dropped} groups ({s.untrained_episodes} episodes with no sampled token)"
        if s.groups_dropped
        else ""
    )
    if s.turns <= s.rollouts_made:
        return errors + dropped
    share = s.env_tokens / max(s.env_tokens + s.policy_tokens, 1)
    per_episode = s.turns / max(s.rollouts_made, 1)
    return (
        f" | turns {per_episode:.2f}/episode | env tokens {share:.0%}{errors or ' | env errors 0'}"
        f" | tool errors {s.tool_errors}{dropped}"
    )


def _failed(s: ServeProgress) -> str:
    """ " | failed 4 groups (last: VersionSpanError: ...)" once the engine or the serve failed a group."""
    return f" | failed {s.groups_failed} groups (last: {s.last_failure[:200]})" if s.groups_failed else ""


def _kinds(kinds: dict[str, int]) -> str:
    """ " (timeout before the first model call 3, harness bash exited 1 2)", most frequent first."""
    ranked = sorted(kinds.items(), key=lambda kv: -kv[1])
    return f" ({', '.join(f'{k} {n}' for k, n in ranked)})" if ranked else ""


def _unheard(control) -> str:
    """ " | no word from the learner at ADDRESS in 45 s: ..." while the learner never answered: a learner that is not
    running, or one whose secret differs from this serve's (CURVE drops every handshake without a word)."""
    waited = 0.0 if control is None or control.heard else time.monotonic() - control.started
    if waited < UNHEARD_HINT_S:
        return ""
    return (
        f" | no word from the learner at {control.address} in {waited:.0f} s: is it running there, with the same "
        "--secret-file or --socket-secret-file as this serve (or neither)?"
    )
