"""The learner's side of one weight update: `RankSender`, every rank's part, and `WeightPublisher`, rank 0's — plan
it, announce it, move its buckets. Runs in the learner process (WeightPublisher on rank 0's main thread only).

Every rank (`RankSender`): a full update streams from the shards — every rank walks `learner/export.py:iter_full_pieces`
to its end in lockstep (on a sharded model its gathers are collectives) and rank 0 hands each piece to its
`WeightPublisher`, holding two buckets, not the model. An adapter (a few MB) is gathered whole to rank 0 first
(`learner/lora.py:adapter_state`). A delta (`--full-every` > 1, which compares whole tensors) walks the same pieces,
which rank 0 assembles in host memory in the serves' dtypes (`assemble_state`): the learner's device never holds the
whole model, and each tensor goes to the weights device alone to be encoded and summed. Nothing of a streamed update
is kept anywhere: a serve that joins later (a restart, a new serve, a resumed learner's first serve) is streamed the
weights again by every rank (`RankSender.catch_up`); rank 0 finds it while it waits for groups and tells the other
ranks, which wait in inflight/learn/app.py:broadcast_samples, with `order_catch_up`.

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
are dropped afterwards), and the walk goes on, so no rank is left in a gather.
Other errors are bugs and end rank 0 (torchrun then ends the others).

Delta updates (`full_every` > 1): when every member reported the commit of the previous version sent, the next update
carries only the elements that changed since it (inflight/wire/delta.py), checked by the serves against the whole
tensors' checksums; a full update goes out every `full_every` versions, after any failure, and whenever a member joined
or missed one. The cast tensors of the last version sent stay here as the base (one copy in the serves' dtype, in
host memory when assembled there).

A serve that dies mid-transfer breaks the broadcast within the group's timeout: the control plane drops the serves
that went quiet and a whole-state publish sends the same version again to the rest. A serve that (re)joins late is sent
the weights at once: after a whole-state publish, the state kept (`latest`, inflight/learn/snapshot.py) by `catch_up`;
after a streamed one nothing is kept (no rank holds a copy of the model for late joiners): every learner rank streams
its weights again (`RankSender.catch_up`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from inflight.learn.admission import ServeCheck, TensorLayout
from inflight.learn.control import ControlPlane
from inflight.learn.membership import Send, Serve
from inflight.learn.rendezvous import GroupRendezvous
from inflight.learn.snapshot import LatestWeights
from inflight.wire.checksum import checksum_kind_for
from inflight.wire.control import Agreed, ControlServer, UpdateWeights
from inflight.wire.group import WeightsGroupError
from inflight.wire.memory import PeakMeter, trim_after_update
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
from learner.export import hf_layout, iter_full_pieces
from learner.lora import adapter_state
from learner.model import PolicyModel
from learner.world import World

log = logging.getLogger("inflight.learn")


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
    """Rows `start` .. `start + len(tensor)` of the full tensor `name` of `shape` (learner/export.py:Piece)."""

    name: str
    shape: torch.Size
    start: int
    tensor: torch.Tensor


@dataclass
class StreamOutcome:
    """What became of one streamed update: `stats` when every bucket and the trailer went out, else `error`."""

    version: int
    serves: int
    stats: TransferStats | None = None
    error: WeightsGroupError | None = None


class StreamedUpdate:
    """One version on its way into `sender` (None when there is no serve to send to); `serves` members were sent the
    manifest. Nothing is kept: each piece is cast into a bucket and the learner's next piece may reuse its memory."""

    def __init__(self, version: int, serves: int, sender: StreamSender | None):
        self.version, self.serves, self.sender = version, serves, sender
        self.error: WeightsGroupError | None = None

    def put(self, piece: WeightPiece) -> None:
        """The next piece, in manifest order, into the stream while it is healthy (never raises a broadcast error)."""
        if self.sender is not None and self.error is None:
            try:
                self.sender.put(piece.name, piece.tensor, piece.start)
            except WeightsGroupError as exc:
                self.error = exc

    def finish(self) -> StreamOutcome:
        """The trailer after the last bucket (or, after a failure, nothing more sent); the outcome."""
        outcome = StreamOutcome(self.version, self.serves, error=self.error)
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
            cast = {n: _cast(state[n], DTYPES[dtype], self.device) for n, (dtype, _) in served.items()}
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
                device=self.device,
            )
            self._announce(manifest, members, served)
            try:
                stats = send_update(self.plane.group, manifest, payloads, device=self.device)
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
        piece (`StreamedUpdate.put`), then `finish_stream`. With no serve it sends nothing (the version is still the
        latest: the first serve to join is streamed the weights then)."""
        members = self._members_ready(self.latest.version)
        if not members:
            return StreamedUpdate(version, 0, None)
        served = _served(members)
        layout = {name: served[name] for name in (self.check.expected or served)}  # the learner's order, serve dtypes
        manifest = plan_layout(layout, version, self.bucket_bytes, self.sums)
        self._announce(manifest, members, served)
        sender = StreamSender(self.plane.group, manifest, self.device, self.weights_key)
        return StreamedUpdate(version, len(members), sender)

    def finish_stream(self, update: StreamedUpdate) -> PublishReport:
        """The trailer sent; the version becomes `latest`, its tensors not kept (the serves that missed it are streamed
        the weights when they rejoin: `catch_up`). No retry: a failed broadcast drops the serves that went quiet, the
        others get the next version."""
        outcome = update.finish()
        self.latest.keep(outcome.version, {})
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

    def catch_up(self, stream: Callable[[], object]) -> None:
        """If a serve joined after the latest publish, send it (and everyone) the latest weights now: the state a
        whole-state publish kept, else `stream()`, by which every learner rank streams its weights again (collective
        on a sharded model: `RankSender.catch_up` tells the other ranks first)."""
        version = self.plane.membership.catch_up(self.latest.version)
        if version is not None and self.latest.tensors:
            self.publish(self.latest.tensors, version)
        elif version is not None:
            stream()

    def close(self) -> None:
        """Wait (up to the plane's `timeout_s`) until every member has answered the last published update, then break
        the group: a learner that stops cleanly leaves its final weights committed on the serves, not in flight."""
        if self.plane.group is not None and self.latest.version is not None:
            self.plane.wait_for_commits(self.latest.version)
        self.plane.break_group("learner shutting down")

    def served_dtypes(self) -> dict[str, torch.dtype]:
        """Name -> the dtype the accepted serves hold (all announced the same: checked at Hello); {} before any."""
        serves = list(self.plane.membership.serves.values())
        return {t.name: DTYPES[t.dtype] for t in serves[0].hello.tensors} if serves else {}

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


def _cast(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`t` in the serves' `dtype`: on the weights `device`, unless it is in host memory (a delta's assembled state,
    `assemble_state`), where it stays: `plan_update` takes each tensor to the device alone."""
    return t.to(dtype).contiguous() if t.device.type == "cpu" else t.to(device, dtype).contiguous()


def _served(members: list[Serve]) -> TensorLayout:
    """Name -> (dtype, shape) of what the serves hold (all members announced the same: checked at Hello)."""
    return {t.name: (t.dtype, list(t.shape)) for t in members[0].hello.tensors}


CATCH_UP = -1  # broadcast where a batch's size goes: every rank streams its weights to a late serve, then waits again


class RankSender:
    """One rank's sending of `model`: streamed, unless it is an adapter (gathered whole: a few MB) or `full_every` > 1
    (deltas: rank 0 assembles each version in host memory from the same pieces, `assemble_state`). `publisher` is rank
    0's (set once its service is up), None on the other ranks."""

    def __init__(self, model: PolicyModel, world: World, adapter: bool, full_every: int, bucket_bytes: int = 64 << 20):
        self.model, self.world, self.adapter = model, world, adapter
        self.piece_bytes = piece_bytes(bucket_bytes)
        self.assembles = not adapter and full_every > 1
        self.publisher: WeightPublisher | None = None

    def service_state(self) -> dict[str, torch.Tensor]:
        """What rank 0's service checks serves against: the layout alone (meta tensors, nothing gathered) for the
        model's weights, which a serve joining a resumed learner is then streamed (`catch_up`); an adapter's state,
        which the whole-state publisher also sends such a serve (collective: every rank calls it)."""
        return adapter_state(self.model) if self.adapter else hf_layout(self.model)

    def publish(self, version: int) -> dict:
        """Every rank: send the weights as `version`; rank 0's StepMetrics `publish_*` fields ({} elsewhere), with its
        peak extra memory when streamed or assembled."""
        start = time.perf_counter()
        if self.adapter:
            state = adapter_state(self.model)  # collective: every rank gathers, rank 0 keeps the tensors
            return published_fields(self.publisher.publish(state, version), start) if self.world.rank == 0 else {}
        if self.world.rank != 0:
            return stream_weights(self.model, self.world, None, version, self.piece_bytes) or {}
        # A CUDA learner over gloo: the buckets are in host memory, the gathered pieces on its GPU; both are measured.
        own = self.world.device if self.world.device != self.world.weights_device else None
        with PeakMeter(self.world.weights_device) as peak, PeakMeter(own) if own else nullcontext() as on_gpu:
            if self.assembles:  # the host copy is counted where the weights device is the host
                state = assemble_state(iter_full_pieces(self.model, self.piece_bytes), self.publisher.served_dtypes())
                report = self.publisher.publish(state, version)
            else:
                report = stream_weights(self.model, self.world, self.publisher, version, self.piece_bytes)
        fields = published_fields(report, start)
        fields["publish_peak_bytes"] = peak.extra_bytes if peak.measured else None
        if on_gpu is not None and on_gpu.measured:
            fields["publish_device_peak_bytes"] = on_gpu.extra_bytes
        return fields

    def catch_up(self, version: int) -> None:
        """Every rank: stream the current weights as `version` to a serve that joined after the latest streamed
        publish. Rank 0 calls it from its wait for groups and tells the other ranks first (`order_catch_up`)."""
        if self.world.rank == 0:
            order_catch_up(self.world)
        if report := stream_weights(self.model, self.world, self.publisher, version, self.piece_bytes):
            log.info("caught up: v%d streamed to %d serve(s), %d bytes", report.version, report.serves, report.bytes)


def assemble_state(pieces: Iterable[WeightPiece], dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Rank 0: the whole state in host memory from `pieces` (`iter_full_pieces`: each tensor's rows in order), each
    tensor in its `dtypes` entry (the serves' dtype; the piece's own where absent). What a delta compares with the last
    version sent, never whole on the learner's device: there it holds one piece at a time, as a streamed update."""
    state: dict[str, torch.Tensor] = {}
    for piece in pieces:
        whole = state.get(piece.name)
        if whole is None:
            dtype = dtypes.get(piece.name, piece.tensor.dtype)
            whole = state[piece.name] = torch.empty(piece.shape, dtype=dtype, device="cpu")
        rows = piece.tensor.shape[0] if piece.tensor.dim() else 1
        (whole[piece.start : piece.start + rows] if whole.dim() else whole).copy_(piece.tensor)
    return state


def piece_bytes(bucket_bytes: int) -> int:
    """The largest block of another rank's rows rank 0 takes at once while streaming: a bucket, at most 16 MiB (more
    blocks, not more memory, past that), so its peak is counted in buckets."""
    return min(bucket_bytes, 16 << 20)


def stream_weights(
    model: PolicyModel, world: World, publisher: WeightPublisher | None, version: int, piece_bytes: int = 16 << 20
) -> PublishReport | None:
    """Every rank walks `iter_full_pieces` to its end in lockstep (blocks of `piece_bytes`, the same on every rank);
    rank 0 streams each piece as `version`: a report."""
    pieces = iter_full_pieces(model, piece_bytes)
    if world.rank == 0:
        return publisher.publish_stream(pieces, version)
    for _ in pieces:  # this rank's part of each gather; rank 0 gets the pieces
        pass
    return None


def order_catch_up(world: World) -> None:
    """Rank 0: tell every other rank, waiting in `broadcast_samples`, to stream its weights now. A no-op alone."""
    if world.size > 1:
        dist.broadcast(torch.tensor([CATCH_UP], dtype=torch.int64, device=world.device), 0)


def published_fields(report: PublishReport, started: float) -> dict:
    """A publish's StepMetrics `publish_*` fields, `publish_s` counted from `started` (a `time.perf_counter()` reading
    taken before the weights were gathered); the freed buckets go back to the OS first."""
    trim_after_update()  # INFLIGHT_TRIM_EVERY_S
    return report.fields(time.perf_counter() - started)


__all__ = ["WeightPublisher", "PublishReport", "ManifestError", "open_publisher"]
