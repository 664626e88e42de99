"""WeightPublisher: learner rank 0's side of the weights path — serves, the weights group, and one update per step.

Flow (docs/ARCHITECTURE.md "The weight path"): a serve says `Hello` with every tensor it serves (name, dtype, shape)
and its `RunContract` (group size, temperature, top-p/top-k, compute dtype); the publisher checks both against what
the learner sends and trains for, and refuses a mismatching serve before any bucket moves, naming the first mismatch.
Accepted serves form one weights group (rank 0 = this process, then each serve's workers); when membership changes the
group is re-formed under a new name. `publish()` casts the full state to the serve's dtypes, plans the buckets,
announces the manifest to every member, broadcasts the buckets (double-buffered) and returns without waiting for the
commits: `UpdateDone` replies are collected by `pump()` while training goes on.

Delta updates (`full_every` > 1): when every member reported the commit of the previous version sent, the next update
carries only the elements that changed since it (inflight/wire/delta.py), checked by the serves against the whole
tensors' checksums; a full update goes out every `full_every` versions, after any failure, and whenever a member joined
or missed one. The cast tensors of the last version sent stay here as the base (one copy in the serves' dtype).

A serve that dies mid-transfer breaks the broadcast within `timeout_s`: the publisher logs which serves went quiet,
drops them, re-forms the group with the rest and sends the same version again. A serve that (re)joins late gets the
latest weights straight away.

Who is a serve, who is a member and who must be in the next group is decided by `Membership`
(inflight/learn/membership.py, a pure state machine); this class is its shell: it feeds it the control socket's
messages and the clock, performs its actions, runs the group's rendezvous on a thread and moves the buckets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from inflight.learn.membership import Action, BreakGroup, Membership, Send, Serve
from inflight.wire.contract import RunContract
from inflight.wire.control import Hello, JoinGroup, Progress, UpdateDone, UpdateWeights
from inflight.wire.endpoints import ControlServer
from inflight.wire.group import GroupAddress, WeightsGroup, WeightsGroupError, open_store
from inflight.wire.transfer import StreamSender, send_update
from inflight.wire.weights import DTYPES, ManifestError, check_against, plan_layout, plan_update

log = logging.getLogger("inflight.learn")


@dataclass
class PublishReport:
    """One `publish`: the serves the update went to, the bytes broadcast and the broadcast's seconds; `failed` the
    server ids dropped because a broadcast failed on them."""

    version: int
    serves: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)
    delta: bool = False  # sent as a delta on the previous version sent


class WeightPublisher:
    """Rank 0's weights path: polls the control socket into `Membership` (inflight/learn/membership.py) and performs
    its actions, forms the weights group (a thread, while the control socket keeps being served) and broadcasts
    updates. Single-threaded use only: every method is called from the learner's main thread."""

    def __init__(
        self,
        control: ControlServer,
        host: str = "127.0.0.1",
        store_port: int = 0,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        bucket_bytes: int = 64 << 20,
        quiet_after_s: float = 3.0,
        weights_key: bytes | None = None,
        device: torch.device | str = "cpu",
        full_every: int = 1,
    ):
        """`weights_key` (from --secret-file, inflight/wire/secure.py:weights_key): tag every tensor of every update
        with it instead of a CRC32. `device`: where the buckets are packed and sent from — the learner's GPU for
        NCCL, host memory for gloo (`learner/world.py:World.weights_device`). `full_every` (--full-every): a full
        update every that many versions, deltas between; 1 = always full."""
        self.control, self.host, self.backend, self.device = control, host, backend, torch.device(device)
        self.weights_key = weights_key
        self.timeout_s, self.bucket_bytes, self.quiet_after_s = timeout_s, bucket_bytes, quiet_after_s
        self.store = open_store(GroupAddress(host, store_port, 1, timeout_s=timeout_s), is_host=True)
        self.membership = Membership(self._mismatch)
        self._head_warned: set[str] = set()  # serves warned about a differing LM head precision (once each)
        self.group: WeightsGroup | None = None
        self.expected: dict[str, tuple[str, list[int]]] | None = None  # what the learner sends: name -> (dtype, shape)
        self.contract: RunContract | None = None  # what the learner trains for; None = no check (unit tests)
        self.latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self.full_every = full_every
        self._sent: tuple[int, dict[str, torch.Tensor]] | None = None  # the last version broadcast, cast: a delta base
        self._last_full = 0  # the version of the last full update broadcast

    @property
    def store_port(self) -> int:
        return self.store.port

    @property
    def serves(self) -> dict[bytes, Serve]:
        """Every accepted serve by ZeroMQ identity (the membership's)."""
        return self.membership.serves

    @property
    def refused(self) -> dict[str, str]:
        """Refused server ids and why."""
        return self.membership.refused

    # -- control messages ---------------------------------------------------------------------------------------
    def pump(self, timeout_s: float = 0.0) -> list[UpdateDone]:
        """Handle every waiting control message (waiting up to `timeout_s` for the first); returns the `UpdateDone`s
        of known serves that arrived."""
        done = []
        for identity, message in self.control.poll(timeout_s):
            known = identity in self.membership.serves
            self._perform(self.membership.receive(identity, message, time.monotonic()))
            if known and isinstance(message, UpdateDone):
                done.append(message)
        return done

    def _perform(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self.control.send(action.identity, action.message)
            elif isinstance(action, BreakGroup):
                self._break_group(action.why)
            else:
                log.log(action.level, "%s", action.text)

    def _mismatch(self, hello: Hello) -> str:
        """'' if the serve's tensors can take the learner's update and its contract is the learner's, else the first
        mismatch in words (the model first: a serve of another model is that, whatever its contract says)."""
        problem = self._tensor_mismatch(hello) or self._contract_mismatch(hello)
        if not problem and self.contract is not None and hello.contract is not None:
            warning = hello.contract.head_warning(self.contract, hello.server_id)
            if warning and hello.server_id not in self._head_warned:
                self._head_warned.add(hello.server_id)
                log.warning("%s", warning)
        return problem

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

    def send_progress(
        self, consumed_by_server: dict[str, int], version: int, acks: dict[str, set[str]] | None = None
    ) -> None:
        """Progress to every serve; `acks` (server id -> group ids) are delivered and removed, or kept for a serve
        not known (yet) — a restarted serve gets them once it has said Hello."""
        for serve in self.serves.values():
            acked = sorted(acks.pop(serve.server_id, ())) if acks is not None else []
            message = Progress(
                version=version,
                groups_consumed=consumed_by_server.get(serve.server_id, 0),
                acked=acked,
                published=self.latest[0] if self.latest is not None else 0,
            )
            if not self.control.send(serve.identity, message) and acks is not None and acked:
                acks[serve.server_id] = set(acked)  # not delivered: try again next time

    # -- the weights group ----------------------------------------------------------------------------------------
    def _break_group(self, why: str) -> None:
        if self.group is not None:
            log.warning("weights group %s closed: %s", self.group.address.group_name, why)
            self.group.close()
        self.group = None
        self.membership.dissolve(why)

    def _ensure_group(self) -> bool:
        """A formed group containing every accepted serve; False when there is no serve (or forming failed)."""
        if self.group is not None and not self.group.broken and self.membership.in_sync():
            return True
        self._break_group("membership changed")
        formation = self.membership.plan()
        if formation is None:
            return False
        address = GroupAddress(
            self.host, self.store_port, formation.world_size, formation.group_name, self.backend, self.timeout_s
        )
        for serve, rank in zip(formation.serves, formation.ranks, strict=True):
            self.control.send(
                serve.identity,
                JoinGroup(
                    host=address.host,
                    port=address.port,
                    rank=rank,
                    group_name=address.group_name,
                    world_size=address.world_size,
                    backend=address.backend,
                    timeout_s=self.timeout_s,
                ),
            )
        result: dict = {}
        thread = threading.Thread(target=_form, args=(address, self.store, result), daemon=True)
        thread.start()
        while thread.is_alive():  # the serves' Joined (and any Hello) arrive while the rendezvous runs
            self.pump(0.05)
        if "group" in result:
            self.group = result["group"]  # closed again by the settle's BreakGroup if a member was replaced meanwhile
        formed, actions = self.membership.settle(formation, "group" in result, result.get("error"))
        self._perform(actions)
        return formed

    def _wait_for_commits(self, version: int) -> None:
        """Until every member has answered the update of `version` (a serve applies one update at a time)."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            waiting = self.membership.uncommitted(version)
            if not waiting:
                return
            self.pump(0.02)
        log.error(
            "serves %s did not report the commit of v%d within %.0fs",
            [s.server_id for s in waiting],
            version,
            self.timeout_s,
        )

    def _drop_quiet_serves(self, version: int, error: Exception) -> list[str]:
        """After a failed broadcast: listen for `quiet_after_s`, then drop the serves that sent nothing meanwhile (or
        whose connection is gone) and break the group; their server ids."""
        self.pump(0)  # drain what was queued before the failure
        start = time.monotonic()
        while time.monotonic() - start < self.quiet_after_s:
            self.pump(0.05)
        probe = Progress(version=-1, groups_consumed=0)  # harmless to a live serve; fails fast to a vanished one
        gone = {s.identity for s in self.membership.heard_since(start) if not self.control.send(s.identity, probe)}
        dead, actions = self.membership.drop_quiet(start, gone)
        log.error("publishing v%d failed (%s); dropping serves that went quiet: %s", version, error, dead)
        self._perform(actions)
        return dead

    # -- publishing ---------------------------------------------------------------------------------------------
    def set_model(self, state: dict[str, torch.Tensor], contract: RunContract | None = None) -> None:
        """What this learner sends and (with `contract`) trains for; serves announcing anything else are refused at
        Hello."""
        self.expected = {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in state.items()}
        self.contract = contract

    def publish(
        self, state: dict[str, torch.Tensor], version: int, consumed: dict[str, int] | None = None, retries: int = 1
    ) -> PublishReport:
        """Send `state` as `version` to every serve (a delta when `_delta_base` allows); on a failed broadcast drop
        the dead serves and retry."""
        previous = self.latest[0] if self.latest is not None else None
        self.latest = (version, state)
        report = PublishReport(version)
        for _ in range(retries + 1):
            members = self._members_ready(previous)
            if members is None:
                return report
            served = _served(members)
            cast = {
                name: state[name].to(self.device, DTYPES[dtype]).contiguous() for name, (dtype, _) in served.items()
            }
            base = self._delta_base(version, members, cast)
            manifest, payloads = plan_update(
                cast, version, self.bucket_bytes, weights_key=self.weights_key, base=base, keep_base=self.full_every > 1
            )
            self._announce(manifest, members, served, consumed)
            try:
                stats = send_update(self.group, manifest, payloads)
            except WeightsGroupError as exc:
                report.failed += self._drop_quiet_serves(version, exc)
                continue
            self._sent = (version, cast) if self.full_every > 1 else None
            self._last_full = version if base is None else self._last_full
            report.serves, report.bytes, report.seconds = len(members), stats.bytes, stats.seconds
            report.delta = base is not None
            return report
        return report

    def _members_ready(self, previous: int | None) -> list[Serve] | None:
        """Wait until every member answered the last version sent (`previous`; not version - 1: --publish-every > 1),
        form the group if membership changed; its members, or None when there is no serve to send to."""
        self.pump(0)
        if self.group is not None and previous is not None:
            self._wait_for_commits(previous)
        return self.membership.members() if self._ensure_group() else None

    def _announce(self, manifest, members: list[Serve], served: dict, consumed: dict[str, int] | None) -> None:
        """Check `manifest` against what the serves hold, then send it to every member before any bucket moves."""
        check_against(manifest, served)
        for serve in members:
            self.control.send(
                serve.identity,
                UpdateWeights(manifest=manifest.encode(), groups_consumed=(consumed or {}).get(serve.server_id, 0)),
            )

    def _delta_base(self, version: int, members: list[Serve], cast: dict[str, torch.Tensor]):
        """(version, tensors) of the last version sent, when every member committed it and a full update is not due
        (every `full_every` versions); None: send in full."""
        if self._sent is None or version - self._last_full >= self.full_every:
            return None
        sent, tensors = self._sent
        if sent == version or any(
            s.last_update is None or not s.last_update.ok or s.last_update.version != sent for s in members
        ):
            return None  # a re-send of the same version (catch-up), a member that missed it or joined since
        if any(n not in tensors or tensors[n].dtype != t.dtype or tensors[n].shape != t.shape for n, t in cast.items()):
            return None
        return self._sent

    def publish_stream(self, tensors: Iterator, version: int, consumed: dict[str, int] | None = None) -> PublishReport:
        """Send `version` as a full update streamed from `tensors` — (name, shape, start row, rows) pieces in
        `set_model`'s order, each gathered only when reached (learner/model.py:iter_full_pieces) — through two buckets
        (inflight/wire/transfer.py:StreamSender), the checksums in the update's trailer; rank 0 never holds the model
        on the weights device. `tensors` also drives the other ranks' collective gathers: it is always exhausted,
        whatever happens here. Each tensor is also copied into `latest`, a host snapshot in the serves' dtypes
        allocated once, which `catch_up` sends to a serve that joins later. No retry: a failed broadcast drops the
        serves that went quiet, the others get the next version."""
        report, previous = PublishReport(version), self.latest[0] if self.latest is not None else None
        try:
            members = self._members_ready(previous)
            if members is None:
                self._keep_latest(tensors, version, self.expected or {})
                return report
            served = _served(members)
            order = {name: served[name] for name in (self.expected or served)}  # the learner's order, served dtypes
            manifest = plan_layout(order, version, self.bucket_bytes)
            self._announce(manifest, members, served, consumed)
            stats, error = self._stream(
                StreamSender(self.group, manifest, self.device, self.weights_key),
                tensors,
                self._snapshot(order),
                version,
            )
            if error is not None:
                report.failed += self._drop_quiet_serves(version, error)
                return report
            report.serves, report.bytes, report.seconds = len(members), stats.bytes, stats.seconds
            return report
        finally:
            for _ in tensors:  # the other ranks gather the rest whatever happened here
                pass

    def _stream(self, stream: StreamSender, tensors, snapshot: dict[str, torch.Tensor], version: int):
        """Every tensor into the stream and the snapshot, which becomes `latest` (complete even when the broadcast
        failed part-way: the serves that missed `version` get it from there); (stats, None) or (None, the error)."""
        error = None
        for name, _, start, tensor in tensors:
            source = tensor
            if error is None:
                try:  # the snapshot copies the bucket's host rows, already cast: no second trip from the device
                    source = stream.put(name, tensor, start)
                except WeightsGroupError as exc:
                    error = exc
            _copy_rows(snapshot[name], start, source)
        stats = None
        if error is None:
            try:
                stats = stream.finish()
            except WeightsGroupError as exc:
                error = exc
        else:
            stream.abandon()
        self.latest, self._sent = (version, snapshot), None
        return stats, error

    def _snapshot(self, order: dict[str, tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """The host snapshot `latest` is written into: the current one when its dtypes and shapes fit, else new."""
        held = self.latest[1] if self.latest is not None else {}
        fits = list(held) == list(order) and all(
            str(held[n].dtype).removeprefix("torch.") == d and list(held[n].shape) == s and held[n].device.type == "cpu"
            for n, (d, s) in order.items()
        )
        if fits:
            return held
        return {name: torch.empty(shape, dtype=DTYPES[dtype]) for name, (dtype, shape) in order.items()}

    def _keep_latest(self, tensors, version: int, order: dict[str, tuple[str, list[int]]]) -> None:
        """No serve to send to: still keep `version` in the snapshot, for the serve that joins next."""
        snapshot = self._snapshot(order)
        for name, _, start, tensor in tensors:
            _copy_rows(snapshot[name], start, tensor)
        self.latest = (version, snapshot)

    def catch_up(self, consumed: dict[str, int] | None = None) -> PublishReport | None:
        """If a serve joined after the latest publish, send it (and everyone) the latest weights now."""
        version = self.membership.catch_up(self.latest[0] if self.latest is not None else None)
        if version is None:
            return None
        return self.publish(self.latest[1], version, consumed)

    def close(self) -> None:
        """Wait (up to `timeout_s`) until every member serve has answered the last published update, then break the
        group: a learner that stops cleanly leaves its final weights committed on the serves, not in flight."""
        if self.group is not None and self.latest is not None:
            self._wait_for_commits(self.latest[0])
        self._break_group("learner shutting down")


def _served(members: list[Serve]) -> dict[str, tuple[str, list[int]]]:
    """Name -> (dtype, shape) of what the serves hold (all members announced the same: checked at Hello)."""
    return {t.name: (t.dtype, list(t.shape)) for t in members[0].hello.tensors}


def _copy_rows(dest: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    """`rows` into `dest` from row `start` (all of `dest` when the shapes agree)."""
    if rows.shape == dest.shape and start == 0:
        dest.copy_(rows)
    else:
        dest[start : start + rows.shape[0]].copy_(rows)


def _form(address: GroupAddress, store, result: dict) -> None:
    try:
        result["group"] = WeightsGroup(address, 0, store)
    except (WeightsGroupError, RuntimeError) as exc:
        result["error"] = str(exc)


__all__ = ["WeightPublisher", "PublishReport", "ManifestError"]
