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


def test_a_record_without_a_policy_token_is_rejected_counted_and_never_reaches_a_step():
    from inflight.wire.rollouts import Sampling, Times, make_rollout

    def empty(index: int, roles: list[bool]):  # roles: True = an environment token
        n = len(roles)
        return make_rollout(
            prompt_ids=[1, 2], completion_ids=[7] * n, logprobs=[0.0] * n, versions=[-1] * n, kv_versions=[-1] * n,
            roles=roles, rollout_id=f"g-{index}", group_id="g", group_size=2, index=index, server_id="s",
            model="tiny-llama", reward=0.0, finish_reason="env_error", sampling=Sampling(1.0), times=Times(0, 0, 0),
        )  # fmt: skip

    buf = RolloutBuffer("tiny-llama", temperature=1.0)
    assert not buf.add(empty(0, [])) and not buf.add(empty(1, [True, True])), "no token, or environment tokens only"
    assert buf.add(rollout("g", 0)) and buf.take(1) is None, "its group never completes: nothing of it trains"
    assert buf.rejected == {"it has no policy token (its episode ended before the model's first turn): nothing to "
                            "train": 2}  # fmt: skip
    assert not buf.add(empty(1, []), replay=True), "nor when the journal replays it"
