"""ConsumedGroups: trained group ids in bounded memory; membership exact within the reorder window."""

from __future__ import annotations

import json
import logging
import random

from test_rollouts_helpers import rollout

from inflight.learn.consumed import ConsumedGroups, split_group_id
from inflight.learn.store import RolloutBuffer


def gid(stream: str, index: int) -> str:
    return f"{stream}-g{index}"


def test_ids_split_into_stream_and_index_or_stay_whole():
    assert split_group_id("infer3@a1b2-g17") == ("infer3@a1b2", 17)
    assert split_group_id("host-g1-7@ff-g0") == ("host-g1-7@ff", 0)  # the last "-g" counts
    assert split_group_id("g5") is None and split_group_id("a-gx") is None and split_group_id("-g3") is None


def test_a_long_run_in_index_order_holds_no_ids_at_all():
    consumed = ConsumedGroups()
    for i in range(200_000):
        consumed.add(gid("s@1", i))
    assert len(consumed) == 0 and consumed.marks == {"s@1": 200_000}
    assert gid("s@1", 0) in consumed and gid("s@1", 199_999) in consumed
    assert gid("s@1", 200_000) not in consumed and gid("s@2", 0) not in consumed
    assert len(json.dumps(consumed.to_json())) < 100


def test_out_of_order_groups_are_held_until_the_gap_fills():
    consumed = ConsumedGroups()
    order = list(range(1000))
    random.Random(0).shuffle(order)
    for n, i in enumerate(order, 1):
        consumed.add(gid("s@1", i))
        trained = set(order[:n])
        probe = random.Random(n).randrange(1000)
        assert (gid("s@1", probe) in consumed) == (probe in trained)
    assert len(consumed) == 0 and consumed.marks["s@1"] == 1000


def test_a_hole_that_never_fills_is_skipped_after_the_window(caplog):
    consumed = ConsumedGroups(window=8)
    for i in range(1, 9):  # group 0 never arrives whole
        consumed.add(gid("s@1", i))
    assert len(consumed) == 8 and gid("s@1", 0) not in consumed
    with caplog.at_level(logging.WARNING, logger="inflight.learn"):
        consumed.add(gid("s@1", 9))
    assert len(consumed) == 0 and consumed.marks["s@1"] == 10
    assert "groups 0..0 never arrived whole" in caplog.text


def test_checkpoint_form_round_trips_and_old_lists_still_load():
    consumed = ConsumedGroups()
    for group_id in [gid("a@1", 0), gid("a@1", 1), gid("a@1", 5), gid("b@2", 3), "custom"]:
        consumed.add(group_id)
    again = ConsumedGroups(json.loads(json.dumps(consumed.to_json())))
    old = ConsumedGroups([gid("a@1", 0), gid("a@1", 1), gid("a@1", 5), gid("b@2", 3), "custom"])  # pre-0.2 meta
    for probe in [gid("a@1", i) for i in range(7)] + [gid("b@2", i) for i in range(5)] + ["custom", "other"]:
        assert (probe in again) == (probe in consumed) == (probe in old)
    assert again.to_json() == consumed.to_json() == old.to_json()


def test_a_resumed_buffer_refuses_groups_trained_before_and_takes_new_ones():
    buf = RolloutBuffer("tiny-llama", temperature=1.0)
    for g in ("s@1-g0", "s@1-g1"):
        for i in range(2):
            buf.add(rollout(g, i, model="tiny-llama"))
    buf.take(2)
    resumed = RolloutBuffer("tiny-llama", consumed=json.loads(json.dumps(buf.consumed.to_json())), temperature=1.0)
    assert not resumed.add(rollout("s@1-g1", 0, model="tiny-llama"))
    assert "already trained" in " ".join(resumed.rejected)
    assert resumed.add(rollout("s@1-g2", 0, model="tiny-llama"))
