"""ControlPlane: learner rank 0's control socket, the serves' membership and the weights group they form.

The one place control messages are read (`pump`) and the one loop that waits on them (`wait_until`): every message
from a serve goes into `inflight/learn/membership.py:Membership` (a pure state machine) with the clock, and its
actions are performed here — a message sent, the weights group closed, a line logged. Called by
`inflight/learn/service.py:LearnerService` while it waits for rollouts, and by
`inflight/learn/publisher.py:WeightPublisher` for the three waits a publish needs (each named where it is asked for:
the previous commits, the group's rendezvous, the quiet period after a failed broadcast). Single-threaded: rank 0's
main thread only (the rendezvous thread touches no socket).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from inflight.learn.membership import Action, BreakGroup, Membership, Send, Serve
from inflight.learn.rendezvous import GroupRendezvous
from inflight.wire.control import Ask, ControlServer, Hello, Progress, UpdateDone
from inflight.wire.group import WeightsGroup

log = logging.getLogger("inflight.learn")


class ControlPlane:
    """The serves rank 0 knows and the weights group of its members. `check(hello)`: '' to accept a serve, else why
    not (inflight/learn/admission.py:ServeCheck). `timeout_s` bounds the wait for commits; `quiet_after_s` is how
    long a failed broadcast's serves get to show they are alive."""

    def __init__(
        self,
        control: ControlServer,
        rendezvous: GroupRendezvous,
        check: Callable[[Hello | Ask], str] | None = None,
        timeout_s: float = 60.0,
        quiet_after_s: float = 3.0,
    ):
        self.control, self.rendezvous = control, rendezvous
        self.timeout_s, self.quiet_after_s = timeout_s, quiet_after_s
        self.membership = Membership(check)
        self.group: WeightsGroup | None = None

    @property
    def serves(self) -> dict[bytes, Serve]:
        """Every accepted serve by ZeroMQ identity (the membership's)."""
        return self.membership.serves

    # -- the socket -----------------------------------------------------------------------------------------------
    def pump(self, timeout_s: float = 0.0) -> list[UpdateDone]:
        """Handle every waiting control message (waiting up to `timeout_s` for the first); the `UpdateDone`s of known
        serves that arrived."""
        done = []
        for identity, message in self.control.poll(timeout_s):
            known = identity in self.membership.serves
            self.perform(self.membership.receive(identity, message, time.monotonic()))
            if known and isinstance(message, UpdateDone):
                done.append(message)
        return done

    def wait_until(self, done: Callable[[], bool], timeout_s: float | None, poll_s: float = 0.05) -> bool:
        """Serve the control socket until `done()` or `timeout_s` (None: no limit); whether `done()` came true."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self.pump(poll_s)
        return True

    def perform(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self.control.send(action.identity, action.message)
            elif isinstance(action, BreakGroup):
                self._close_group(action.why)
            else:
                log.log(action.level, "%s", action.text)

    def send_progress(
        self, consumed_by_server: dict[str, int], version: int, published: int, acks: dict[str, set[str]] | None = None
    ) -> None:
        """Progress to every serve; `acks` (server id -> group ids) are delivered and removed, or kept for a serve
        not known (yet) — a restarted serve gets them once it has said Hello."""
        for serve in self.serves.values():
            acked = sorted(acks.pop(serve.server_id, ())) if acks is not None else []
            message = Progress(
                version=version,
                groups_consumed=consumed_by_server.get(serve.server_id, 0),
                acked=acked,
                published=published,
            )
            if not self.control.send(serve.identity, message) and acks is not None and acked:
                acks[serve.server_id] = set(acked)  # not delivered: try again next time

    # -- the weights group ----------------------------------------------------------------------------------------
    def break_group(self, why: str) -> None:
        self._close_group(why)
        self.membership.dissolve(why)

    def _close_group(self, why: str) -> None:
        if self.group is not None:
            log.warning("weights group %s closed: %s", self.group.address.group_name, why)
            self.group.close()
        self.group = None

    def ensure_group(self) -> list[Serve]:
        """The members of a formed group containing every accepted serve, formed now if membership changed; [] when
        there is no serve (or forming failed)."""
        if self.group is not None and not self.group.broken and self.membership.in_sync():
            return self.membership.members()
        self.break_group("membership changed")
        formation = self.membership.plan()
        if formation is None:
            return []
        rendezvous = self.rendezvous.prepare(formation)
        self.perform(rendezvous.joins)
        rendezvous.start()
        # A wait the protocol needs: the serves' Joined (and any Hello) arrive while the rendezvous runs, and
        # `settle` decides on them. The rendezvous itself is bounded by the group's timeout.
        self.wait_until(rendezvous.finished, None)
        self.group = rendezvous.group  # closed again by the settle's BreakGroup if a member was replaced meanwhile
        settled = self.membership.settle(formation, rendezvous.group is not None, rendezvous.error)
        self.perform(settled.actions)
        return self.membership.members() if settled.formed else []

    def wait_for_commits(self, version: int) -> None:
        """Until every member has answered the update of `version`, at most `timeout_s`. A wait the protocol needs:
        a serve applies one update at a time, so the next broadcast would find a member not listening."""
        if self.wait_until(lambda: not self.membership.uncommitted(version), self.timeout_s, poll_s=0.02):
            return
        waiting = [s.server_id for s in self.membership.uncommitted(version)]
        log.error("serves %s did not report the commit of v%d within %.0fs", waiting, version, self.timeout_s)

    def drop_quiet_serves(self, version: int, error: Exception) -> list[str]:
        """After a failed broadcast: listen for `quiet_after_s` (the wait gives live serves time to be heard), then
        drop the serves that sent nothing meanwhile (or whose connection is gone) and break the group; their ids."""
        self.pump(0)  # drain what was queued before the failure
        start = time.monotonic()
        self.wait_until(lambda: False, self.quiet_after_s)
        probe = Progress(version=-1, groups_consumed=0)  # harmless to a live serve; fails fast to a vanished one
        gone = {s.identity for s in self.membership.heard_since(start) if not self.control.send(s.identity, probe)}
        dropped = self.membership.drop_quiet(start, gone)
        log.error("publishing v%d failed (%s); dropping serves that went quiet: %s", version, error, dropped.server_ids)
        self.perform(dropped.actions)
        return dropped.server_ids
