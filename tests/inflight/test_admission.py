"""The serve's admission gate (inflight/serve/driver.py:Admission) with groups that are dropped (an episode sampled
no token) or failed (the engine raised): such a group is never consumed by the learner, so it must neither count as
ahead of it nor hold a blocking-mode slot, or a run whose groups all fail would stop admitting for good. Pure: no
engine (the same on the real engine: tests/inflight/test_episodes.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from inflight.serve.config import ServeConfig
from inflight.serve.driver import Admission, DriverStats, dropped, failed
from inflight.serve.episodes import Episode


def test_a_dropped_group_frees_its_admission_slot_in_both_modes_and_is_counted():
    for mode in ("never-stop", "blocking"):
        cfg = ServeConfig(mode=mode, group_size=2, groups_per_step=1, admit_lag=0, wait_for_learner=False)
        stats, engine = DriverStats(), SimpleNamespace(version=0)
        gate = Admission(cfg, engine, stats)
        assert gate.can_admit(0, False)
        stats.groups_admitted += 1
        gate.admitted()
        assert not gate.can_admit(0, False), mode  # one group ahead of the learner / one per version
        kind = "RuntimeError before the first model call"
        failed = Episode(env_error="RuntimeError: no such task", env_error_kind=kind)
        assert dropped(stats, "g0", [failed, Episode(token_ids=[5], env=[False])], gate)
        assert gate.can_admit(0, False), f"{mode}: the dropped group no longer holds its slot"
        assert (stats.groups_dropped, stats.untrained_episodes, stats.groups_finished) == (1, 1, 1)
        assert stats.env_error_kinds == {kind: 1}
        assert not dropped(stats, "g1", [Episode(token_ids=[5], env=[False])], gate), "a group with tokens is sent"


def test_a_failed_group_frees_its_admission_slot_in_both_modes_and_is_counted_with_its_error():
    for mode in ("never-stop", "blocking"):
        cfg = ServeConfig(mode=mode, group_size=2, groups_per_step=1, admit_lag=0, wait_for_learner=False)
        stats, engine = DriverStats(), SimpleNamespace(version=0)
        gate = Admission(cfg, engine, stats)
        stats.groups_admitted += 1
        gate.admitted()
        assert not gate.can_admit(0, False), mode
        failed(stats, "g0", ValueError("token id 10**9 is out of vocabulary"), gate)
        assert gate.can_admit(0, False), f"{mode}: the failed group no longer holds its slot"
        assert (stats.groups_failed, stats.groups_finished, stats.groups_dropped) == (1, 1, 0)
        assert stats.last_failure == "ValueError: token id 10**9 is out of vocabulary"


def test_groups_failing_one_after_another_stop_admission_at_the_limit_and_end_the_serve_naming_the_error():
    from inflight.serve.app import _healthy
    from inflight.serve.driver import FAILED_IN_A_ROW_LIMIT

    cfg = ServeConfig(group_size=2, admit_lag=-1, wait_for_learner=False)
    stats, engine = DriverStats(), SimpleNamespace(version=0, dead=False)
    gate = Admission(cfg, engine, stats)
    for i in range(FAILED_IN_A_ROW_LIMIT - 1):
        failed(stats, f"g{i}", RuntimeError("no KV cache block left"), gate)
    stats.count(Episode(token_ids=[5], env=[False]))  # a rollout made: the failures are no longer in a row
    for i in range(FAILED_IN_A_ROW_LIMIT - 1):
        failed(stats, f"h{i}", RuntimeError("no KV cache block left"), gate)
    assert gate.can_admit(0, False), "one short of the limit since the last rollout"
    failed(stats, "last", RuntimeError("no KV cache block left"), gate)
    assert not gate.can_admit(0, False), "the limit reached: nothing more is admitted"
    driver = SimpleNamespace(engine=engine, stats=stats)
    error = f"the last {FAILED_IN_A_ROW_LIMIT} groups all failed, the last with RuntimeError: no KV cache block left"
    with pytest.raises(RuntimeError, match=error):
        asyncio.run(_healthy(driver, every_s=0.01))
    dead = SimpleNamespace(engine=SimpleNamespace(dead=True), stats=DriverStats())
    with pytest.raises(RuntimeError, match="vLLM's EngineCore died"):
        asyncio.run(_healthy(dead, every_s=0.01))
