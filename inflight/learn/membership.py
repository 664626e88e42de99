"""Membership: which serves the learner knows, which of them are in the weights group, and who must be in the next one.

A pure state machine (docs/ARCHITECTURE.md "Learner control plane"): control messages and clock readings go in, a list
of actions comes out — `Send` a message to a ZeroMQ identity, `BreakGroup` (close the weights group), `Log` a line. It
owns no socket, thread, clock or tensor, so every rule below is tested on its own (tests/inflight/test_membership.py);
`inflight/learn/control.py:ControlPlane` is the shell that feeds it from the control socket and performs the
actions.

The rules:
- `Hello`: checked by the `check` it is given (tensors and run contract); a mismatch is answered `Refused` every time
  and logged once per serve and reason. The same process again (same identity, same server id: it answered an
  `Introduce` that crossed its first Hello) keeps its record and its membership. The same server id under a new
  identity (the same process on a new connection) replaces its old record. A member saying Hello again breaks the
  group: its old ranks are gone.
- `Ask` (a serve before its engine starts): its contract checked by the same `check`; answered `agreed` (with the
  learner's `full_every`: whether deltas come, which the serve's staging plan counts), or `Refused` as a Hello would
  be. The asker is not a serve yet: nothing is recorded but a refusal's log line.
- Anything else from an unknown sender draws an `Introduce`, at most once a second per sender.
- `Status`, `Joined`, `UpdateDone` from a known serve refresh `last_seen` and record what they say.
- Forming: `plan` names every accepted serve and its first rank; `settle` marks them members if the group formed and
  none was replaced meanwhile, or drops the ones that did not join if it did not form.
- After a failed broadcast, `drop_quiet` drops the serves silent since the failure (or unreachable) and breaks the
  group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass

from inflight.wire.control import Agreed, Ask, Hello, Introduce, Joined, Refused, Status, UpdateDone

INTRODUCE_EVERY_S = 1.0  # a healed link delivers a burst of queued heartbeats: one Introduce answers them all
FORGET_INTRODUCED_S = 60.0  # an unknown sender silent this long is forgotten (bounds `_introduced`)


@dataclass
class Serve:
    """One accepted serve: its ZeroMQ identity, its Hello, and what the learner last heard from it."""

    identity: bytes
    hello: Hello
    last_seen: float
    member: bool = False
    version: int = -1
    last_update: UpdateDone | None = None  # only the latest matters; a list would grow for the whole run
    joined: Joined | None = None

    @property
    def server_id(self) -> str:
        return self.hello.server_id


@dataclass(frozen=True)
class Send:
    """Send `message` to the serve behind `identity`."""

    identity: bytes
    message: object


@dataclass(frozen=True)
class BreakGroup:
    """Close the weights group (if one is open): its ranks no longer match the membership. Members are already reset."""

    why: str


@dataclass(frozen=True)
class Log:
    """Log `text` at `level` (a `logging` level) on the learner's logger."""

    level: int
    text: str


Action = Send | BreakGroup | Log


@dataclass(frozen=True)
class Settled:
    """What became of a planned group: `formed` with every planned serve as members, and the `actions` to take."""

    formed: bool
    actions: list[Action]


@dataclass(frozen=True)
class Dropped:
    """The serves dropped after a failed broadcast (`server_ids`), and the `actions` to take."""

    server_ids: list[str]
    actions: list[Action]


@dataclass
class Formation:
    """A weights group to form: `serves` in rank order, `ranks[i]` the first rank of `serves[i]` (rank 0 is the
    learner), `world_size` 1 + every serve's workers, under a name never used before in this process."""

    group_name: str
    serves: list[Serve]
    ranks: list[int]
    world_size: int


class Membership:
    """The serves and their weights-group membership. `check(hello)` returns '' for a serve the learner can update
    and train with, else the reason to refuse it (inflight/learn/admission.py:ServeCheck); without
    one every Hello is accepted."""

    def __init__(self, check: Callable[[Hello | Ask], str] | None = None):
        self.check, self.agreed = check or (lambda hello: ""), Agreed()  # an Ask's answer (the publisher's full_every)
        self.serves: dict[bytes, Serve] = {}  # ZeroMQ identity -> serve, in acceptance order
        self.refused: dict[str, str] = {}  # server id -> why (the latest reason)
        self.generation = 0  # weights groups planned so far: each gets a new name
        self._introduced: dict[bytes, float] = {}  # identity -> when it was last asked to introduce itself

    # -- messages -------------------------------------------------------------------------------------------------
    def receive(self, identity: bytes, message: object, now: float) -> list[Action]:
        """Handle one control message from `identity`, received at `now` (monotonic seconds); the actions to take."""
        if isinstance(message, Hello):
            return self._hello(identity, message, now)
        if isinstance(message, Ask):
            problem = self.check(message)
            return self._refuse(identity, message.server_id, problem) if problem else [Send(identity, self.agreed)]
        serve = self.serves.get(identity)
        if serve is None:
            return self._introduce(identity, now)
        serve.last_seen = now
        if isinstance(message, UpdateDone):
            serve.last_update = message
            if not message.ok:
                failed = f"serve {serve.server_id} failed update v{message.version}: {message.error}"
                return [Log(logging.ERROR, failed)]
            serve.version = message.version
        elif isinstance(message, Joined):
            serve.joined = message
        elif isinstance(message, Status):
            serve.version = message.version
        return []

    def _introduce(self, identity: bytes, now: float) -> list[Action]:
        """Ask an unknown sender for its Hello — once a second at most: after a cut link heals, the heartbeats queued
        on the serve's side arrive in one burst, and one Introduce per heartbeat would make it say Hello (and resend
        its unacknowledged rollouts) as many times."""
        if now - self._introduced.get(identity, -1e9) < INTRODUCE_EVERY_S:
            return []
        if len(self._introduced) > 256:  # senders that never answered (gone): forget them
            self._introduced = {i: t for i, t in self._introduced.items() if now - t < FORGET_INTRODUCED_S}
        self._introduced[identity] = now
        return [Send(identity, Introduce())]

    def _hello(self, identity: bytes, hello: Hello, now: float) -> list[Action]:
        self._introduced.pop(identity, None)
        problem = self.check(hello)
        if problem:
            return self._refuse(identity, hello.server_id, problem)
        old = self.serves.get(identity)
        if old is not None and old.server_id == hello.server_id:
            # the same process again (it answered an Introduce that crossed its first Hello): keep its record, and its
            # membership — replacing it would orphan a group that is forming or formed with it
            old.last_seen, old.version = now, max(old.version, hello.version)
            return []
        # a serve's id carries a per-process nonce: the same id under another identity is the same process reconnected
        # (a new ZeroMQ connection after a cut link), so its old record goes
        stale = [s for s in self.serves.values() if s.identity != identity and s.server_id == hello.server_id]
        for serve in stale:
            self.serves.pop(serve.identity)
        self.serves[identity] = Serve(identity, hello, now, version=hello.version)
        actions: list[Action] = []
        if (old is not None and old.member) or any(s.member for s in stale):
            actions.append(self.dissolve("a member said Hello again (restarted or reconnected)"))
        accepted = f"serve {hello.server_id} ({hello.workers} workers, mode {hello.mode}) accepted"
        return [*actions, Log(logging.INFO, accepted)]

    def _refuse(self, identity: bytes, server_id: str, problem: str) -> list[Action]:
        """`Refused` on every Hello (the serve stops on it); the log line once per serve and reason, not per retry."""
        actions: list[Action] = [Send(identity, Refused(reason=problem))]
        if self.refused.get(server_id) != problem:
            actions.insert(0, Log(logging.ERROR, f"refused serve {server_id} before any weights were sent: {problem}"))
        self.refused[server_id] = problem
        return actions

    # -- the weights group ----------------------------------------------------------------------------------------
    def members(self) -> list[Serve]:
        """The serves in the current weights group, in acceptance order."""
        return [s for s in self.serves.values() if s.member]

    def in_sync(self) -> bool:
        """True when there is a serve and every accepted serve is a member: the group needs no re-forming."""
        return bool(self.serves) and all(s.member for s in self.serves.values())

    def catch_up(self, latest: int | None) -> int | None:
        """The version to publish now for a serve that is not in the group (it joined late, or the group broke):
        `latest` (the latest published version, None before the first) if any accepted serve is not a member."""
        if latest is None or all(s.member for s in self.serves.values()):
            return None
        return latest

    def dissolve(self, why: str) -> BreakGroup:
        """No serve is a member any more; the action that closes the group."""
        for serve in self.serves.values():
            serve.member = False
        return BreakGroup(why)

    def plan(self) -> Formation | None:
        """The next group: every accepted serve, ranks in acceptance order, `joined` reset; None without a serve."""
        live = list(self.serves.values())
        if not live:
            return None
        self.generation += 1
        ranks, rank = [], 1
        for serve in live:
            serve.joined = None
            ranks.append(rank)
            rank += serve.hello.workers
        return Formation(f"inflight-weights-{self.generation}", live, ranks, rank)

    def settle(self, formation: Formation, formed: bool, error: str | None = None) -> Settled:
        """What became of `formation`: formed when it formed with every planned serve still accepted, which are
        now members. Not formed: the serves that did not report a successful `Joined` are dropped. Formed, but a
        planned serve was replaced or dropped meanwhile (a Hello under a new identity): `BreakGroup` — publishing to
        that group would send to an orphaned rank."""
        name = formation.group_name
        if not formed:
            absent = [s for s in formation.serves if s.joined is None or not s.joined.ok]
            for serve in absent:
                self.serves.pop(serve.identity, None)
            text = (
                f"weights group {name} did not form ({error}); dropping serves that did not join: "
                f"{[s.server_id for s in absent]}"
            )
            return Settled(False, [Log(logging.ERROR, text)])
        if any(self.serves.get(s.identity) is not s for s in formation.serves):
            return Settled(False, [self.dissolve("a serve restarted while the group formed")])
        for serve in formation.serves:
            serve.member = True
        text = f"weights group {name} formed: {len(formation.serves)} serves, world {formation.world_size}"
        return Settled(True, [Log(logging.INFO, text)])

    def uncommitted(self, version: int) -> list[Serve]:
        """Members that have not answered the update of `version` yet (a serve applies one update at a time)."""
        return [s for s in self.serves.values() if s.member and not _answered(s.last_update, version)]

    def heard_since(self, since: float) -> list[Serve]:
        """Serves that sent anything at or after `since`."""
        return [s for s in self.serves.values() if s.last_seen >= since]

    def drop_quiet(self, since: float, unreachable: Collection[bytes] = ()) -> Dropped:
        """After a failed broadcast: drop the serves silent since `since` (the failure) or whose identity is in
        `unreachable` (their connection is gone); their server ids and the `BreakGroup` for the failed group."""
        dead = [s for s in self.serves.values() if s.last_seen < since or s.identity in unreachable]
        for serve in dead:
            self.serves.pop(serve.identity, None)
        return Dropped([s.server_id for s in dead], [self.dissolve("a broadcast failed")])


def _answered(update: UpdateDone | None, version: int) -> bool:
    return update is not None and (update.version >= version or not update.ok)
