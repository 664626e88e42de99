"""The serve's admission gate (inflight/serve/driver.py:Admission) with groups that are dropped (an episode sampled
no token) or failed (the engine raised): such a group is never consumed by the learner, so it must neither count as
ahead of it nor hold a blocking-mode slot, or a run whose groups all fail would stop admitting for good. Pure: no
engine (the same on the real engine: tests/inflight/test_episodes.py)."""

from __future__ import annotations

from types import SimpleNamespace

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
