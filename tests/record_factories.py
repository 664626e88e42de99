"""Metrics records (inflight/wire/records.py) for tests that write a run directory by hand: every required field gets
a plausible value, and a test names only the fields its figures use."""

from __future__ import annotations

from pathlib import Path

import msgspec

from inflight.wire.records import EvalResult, ServeProgress, StepMetrics, UpdateEvent, encode_line


def a_step(step: int = 1, **changes) -> StepMetrics:
    values = dict(step=step, version=step, time=100.0 + step, reward=0.5, lag_histogram={0: 6, 1: 4},
                  groups=[f"s-g{step}"], lengths=[5, 5], tokens=10.0, gated_fraction=0.0, wait_s=1.0, step_s=2.0,
                  tokens_per_s=10.0, rejected={}, loss=0.1, grad_norm=0.5, normalizer=10.0, clip_fraction=0.0,
                  ess=0.9, mean_abs_logratio=0.01, train_s=1.0, train_tokens=10, mismatch_lag0=0.01)  # fmt: skip
    return StepMetrics(**(values | changes))


def a_progress(**changes) -> ServeProgress:
    values = dict(time=100.0, server_id="s", version=0, tokens_per_s=0.0, tokens=0, inflight=0, outbox=0, retained=0,
                  resent=0, rollouts_sent=0, groups_admitted=0, groups_consumed=0, mean_reward=0.0, reward_errors=0,
                  idle_s=0.0, stalled_s=0.0, resubmitted=0, recomputed_tokens=0)  # fmt: skip
    return ServeProgress(**(values | changes))


def an_update(**changes) -> UpdateEvent:
    values = dict(time=105.0, server_id="s", version=1, ok=True, error="", stall_s=0.02, total_s=0.5, receive_s=0.3,
                  commit_s=0.02)  # fmt: skip
    return UpdateEvent(**(values | changes))


def an_eval(**changes) -> EvalResult:
    values = dict(time=120.0, server_id="s", version=2, versions=[2], task="jsonl:test.jsonl", n=4, mean_reward=0.5,
                  accuracy=0.5)  # fmt: skip
    return EvalResult(**(values | changes))


def write_lines(path: Path, records: list[msgspec.Struct]) -> Path:
    """`records` as their writers write them, one JSON line each."""
    path.write_text("".join(encode_line(r) for r in records))
    return path
