"""RolloutJournal on disk and RolloutBuffer replay semantics (the real-process kill -9 test is in test_faults.py)."""

from __future__ import annotations

from inflight.learn.store import RolloutBuffer, RolloutJournal
from inflight.wire.rollouts import Sampling, Times, decode_rollout, encode_rollout, make_rollout


def record(group: str, index: int, size: int = 2) -> bytes:
    return encode_rollout(make_rollout(
        prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[-0.5, -0.25], versions=[0, 0],
        rollout_id=f"{group}-{index}", group_id=group, group_size=size, index=index, server_id="s", model="m",
        reward=float(index), finish_reason="stop", sampling=Sampling(1.0), times=Times(0.0, 0.0, 0.0)))  # fmt: skip


def test_appended_records_replay_in_order_across_reopen_and_a_torn_tail_is_ignored(tmp_path):
    journal = RolloutJournal(tmp_path)
    journal.append([record("g1", 0), record("g1", 1)])
    journal.append([record("g2", 0)])
    journal.close()
    segment = journal.segments()[-1]
    segment.write_bytes(segment.read_bytes() + b"\x40\x00\x00\x00partial")  # a record cut by a kill
    reopened = RolloutJournal(tmp_path)
    assert [decode_rollout(r).rollout_id for r in reopened.replay()] == ["g1-0", "g1-1", "g2-0"]
    reopened.append([record("g2", 1)])  # new appends go to a new segment; the old ones still replay first
    assert [decode_rollout(r).rollout_id for r in reopened.replay()][-1] == "g2-1"


def test_rotation_keeps_only_the_given_records(tmp_path):
    journal = RolloutJournal(tmp_path)
    journal.append([record("g1", 0), record("g1", 1), record("g2", 0)])
    journal.rotate([record("g2", 0)])
    assert len(journal.segments()) == 1
    assert [decode_rollout(r).rollout_id for r in journal.replay()] == ["g2-0"]


def test_buffer_replay_skips_trained_groups_and_duplicates_quietly_but_live_duplicates_are_rejected():
    buffer = RolloutBuffer(consumed=["g0"])
    g0, g1a, g1b = (decode_rollout(record(g, i)) for g, i in (("g0", 0), ("g1", 0), ("g1", 1)))
    assert not buffer.add(g0, replay=True) and not buffer.add(g0, replay=True)
    assert buffer.add(g1a, replay=True) and not buffer.add(g1a, replay=True)
    assert buffer.rejected == {}
    assert buffer.add(g1b) and buffer.holds("g1") and buffer.holds("g0") and not buffer.holds("g2")
    assert not buffer.add(g1b)  # a live duplicate of a complete group: counted
    assert sum(buffer.rejected.values()) == 1
