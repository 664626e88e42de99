"""The serve membership state machine on its own (inflight/learn/membership.py): messages and clock readings in,
actions out, no sockets, threads or clocks. The shell that performs the actions over real sockets is tested in
test_publisher_membership.py; real serves in test_faults.py and test_two_hosts.py."""

from __future__ import annotations

import logging

from inflight.learn.membership import BreakGroup, Log, Membership, Send
from inflight.wire.control import Agreed, Ask, Hello, Introduce, Joined, Refused, Status, UpdateDone

A, B, C = b"identity-a", b"identity-b", b"identity-c"


def hello(server_id: str = "serve-a@01", workers: int = 1, model: str = "m", version: int = 0) -> Hello:
    return Hello(server_id=server_id, model=model, workers=workers, version=version)


def logs(actions, level: int = logging.INFO) -> list[str]:
    return [a.text for a in actions if isinstance(a, Log) and a.level == level]


def sends(actions) -> list[tuple[bytes, object]]:
    return [(a.identity, a.message) for a in actions if isinstance(a, Send)]


def formed_with(membership: Membership, now: float = 1.0):
    """Plan a group, every planned serve reports Joined, and it forms: the formation."""
    formation = membership.plan()
    for serve in formation.serves:
        membership.receive(serve.identity, Joined(server_id=serve.server_id, group_name=formation.group_name), now)
    assert membership.settle(formation, True).formed
    return formation


# -- join -------------------------------------------------------------------------------------------------------------


def test_a_hello_is_accepted_and_the_next_group_includes_the_serve_at_the_first_free_rank():
    membership = Membership()
    actions = membership.receive(A, hello(workers=2), now=1.0)
    assert actions == [Log(logging.INFO, "serve serve-a@01 (2 workers, mode never-stop) accepted")]
    assert [s.server_id for s in membership.serves.values()] == ["serve-a@01"] and not membership.in_sync()
    membership.receive(B, hello("serve-b@02"), now=1.0)
    formation = membership.plan()
    assert [s.identity for s in formation.serves] == [A, B] and formation.ranks == [1, 3]
    assert formation.world_size == 4 and formation.group_name == "inflight-weights-1"


def test_a_group_that_formed_with_every_planned_serve_makes_them_members():
    membership = Membership()
    membership.receive(A, hello(), now=1.0)
    formation = membership.plan()
    membership.receive(A, Joined(server_id="serve-a@01", group_name=formation.group_name), now=2.0)
    settled = membership.settle(formation, True)
    assert settled.formed
    assert settled.actions == [Log(logging.INFO, "weights group inflight-weights-1 formed: 1 serves, world 2")]
    assert [s.identity for s in membership.members()] == [A] and membership.in_sync()


def test_a_group_that_did_not_form_drops_the_serves_that_did_not_join_and_keeps_the_others():
    membership = Membership()
    for identity, server_id in ((A, "serve-a@01"), (B, "serve-b@02"), (C, "serve-c@03")):
        membership.receive(identity, hello(server_id), now=1.0)
    formation = membership.plan()
    membership.receive(A, Joined(server_id="serve-a@01", group_name=formation.group_name), now=2.0)
    membership.receive(C, Joined(server_id="serve-c@03", group_name=formation.group_name, ok=False), now=2.0)
    settled = membership.settle(formation, False, "store timeout")
    assert not settled.formed
    assert logs(settled.actions, logging.ERROR) == [
        "weights group inflight-weights-1 did not form (store timeout); dropping serves that did not join: "
        "['serve-b@02', 'serve-c@03']"
    ]
    assert list(membership.serves) == [A] and membership.members() == []
    assert membership.plan().group_name == "inflight-weights-2"  # the next try is a group of a new name


def test_no_group_is_planned_without_a_serve():
    assert Membership().plan() is None


# -- refused ----------------------------------------------------------------------------------------------------------


def test_a_refused_hello_is_answered_refused_every_time_and_logged_once_per_serve_and_reason():
    reason = {"m": "", "other": "tensor 'w' is not served (different model?)", "old": "dtype bfloat16, not float32"}
    membership = Membership(check=lambda h: reason[h.model])
    first = membership.receive(A, hello(model="other"), now=1.0)
    again = membership.receive(A, hello(model="other"), now=2.0)
    assert sends(first) == sends(again) == [(A, Refused(reason=reason["other"]))]
    assert logs(first, logging.ERROR) == [f"refused serve serve-a@01 before any weights were sent: {reason['other']}"]
    assert logs(again, logging.ERROR) == []  # a serve that retries is not logged again
    changed = membership.receive(A, hello(model="old"), now=3.0)
    assert sends(changed) == [(A, Refused(reason=reason["old"]))] and len(logs(changed, logging.ERROR)) == 1
    assert membership.serves == {} and membership.refused == {"serve-a@01": reason["old"]}


def test_an_ask_before_the_engine_starts_is_answered_agreed_or_refused_and_records_no_serve():
    membership = Membership(check=lambda m: "" if m.server_id == "good" else f"serve {m.server_id}: temperature 0.5")
    assert sends(membership.receive(A, Ask(server_id="good"), now=1.0)) == [(A, Agreed())]
    first = membership.receive(B, Ask(server_id="bad"), now=1.0)
    again = membership.receive(B, Ask(server_id="bad"), now=2.0)
    assert sends(first) == sends(again) == [(B, Refused(reason="serve bad: temperature 0.5"))]
    assert len(logs(first, logging.ERROR)) == 1 and logs(again, logging.ERROR) == []
    assert membership.serves == {} and sends(membership.receive(A, Status(), now=3.0)) == [(A, Introduce())]


def test_an_agreed_ask_carries_the_learners_full_every_so_the_serves_staging_plan_counts_deltas():
    from vllm_patches.device_plan import plans_deltas

    membership = Membership()
    membership.agreed = Agreed(full_every=4)  # what the publisher sets from its --full-every
    assert sends(membership.receive(A, Ask(server_id="good"), now=1.0)) == [(A, Agreed(full_every=4))]
    assert plans_deltas(4) and not plans_deltas(1) and not plans_deltas(0)  # 0: a learner that did not say


# -- unknown senders --------------------------------------------------------------------------------------------------


def test_a_burst_of_heartbeats_from_an_unknown_sender_draws_one_introduce_a_second():
    membership = Membership()
    burst = [a for i in range(12) for a in membership.receive(A, Status(server_id="serve-a@01"), now=5.0 + i / 100)]
    assert burst == [Send(A, Introduce())]
    assert membership.receive(A, Status(), now=5.99) == []
    assert membership.receive(A, Status(), now=6.0) == [Send(A, Introduce())]  # a lost Introduce is not fatal
    assert membership.receive(B, UpdateDone(), now=6.0) == [Send(B, Introduce())]  # per sender
    assert membership.serves == {}


def test_a_hello_forgets_the_introduce_so_the_same_identity_is_asked_again_at_once_when_dropped():
    membership = Membership()
    membership.receive(A, Status(), now=1.0)
    membership.receive(A, hello(), now=1.1)
    membership.drop_quiet(since=1.2)  # dropped as quiet: its next heartbeat is a stranger's again
    assert membership.receive(A, Status(), now=1.5) == [Send(A, Introduce())]  # within the second of the last ask


def test_senders_that_never_answered_are_forgotten_after_a_minute():
    membership = Membership()
    for i in range(257):
        membership.receive(bytes([i % 256, i // 256]), Status(), now=0.0)
    membership.receive(b"late", Status(), now=61.0)
    assert list(membership._introduced) == [b"late"]


# -- bookkeeping ------------------------------------------------------------------------------------------------------


def test_heartbeats_joined_and_update_done_of_a_known_serve_are_recorded():
    membership = Membership()
    membership.receive(A, hello(version=2), now=1.0)
    serve = membership.serves[A]
    assert serve.version == 2 and serve.last_seen == 1.0
    assert membership.receive(A, Status(server_id="serve-a@01", version=3), now=4.0) == []
    assert serve.version == 3 and serve.last_seen == 4.0
    joined = Joined(server_id="serve-a@01", group_name="g")
    membership.receive(A, joined, now=5.0)
    assert serve.joined == joined
    done = UpdateDone(server_id="serve-a@01", version=4)
    assert membership.receive(A, done, now=6.0) == [] and serve.version == 4 and serve.last_update == done


def test_a_failed_update_is_logged_leaves_the_version_and_counts_as_answered():
    membership = Membership()
    membership.receive(A, hello(), now=1.0)
    formed_with(membership)
    assert membership.uncommitted(1) == [membership.serves[A]]
    failed = UpdateDone(server_id="serve-a@01", version=1, ok=False, error="crc mismatch in bucket 0")
    actions = membership.receive(A, failed, now=3.0)
    assert logs(actions, logging.ERROR) == ["serve serve-a@01 failed update v1: crc mismatch in bucket 0"]
    assert membership.serves[A].version == 0 and membership.uncommitted(1) == []  # waiting on it would only stall


# -- quiet ------------------------------------------------------------------------------------------------------------


def test_after_a_failed_broadcast_a_serve_silent_since_the_failure_is_dropped_and_the_group_broken():
    membership = Membership()
    membership.receive(A, hello(), now=1.0)
    membership.receive(B, hello("serve-b@02"), now=1.0)
    formed_with(membership, now=2.0)
    membership.receive(A, Status(), now=10.5)  # A keeps talking after the failure at 10.0; B went silent at 2.0
    dropped = membership.drop_quiet(since=10.0)
    assert dropped.server_ids == ["serve-b@02"] and dropped.actions == [BreakGroup("a broadcast failed")]
    assert list(membership.serves) == [A] and membership.members() == []  # the rest re-form a group


def test_a_serve_heard_after_the_failure_whose_connection_is_gone_is_dropped_too():
    membership = Membership()
    membership.receive(A, hello(), now=1.0)
    membership.receive(B, hello("serve-b@02"), now=1.0)
    membership.receive(A, Status(), now=10.5)
    membership.receive(B, Status(), now=10.5)
    assert membership.heard_since(10.0) == list(membership.serves.values())
    dropped = membership.drop_quiet(since=10.0, unreachable={B})
    assert dropped.server_ids == ["serve-b@02"] and list(membership.serves) == [A]


# -- rejoin -----------------------------------------------------------------------------------------------------------


def test_the_same_server_id_under_a_new_identity_replaces_the_old_record_and_breaks_the_group_it_was_in():
    membership = Membership()
    membership.receive(A, hello(), now=1.0)
    formed_with(membership)
    actions = membership.receive(B, hello(), now=5.0)  # the same process on a new ZeroMQ connection
    assert actions == [BreakGroup("a member said Hello again (restarted or reconnected)"),
                       Log(logging.INFO, "serve serve-a@01 (1 workers, mode never-stop) accepted")]  # fmt: skip
    assert list(membership.serves) == [B] and membership.members() == []
    assert membership.receive(C, hello("serve-a@99"), now=6.0)[-1].level == logging.INFO  # another nonce: another
    assert [s.server_id for s in membership.serves.values()] == ["serve-a@01", "serve-a@99"]


def test_a_new_process_behind_a_members_identity_replaces_it_and_breaks_the_group():
    membership = Membership()
    membership.receive(A, hello(), now=1.0)
    formed_with(membership)
    actions = membership.receive(A, hello("serve-a@02"), now=5.0)
    assert BreakGroup("a member said Hello again (restarted or reconnected)") in actions
    assert membership.serves[A].server_id == "serve-a@02" and not membership.serves[A].member


def test_a_hello_repeated_by_the_same_process_while_the_group_forms_keeps_its_record_and_membership():
    """It answered an Introduce that crossed its first Hello: replacing the record would orphan the forming group."""
    membership = Membership()
    membership.receive(A, hello(), now=1.0)
    formation = membership.plan()
    record = membership.serves[A]
    assert membership.receive(A, hello(version=3), now=2.0) == []
    membership.receive(A, Joined(server_id="serve-a@01", group_name=formation.group_name), now=2.5)
    assert membership.settle(formation, True).formed
    assert membership.serves[A] is record and record.member and record.version == 3
    assert membership.receive(A, hello(), now=3.0) == [] and record.member  # and once formed, it stays a member


# -- late joiner ------------------------------------------------------------------------------------------------------


def test_a_serve_accepted_after_the_group_formed_makes_it_re_form_and_is_sent_the_latest_version():
    membership = Membership()
    assert membership.catch_up(None) is None  # nothing published yet: nothing to catch up on
    membership.receive(A, hello(workers=2), now=1.0)
    formed_with(membership)
    assert membership.in_sync() and membership.catch_up(7) is None
    actions = membership.receive(B, hello("serve-b@02"), now=3.0)
    assert not any(isinstance(a, BreakGroup) for a in actions)  # the members keep their group until it re-forms
    assert not membership.in_sync() and membership.catch_up(7) == 7
    formation = membership.plan()
    assert [s.identity for s in formation.serves] == [A, B] and formation.ranks == [1, 3]
    assert formation.group_name == "inflight-weights-2"


# -- publish during re-form -------------------------------------------------------------------------------------------


def test_a_member_replaced_while_the_group_forms_leaves_it_not_formed_and_nothing_is_published_to_the_orphan():
    membership = Membership()
    membership.receive(A, hello(), now=1.0)
    formation = membership.plan()
    assert membership.receive(B, hello(), now=2.0)[-1].level == logging.INFO  # reconnected while the group forms
    membership.receive(A, Joined(server_id="serve-a@01", group_name=formation.group_name), now=2.5)
    settled = membership.settle(formation, True)
    assert not settled.formed and settled.actions == [BreakGroup("a serve restarted while the group formed")]
    assert membership.members() == [] and list(membership.serves) == [B]
    assert membership.catch_up(4) == 4  # the replacement still needs the weights: the next publish re-forms
    assert [s.identity for s in membership.plan().serves] == [B]
