"""WeightPublisher: learner rank 0's side of one weight update — plan it, announce it, move its buckets.

Flow (docs/ARCHITECTURE.md "The weight path"), one way: the control plane (inflight/learn/control.py:ControlPlane)
says who the members are, forming the group first when membership changed; the publisher casts or streams the tensors
to the serves' dtypes, plans the buckets, sends the manifest to every member (`UpdateWeights`), broadcasts the buckets
and returns without waiting for the commits: their `UpdateDone`s reach the control plane while training goes on.

Two ways to send a version. `publish` takes the whole state (needed for a delta, which compares whole tensors) and
packs it with `inflight/wire/transfer.py:send_update`. `begin_stream` / `StreamedUpdate.put` / `finish_stream` send
a full update piece by piece as the learner's ranks gather it, through two reused buckets; rank 0 never holds the
model on the weights device.

Contract of a streamed publish (every learner rank, in lockstep, or the ranks deadlock): every rank walks
`learner/export.py:iter_full_pieces` to its end, in the same order — on a sharded model each piece is a collective
gather — and rank 0 hands each piece to `StreamedUpdate.put` as it comes, then calls `finish_stream`. `put` never
raises a broadcast error: a broadcast that fails part-way only stops the sending (the serves that missed the version
are dropped afterwards), the pieces still go into the snapshot and the walk goes on, so no rank is left in a gather.
Other errors are bugs and end rank 0 (torchrun then ends the others).

Delta updates (`full_every` > 1): when every member reported the commit of the previous version sent, the next update
carries only the elements that changed since it (inflight/wire/delta.py), checked by the serves against the whole
tensors' checksums; a full update goes out every `full_every` versions, after any failure, and whenever a member joined
or missed one. The cast tensors of the last version sent stay here as the base (one copy in the serves' dtype).

A serve that dies mid-transfer breaks the broadcast within the group's timeout: the control plane drops the serves
that went quiet and a whole-state publish sends the same version again to the rest. A serve that (re)joins late gets
the latest weights (`latest`, inflight/learn/snapshot.py) from `catch_up`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from inflight.learn.admission import ServeCheck, TensorLayout
from inflight.learn.control import ControlPlane
from inflight.learn.membership import Send, Serve
from inflight.learn.rendezvous import GroupRendezvous
from inflight.learn.snapshot import LatestWeights
from inflight.wire.checksum import checksum_kind_for
from inflight.wire.control import Agreed, ControlServer, UpdateWeights
from inflight.wire.group import WeightsGroupError
from inflight.wire.transfer import StreamSender, TransferStats, send_update
from inflight.wire.weights import (
    DTYPES,
    AdapterSpec,
    ManifestError,
    UpdateManifest,
    check_against,
    plan_layout,
    plan_update,
)


@dataclass
class PublishReport:
    """One publish: the serves the update went to, the bytes broadcast and the broadcast's seconds; `failed` the
    server ids dropped because a broadcast failed on them."""

    version: int
    serves: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)
    delta: bool = False  # sent as a delta on the previous version sent

    def fields(self, seconds: float) -> dict:
        """The StepMetrics `publish_*` fields: `seconds` the whole publish, the rate over the broadcast alone."""
        return {
            "publish_s": seconds,
            "publish_bytes": self.bytes,
            "publish_serves": self.serves,
            "publish_bytes_per_s": self.bytes / self.seconds if self.seconds else 0.0,
            "publish_failed": self.failed,
            "publish_delta": self.delta,
        }


@dataclass
class DeltaBase:
    """The last version broadcast, cast to the serves' dtypes, kept while deltas are on (`full_every` > 1)."""

    full_every: int = 1
    version: int | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    last_full: int = 0  # the version of the last full update broadcast

    def base_for(
        self, version: int, members: list[Serve], cast: Mapping[str, torch.Tensor]
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(version, tensors) to send `version` as a delta on, or None: in full. A delta needs every member to have
        committed exactly the last version sent, no full update due (every `full_every` versions) and the same
        names, dtypes and shapes."""
        sent, held = self.version, self.tensors
        if sent is None or sent == version or version - self.last_full >= self.full_every:
            return None  # nothing sent yet, a re-send of the same version (catch-up), or a full update is due
        if any(s.last_update is None or not s.last_update.ok or s.last_update.version != sent for s in members):
            return None  # a member that missed it, failed it or joined since
        if any(n not in held or held[n].dtype != t.dtype or held[n].shape != t.shape for n, t in cast.items()):
            return None
        return sent, held

    def sent(self, version: int, cast: dict[str, torch.Tensor], delta: bool) -> None:
        """`version` went out (as a delta when `delta`): the base of the next one when deltas are on."""
        self.version, self.tensors = (version, cast) if self.full_every > 1 else (None, {})
        self.last_full = self.last_full if delta else version

    def forget(self) -> None:
        """A version went out streamed (its cast tensors are not kept): the next update is full."""
        self.version, self.tensors = None, {}


class WeightPiece(Protocol):
    """Rows `start` .. `start + len(tensor)` of the full tensor `name` (learner/export.py:Piece)."""

    name: str
    start: int
    tensor: torch.Tensor


@dataclass
class StreamOutcome:
    """What became of one streamed update: `stats` when every bucket and the trailer went out, else `error`."""

    version: int
    serves: int
    snapshot: dict[str, torch.Tensor]
    stats: TransferStats | None = None
    error: WeightsGroupError | None = None


class StreamedUpdate:
    """One version on its way: into `sender` (None when there is no serve to send to) and into `snapshot`, the host
    copy in the serves' dtypes a later joiner gets. `serves` members were sent the manifest."""

    def __init__(self, version: int, serves: int, sender: StreamSender | None, snapshot: dict[str, torch.Tensor]):
        self.version, self.serves, self.sender, self.snapshot = version, serves, sender, snapshot
        self.error: WeightsGroupError | None = None
        self.copying = False  # device-to-host copies into the (pinned) snapshot still queued on the current stream

    def put(self, piece: WeightPiece) -> None:
        """The next piece, in manifest order, into the stream (while it is healthy) and the snapshot."""
        source = piece.tensor
        if self.sender is not None and self.error is None:
            try:  # the snapshot copies the bucket's host rows, already cast: no second trip from the device
                source = self.sender.put(piece.name, piece.tensor, piece.start)
            except WeightsGroupError as exc:
                self.error = exc
        dest = self.snapshot[piece.name]
        # Pinned: queued, not waited for (the bucket is refilled two buckets later on this same stream, after it).
        asynchronous = source.is_cuda and dest.is_pinned()
        copy_rows(dest, piece.start, source, non_blocking=asynchronous)
        self.copying |= asynchronous

    def finish(self) -> StreamOutcome:
        """The trailer after the last bucket (or, after a failure, nothing more sent); the outcome."""
        if self.copying:  # the snapshot is read (a late serve's catch-up) only once every copy has landed
            torch.cuda.current_stream().synchronize()
        outcome = StreamOutcome(self.version, self.serves, self.snapshot, error=self.error)
        if self.sender is None:
            return outcome
        if self.error is not None:
            self.sender.abandon()
            return outcome
        try:
            outcome.stats = self.sender.finish()
        except WeightsGroupError as exc:
            outcome.error = exc
        return outcome


class WeightPublisher:
    """Rank 0's updates to the members of `plane`'s weights group. `check` knows what the learner sends (its order
    and dtypes); `device`: where the buckets are packed and sent from — the learner's GPU for NCCL, host memory for
    gloo (`learner/world.py:World.weights_device`); `weights_key` (from --secret-file,
    inflight/wire/secure.py:weights_key): tag every tensor with it instead of a CRC32; `full_every` (--full-every): a
    full update every that many versions, deltas between; `consumed`: the groups trained of each serve's rollouts so far
    (a live view: `UpdateWeights.groups_consumed`). Rank 0's main thread only."""

    def __init__(
        self,
        plane: ControlPlane,
        check: ServeCheck,
        device: torch.device | str = "cpu",
        bucket_bytes: int = 64 << 20,
        weights_key: bytes | None = None,
        full_every: int = 1,
        adapter: AdapterSpec | None = None,
        consumed: Mapping[str, int] | None = None,
    ):
        self.plane, self.check, self.device = plane, check, torch.device(device)
        self.consumed: Mapping[str, int] = consumed if consumed is not None else {}
        self.adapter = adapter  # LoRA: every update is of this adapter, always whole (the serves check it)
        self.bucket_bytes, self.weights_key = bucket_bytes, weights_key
        self.sums = checksum_kind_for(self.device)  # where the buckets are: a GPU's are summed there, not copied out
        self.latest = LatestWeights()
        self.deltas = DeltaBase(full_every)
        plane.membership.agreed = Agreed(full_every=full_every)  # told to a serve that asks: its plan counts deltas

    def publish(self, state: Mapping[str, torch.Tensor], version: int, retries: int = 1) -> PublishReport:
        """Send the whole `state` as `version` to every member (a delta when `DeltaBase.base_for` allows); after a
        failed broadcast the control plane drops the serves that went quiet and the rest get the same version again."""
        previous = self.latest.version
        self.latest.keep(version, dict(state))
        report = PublishReport(version)
        for _ in range(retries + 1):
            members = self._members_ready(previous)
            if not members:
                return report
            served = _served(members)
            cast = {n: state[n].to(self.device, DTYPES[dtype]).contiguous() for n, (dtype, _) in served.items()}
            base = self.deltas.base_for(version, members, cast) if self.adapter is None else None
            keep_base = self.deltas.full_every > 1 and self.adapter is None
            manifest, payloads = plan_update(
                cast,
                version,
                self.bucket_bytes,
                weights_key=self.weights_key,
                base=base,
                keep_base=keep_base,
                checksum_kind=self.sums,
                adapter=self.adapter,
            )
            self._announce(manifest, members, served)
            try:
                stats = send_update(self.plane.group, manifest, payloads)
            except WeightsGroupError as exc:
                report.failed += self.plane.drop_quiet_serves(version, exc)
                continue
            self.deltas.sent(version, cast, base is not None)
            report.serves, report.bytes, report.seconds = len(members), stats.bytes, stats.seconds
            report.delta = base is not None
            return report
        return report

    def begin_stream(self, version: int) -> StreamedUpdate:
        """Start sending `version` as a full update streamed in the learner's order (`check.expected`): the members
        ready, the manifest planned from names, dtypes and shapes alone (`plan_layout`) and announced. Feed it every
        piece (`StreamedUpdate.put`), then `finish_stream`. With no serve it only fills the snapshot."""
        members = self._members_ready(self.latest.version)
        if not members:
            layout = self.check.expected or {}
            return StreamedUpdate(version, 0, None, self.latest.writable(layout))
        served = _served(members)
        layout = {name: served[name] for name in (self.check.expected or served)}  # the learner's order, serve dtypes
        manifest = plan_layout(layout, version, self.bucket_bytes, self.sums)
        self._announce(manifest, members, served)
        sender = StreamSender(self.plane.group, manifest, self.device, self.weights_key)
        return StreamedUpdate(version, len(members), sender, self.latest.writable(layout))

    def finish_stream(self, update: StreamedUpdate) -> PublishReport:
        """The trailer sent; the snapshot becomes `latest` (complete even when the broadcast failed part-way: the serves
        that missed the version get it from there). No retry: a failed broadcast drops the serves that went quiet, the
        others get the next version."""
        outcome = update.finish()
        self.latest.keep(outcome.version, outcome.snapshot)
        self.deltas.forget()
        report = PublishReport(outcome.version)
        if outcome.error is not None:
            report.failed += self.plane.drop_quiet_serves(outcome.version, outcome.error)
        elif outcome.stats is not None:
            report.serves, report.bytes, report.seconds = outcome.serves, outcome.stats.bytes, outcome.stats.seconds
        return report

    def publish_stream(self, pieces: Iterable[WeightPiece], version: int) -> PublishReport:
        """Rank 0's whole streamed publish: `begin_stream`, every piece of `pieces` put in (walked to its end whatever
        the broadcast does: on the other ranks each piece is a collective gather), `finish_stream`."""
        update = self.begin_stream(version)
        for piece in pieces:
            update.put(piece)
        return self.finish_stream(update)

    def catch_up(self) -> PublishReport | None:
        """If a serve joined after the latest publish, send it (and everyone) the latest weights now."""
        version = self.plane.membership.catch_up(self.latest.version)
        if version is None:
            return None
        return self.publish(self.latest.tensors, version)

    def close(self) -> None:
        """Wait (up to the plane's `timeout_s`) until every member has answered the last published update, then break
        the group: a learner that stops cleanly leaves its final weights committed on the serves, not in flight."""
        if self.plane.group is not None and self.latest.version is not None:
            self.plane.wait_for_commits(self.latest.version)
        self.plane.break_group("learner shutting down")

    def _members_ready(self, previous: int | None) -> list[Serve]:
        """The members, once every one answered the last version sent (`previous`; not version - 1: --publish-every
        > 1) and the group is formed with every accepted serve; [] when there is no serve to send to."""
        self.plane.pump(0)  # what arrived since the service's loop last read: the commits and Hellos decided on here
        if self.plane.group is not None and previous is not None:
            self.plane.wait_for_commits(previous)
        return self.plane.ensure_group()

    def _announce(self, manifest: UpdateManifest, members: list[Serve], served: TensorLayout) -> None:
        """Check `manifest` against what the serves hold, then send it to every member before any bucket moves."""
        check_against(manifest, served)
        encoded = manifest.encode()
        consumed = self.consumed
        self.plane.perform(
            [
                Send(s.identity, UpdateWeights(manifest=encoded, groups_consumed=consumed.get(s.server_id, 0)))
                for s in members
            ]
        )


def open_publisher(
    control: ControlServer,
    host: str = "127.0.0.1",
    store_port: int = 0,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    quiet_after_s: float = 3.0,
    **options,
) -> WeightPublisher:
    """A publisher over `control` with its own weights store on `host:store_port` and serve check; `options` are
    WeightPublisher's (device, bucket_bytes, weights_key, full_every). The check's `set_model` says what it sends."""
    check = ServeCheck()
    rendezvous = GroupRendezvous(host, store_port, backend, timeout_s)
    plane = ControlPlane(control, rendezvous, check, timeout_s, quiet_after_s)
    return WeightPublisher(plane, check, **options)


def copy_rows(dest: torch.Tensor, start: int, rows: torch.Tensor, non_blocking: bool = False) -> None:
    """`rows` into `dest` from row `start` (all of `dest` when the shapes agree)."""
    if rows.shape == dest.shape and start == 0:
        dest.copy_(rows, non_blocking=non_blocking)
    else:
        dest[start : start + rows.shape[0]].copy_(rows, non_blocking=non_blocking)


def _served(members: list[Serve]) -> TensorLayout:
    """Name -> (dtype, shape) of what the serves hold (all members announced the same: checked at Hello)."""
    return {t.name: (t.dtype, list(t.shape)) for t in members[0].hello.tensors}


__all__ = ["WeightPublisher", "PublishReport", "ManifestError", "open_publisher"]
