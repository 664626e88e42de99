"""RolloutBuffer: whole groups in arrival order; duplicates, replays, other models and temperatures refused, counted."""

from __future__ import annotations

from test_rollouts_helpers import rollout

from inflight.learn.store import RolloutBuffer


def test_groups_complete_in_order_and_are_consumed_once():
    buf = RolloutBuffer("/models/tiny-llama", temperature=1.0)
    for g in ("a", "b"):
        for i in range(2):
            buf.add(rollout(g, i))
    buf.add(rollout("a", 0))  # duplicate sample
    assert [grp[0].group_id for grp in buf.take(2)] == ["a", "b"] and buf.take(1) is None
    buf.add(rollout("a", 1))  # replay of a trained group
    buf.add(rollout("c", 0, model="other"))
    buf.add(rollout("c", 0, temperature=0.7))
    reasons = " | ".join(buf.rejected)
    assert sum(buf.rejected.values()) == 4
    assert "duplicate" in reasons and "already trained" in reasons and "other" in reasons and "--temperature" in reasons
    assert "a" in buf.consumed and "b" in buf.consumed and "c" not in buf.consumed
    assert buf.consumed_by_server["s"] == 2 and not buf.completed  # trained groups leave `completed`
