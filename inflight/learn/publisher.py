"""WeightPublisher: learner rank 0's side of the weights path — serves, the weights group, and one update per step.

Flow (docs/ARCHITECTURE.md "The weight path"): a serve says `Hello` with every tensor it serves (name, dtype, shape)
and its `RunContract` (group size, temperature, top-p/top-k, compute dtype); the publisher checks both against what
the learner sends and trains for, and refuses a mismatching serve before any bucket moves, naming the first mismatch.
Accepted serves form one weights group (rank 0 = this process, then each serve's workers); when membership changes the
group is re-formed under a new name. `publish()` casts the full state to the serve's dtypes, plans the buckets,
announces the manifest to every member, broadcasts the buckets (double-buffered) and returns without waiting for the
commits: `UpdateDone` replies are collected by `pump()` while training goes on.

A serve that dies mid-transfer breaks the broadcast within `timeout_s`: the publisher logs which serves went quiet,
drops them, re-forms the group with the rest and sends the same version again. A serve that (re)joins late gets the
latest weights straight away.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from inflight.wire.contract import RunContract
from inflight.wire.control import (
    Hello,
    Introduce,
    Joined,
    JoinGroup,
    Progress,
    Refused,
    Status,
    UpdateDone,
    UpdateWeights,
)
from inflight.wire.endpoints import ControlServer
from inflight.wire.group import GroupAddress, WeightsGroup, WeightsGroupError, open_store
from inflight.wire.transfer import send_update
from inflight.wire.weights import DTYPES, ManifestError, check_against, plan_manifest

log = logging.getLogger("inflight.learn")


@dataclass
class Serve:
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


@dataclass
class PublishReport:
    version: int
    serves: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)


class WeightPublisher:
    def __init__(self, control: ControlServer, host: str = "127.0.0.1", store_port: int = 0, backend: str = "gloo",
                 timeout_s: float = 60.0, bucket_bytes: int = 64 << 20, quiet_after_s: float = 3.0):  # fmt: skip
        self.control, self.host, self.backend = control, host, backend
        self.timeout_s, self.bucket_bytes, self.quiet_after_s = timeout_s, bucket_bytes, quiet_after_s
        self.store = open_store(GroupAddress(host, store_port, 1, timeout_s=timeout_s), is_host=True)
        self.serves: dict[bytes, Serve] = {}
        self.refused: dict[str, str] = {}  # server_id -> why
        self.group: WeightsGroup | None = None
        self.generation = 0
        self.expected: dict[str, tuple[str, list[int]]] | None = None  # what the learner sends: name -> (dtype, shape)
        self.contract: RunContract | None = None  # what the learner trains for; None = no check (unit tests)
        self.latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._introduced: dict[bytes, float] = {}  # identity -> when we last asked it to introduce itself

    @property
    def store_port(self) -> int:
        return self.store.port

    # -- control messages ---------------------------------------------------------------------------------------
    def pump(self, timeout_s: float = 0.0) -> list:
        """Handle every waiting control message; returns the `UpdateDone`s that arrived."""
        done = []
        for identity, message in self.control.poll(timeout_s):
            serve = self.serves.get(identity)
            if isinstance(message, Hello):
                self._hello(identity, message)
            elif serve is None:
                self._introduce(identity)
            else:
                serve.last_seen = time.monotonic()
                if isinstance(message, UpdateDone):
                    serve.last_update = message
                    serve.version = message.version if message.ok else serve.version
                    done.append(message)
                    if not message.ok:
                        log.error("serve %s failed update v%d: %s", serve.server_id, message.version, message.error)
                elif isinstance(message, Joined):
                    serve.joined = message
                elif isinstance(message, Status):
                    serve.version = message.version
        return done

    def _introduce(self, identity: bytes) -> None:
        """Ask an unknown sender for its Hello — once a second at most: after a cut link heals, the heartbeats queued
        on the serve's side arrive in one burst, and one Introduce per heartbeat would make it say Hello (and resend
        its unacknowledged rollouts) as many times."""
        now = time.monotonic()
        if now - self._introduced.get(identity, -1e9) >= 1.0:
            if len(self._introduced) > 256:  # senders that never answered (gone): forget them
                self._introduced = {i: t for i, t in self._introduced.items() if now - t < 60.0}
            self._introduced[identity] = now
            self.control.send(identity, Introduce())

    def _hello(self, identity: bytes, hello: Hello) -> None:
        self._introduced.pop(identity, None)
        problem = self._mismatch(hello)
        if problem:
            if self.refused.get(hello.server_id) != problem:  # once per serve, not once per retry
                log.error("refused serve %s before any weights were sent: %s", hello.server_id, problem)
            self.refused[hello.server_id] = problem
            self.control.send(identity, Refused(reason=problem))
            return
        old = self.serves.get(identity)
        if old is not None and old.hello.server_id == hello.server_id:
            # the same process again (it answered an Introduce that crossed its first Hello): keep its record, and its
            # membership — replacing it would orphan a group that is forming or formed with it
            old.last_seen, old.version = time.monotonic(), max(old.version, hello.version)
            return
        # a serve's id carries a per-process nonce: the same id under another identity is the same process reconnected
        # (a new ZeroMQ connection after a cut link), so its old record goes
        stale = [s for s in self.serves.values() if s.identity != identity and s.hello.server_id == hello.server_id]
        for s in stale:
            self.serves.pop(s.identity)
        self.serves[identity] = Serve(identity, hello, time.monotonic(), version=hello.version)
        if (old is not None and old.member) or any(s.member for s in stale):
            self._break_group("a member said Hello again (restarted or reconnected)")
        log.info("serve %s (%d workers, mode %s) accepted", hello.server_id, hello.workers, hello.mode)

    def _mismatch(self, hello: Hello) -> str:
        """'' if the serve's tensors can take the learner's update and its contract is the learner's, else the first
        mismatch in words (the model first: a serve of another model is that, whatever its contract says)."""
        return self._tensor_mismatch(hello) or self._contract_mismatch(hello)

    def _contract_mismatch(self, hello: Hello) -> str:
        if self.contract is None:
            return ""
        if hello.contract is None:
            return f"serve {hello.server_id} announced no run contract (group size, temperature, dtype) to check"
        return hello.contract.mismatch(self.contract, hello.server_id)

    def _tensor_mismatch(self, hello: Hello) -> str:
        if self.expected is None:
            return ""
        served = {t.name: (t.dtype, list(t.shape)) for t in hello.tensors}
        for name, (_, shape) in self.expected.items():
            if name not in served:
                return f"the learner's tensor {name!r} is not served by {hello.server_id} (different model?)"
            if list(served[name][1]) != list(shape):
                return f"tensor {name}: learner shape {list(shape)}, serve {hello.server_id} has {served[name][1]}"
            if served[name][0] not in DTYPES:
                return f"tensor {name}: serve dtype {served[name][0]!r} cannot be sent"
        extra = sorted(set(served) - set(self.expected))
        return f"serve {hello.server_id} has tensor {extra[0]!r} the learner does not train" if extra else ""

    def send_progress(self, consumed_by_server: dict[str, int], version: int,
                      acks: dict[str, set[str]] | None = None) -> None:  # fmt: skip
        """Progress to every serve; `acks` (server id -> group ids) are delivered and removed, or kept for a serve
        not known (yet) — a restarted serve gets them once it has said Hello."""
        for serve in self.serves.values():
            acked = sorted(acks.pop(serve.server_id, ())) if acks is not None else []
            message = Progress(version=version, groups_consumed=consumed_by_server.get(serve.server_id, 0), acked=acked,
                               published=self.latest[0] if self.latest is not None else 0)  # fmt: skip
            if not self.control.send(serve.identity, message) and acks is not None and acked:
                acks[serve.server_id] = set(acked)  # not delivered: try again next time

    # -- the weights group --------------------------------------------------------------------------------------
    def _break_group(self, why: str) -> None:
        if self.group is not None:
            log.warning("weights group %s closed: %s", self.group.address.group_name, why)
            self.group.close()
        self.group = None
        for serve in self.serves.values():
            serve.member = False

    def _ensure_group(self) -> bool:
        """A formed group containing every accepted serve; False when there is no serve (or forming failed)."""
        live = list(self.serves.values())
        if self.group is not None and not self.group.broken and live and all(s.member for s in live):
            return True
        self._break_group("membership changed")
        if not live:
            return False
        self.generation += 1
        address = GroupAddress(self.host, self.store_port, 1 + sum(s.hello.workers for s in live),
                               f"inflight-weights-{self.generation}", self.backend, self.timeout_s)  # fmt: skip
        rank = 1
        for serve in live:
            serve.joined = None
            self.control.send(serve.identity, JoinGroup(host=address.host, port=address.port, rank=rank,
                                                        group_name=address.group_name, world_size=address.world_size,
                                                        backend=address.backend, timeout_s=self.timeout_s))  # fmt: skip
            rank += serve.hello.workers
        result: dict = {}
        thread = threading.Thread(target=_form, args=(address, self.store, result), daemon=True)
        thread.start()
        while thread.is_alive():
            self.pump(0.05)
        if "group" not in result:
            absent = [s for s in live if s.joined is None or not s.joined.ok]
            log.error("weights group %s did not form (%s); dropping serves that did not join: %s",
                      address.group_name, result.get("error"), [s.server_id for s in absent])  # fmt: skip
            for serve in absent:
                self.serves.pop(serve.identity, None)
            return False
        self.group = result["group"]
        if any(self.serves.get(s.identity) is not s for s in live):  # a member restarted or vanished while it formed
            self._break_group("a serve restarted while the group formed")
            return False
        for serve in live:
            serve.member = True
        log.info("weights group %s formed: %d serves, world %d", address.group_name, len(live), address.world_size)
        return True

    def _wait_for_commits(self, version: int) -> None:
        """Until every member has answered the update of `version` (a serve applies one update at a time)."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            waiting = [s for s in self.serves.values() if s.member and not _answered(s.last_update, version)]
            if not waiting:
                return
            self.pump(0.02)
        log.error("serves %s did not report the commit of v%d within %.0fs", [s.server_id for s in waiting], version,
                  self.timeout_s)  # fmt: skip

    def _quiet_serves(self) -> list[Serve]:
        """Serves that send nothing for `quiet_after_s` (or whose connection is gone) after a failed broadcast."""
        self.pump(0)  # drain what was queued before the failure
        start = time.monotonic()
        while time.monotonic() - start < self.quiet_after_s:
            self.pump(0.05)
        probe = Progress(version=-1, groups_consumed=0)  # harmless to a live serve; fails fast to a vanished one
        return [s for s in self.serves.values() if s.last_seen < start or not self.control.send(s.identity, probe)]

    # -- publishing ---------------------------------------------------------------------------------------------
    def set_model(self, state: dict[str, torch.Tensor], contract: RunContract | None = None) -> None:
        """What this learner sends and (with `contract`) trains for; serves announcing anything else are refused at
        Hello."""
        self.expected = {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in state.items()}
        self.contract = contract

    def publish(self, state: dict[str, torch.Tensor], version: int, consumed: dict[str, int] | None = None,
                retries: int = 1) -> PublishReport:  # fmt: skip
        """Send `state` as `version` to every serve; on a failed broadcast drop the dead serves and retry."""
        self.latest = (version, state)
        report = PublishReport(version)
        for _ in range(retries + 1):
            self.pump(0)
            if self.group is not None:
                self._wait_for_commits(version - 1)
            if not self._ensure_group():
                return report
            members = [s for s in self.serves.values() if s.member]
            served = {t.name: (t.dtype, list(t.shape)) for t in members[0].hello.tensors}
            cast = {name: state[name].to(DTYPES[dtype]).contiguous() for name, (dtype, _) in served.items()}
            manifest = plan_manifest(cast, version, self.bucket_bytes)
            check_against(manifest, served)
            for serve in members:
                self.control.send(serve.identity, UpdateWeights(manifest=manifest.encode(), groups_consumed=(
                    consumed or {}).get(serve.server_id, 0)))  # fmt: skip
            try:
                stats = send_update(self.group, manifest, cast)
            except WeightsGroupError as exc:
                dead = self._quiet_serves()
                log.error("publishing v%d failed (%s); dropping serves that went quiet: %s", version, exc,
                          [s.server_id for s in dead])  # fmt: skip
                report.failed += [s.server_id for s in dead]
                for serve in dead:
                    self.serves.pop(serve.identity, None)
                self._break_group("a broadcast failed")
                continue
            report.serves, report.bytes, report.seconds = len(members), stats.bytes, stats.seconds
            return report
        return report

    def catch_up(self, consumed: dict[str, int] | None = None) -> PublishReport | None:
        """If a serve joined after the latest publish, send it (and everyone) the latest weights now."""
        if self.latest is None or all(s.member for s in self.serves.values()):
            return None
        version, state = self.latest
        return self.publish(state, version, consumed)

    def close(self) -> None:
        """Wait (up to `timeout_s`) until every member serve has answered the last published update, then break the
        group: a learner that stops cleanly leaves its final weights committed on the serves, not in flight."""
        if self.group is not None and self.latest is not None:
            self._wait_for_commits(self.latest[0])
        self._break_group("learner shutting down")


def _answered(update: UpdateDone | None, version: int) -> bool:
    return update is not None and (update.version >= version or not update.ok)


def _form(address: GroupAddress, store, result: dict) -> None:
    try:
        result["group"] = WeightsGroup(address, 0, store)
    except (WeightsGroupError, RuntimeError) as exc:
        result["error"] = str(exc)


__all__ = ["WeightPublisher", "PublishReport", "ManifestError"]
