"""StagedUpdate: one weight update being received, off the engine thread, into buffers outside the model.

Owned by the worker's update state (vllm_patches/worker_extension.py). `start()` returns at once; a daemon thread
receives every bucket over the weights group, then views and verifies every tensor (size, and its CRC32 or, with a
secret, its keyed tag) and, when the engine swaps prepared weights (`--update-memory double`), has the `prepare`
collaborator it was handed load and process them into vLLM's kernel layout. Forward passes keep running the whole time
because nothing here touches the live parameters; only vllm_patches/commit.py does, between two engine steps. The
thread's last act is to hand its final status to its `on_finished` listener: in a serve, the worker's `StagedNotifier`,
which pushes it to the engine (the engine never asks).

On a CUDA device the buckets are allocated and received, and the prepared layers built, on the worker's one staging
stream (`staging_stream`, kept across updates so the caching allocator reuses its blocks), so the transfer (NCCL's
broadcast, or gloo's host-to-device copies) and the preparation queue behind nothing the engine runs and the engine's
kernels queue behind nothing of them. One event is recorded there once everything is staged;
`ready_on_current_stream()`, called by both commit paths, makes the engine's current stream wait on it (an event, not
a host synchronisation) and records every tensor handed across on that stream (`Tensor.record_stream`).

Where an update is staged: the worker's device arena (`arenas`, vllm_patches/arenas.py:StagingArenas), one buffer
sized by the staging plan, made once and reused by every update. Before a bucket moves the thread lays the whole
update out in it — every bucket and the trailer, or a tensor-parallel rank's receive buffer and kept slices, and a
delta's decoded tensors — and an update that would not fit is refused then (`ArenaFull`): its broadcasts are drained
through the arena so the weights group stays in step, the stage fails naming both sizes, and nothing else was
allocated (on CUDA an allocation that fails empties the caching allocator, the engine's cached blocks with it).

What the worker keeps of an update after its commit (`kept`: the in-place path's rollback source, a delta's base)
stays in the device arena until the next update begins; that update's staging thread first copies it into the host
arena (pinned on CUDA, one buffer of the plan's bytes), off the engine thread and only once every rank kept it, then
receives over it. Without arenas (the wire's own tests and benchmarks) every bucket is a fresh allocation.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Literal, Protocol

import msgspec
import torch
import zmq

from inflight.wire.group import WeightsGroup
from inflight.wire.transfer import drain_update, receive_kept, receive_update, update_buffers
from inflight.wire.weights import DTYPES, ManifestError, UpdateManifest, unpack_buckets
from vllm_patches.arenas import (
    ArenaFull,
    ArenaTail,
    BesideBaseTail,
    DeviceArena,
    ReusingTail,
    StagingArenas,
    arena_offsets,
)
from vllm_patches.cores import leave_the_engines_core
from vllm_patches.device_plan import weight_sizes
from vllm_patches.rpc import StagedSignal, StageStatus

if TYPE_CHECKING:  # prepared.py imports vLLM's loaders (~15 s): the wire's tests and benchmarks stage without them
    from vllm_patches.placement import SliceLayout
    from vllm_patches.prepared import PreparedWeights

log = logging.getLogger(__name__)

# Where layers prepared to be copied in are made (StagedUpdate's `tail`, None: a swap's, where the allocator puts them).
Tail = Literal["beside", "beside-base", "over"]


class StageState(str, Enum):
    RECEIVING = "receiving"
    STAGED = "staged"
    FAILED = "failed"
    COMMITTED = "committed"


@dataclass
class HeldTensors:
    """The whole tensors of the version a worker serves, kept after a commit: the in-place path's rollback source and
    the base a delta update (`manifest.base_version`) is applied to."""

    version: int
    tensors: dict[str, torch.Tensor]
    layout: SliceLayout | None = None  # a tensor-parallel rank's: `tensors` are its slices (`carriers` restores shapes)
    kernel: bool = False  # `tensors` are the live parameters' kernel-format tensors, by vLLM's names (`low`'s copies)


class PrepareUpdate(Protocol):
    """Builds the processed weights of one update from its verified tensors (vllm_patches/prepared.py:ShadowPreparer),
    on the staging thread, without touching the live model."""

    def __call__(self, tensors: dict[str, torch.Tensor], tail: ArenaTail | None = None) -> PreparedWeights: ...


@functools.cache
def staging_stream(device: str) -> torch.cuda.Stream | None:
    """The worker's one staging stream on a CUDA `device` (None elsewhere), made once and kept: a new stream per
    update would defeat the caching allocator's per-stream reuse of the buckets' memory across updates."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


class StagedUpdate:
    """Receives `manifest`'s buckets from `group` on a background thread and holds the verified tensors."""

    def __init__(
        self,
        manifest: UpdateManifest,
        group: WeightsGroup,
        device: torch.device | str = "cpu",
        weights_key: bytes | None = None,
        prepare: PrepareUpdate | None = None,
        held: HeldTensors | None = None,
        on_finished: Callable[[StageStatus], None] | None = None,
        layout: SliceLayout | None = None,
        arenas: StagingArenas | None = None,
        tail: Tail | None = None,
    ):
        """`weights_key`: verify every tensor's keyed tag under it (a serve with --secret-file), not its CRC32.
        `prepare`: also build the processed weights from the verified tensors on this thread (`self.prepared`), then
        release the tensors unless the manifest says `keep_base`; the update is staged only once that is done. `held`:
        the whole tensors the receiver keeps of its live version, what a delta update is applied to (a delta on
        anything else fails the stage, naming both versions), moved into the host arena first. `on_finished`: handed
        the final status (staged or failed) once, by this thread (the worker's `StagedNotifier.announce`). `layout`:
        keep only this rank's slices (vllm_patches/placement.py). `arenas`: stage within the worker's device arena.
        `tail` (`Tail`): where the layers the commit copies in (commit.py) are prepared: "beside" the staged tensors,
        kept (`double`'s copy commit; `low`'s "beside-base" for an update a delta may follow: its base), or "over"
        them (`low`'s copies, kept instead); None: where the allocator puts them (a swap's, which go live)."""
        self.manifest, self.group, self.device, self.weights_key = manifest, group, device, weights_key
        self.held, self.on_finished, self.layout, self.arenas = held, on_finished, layout, arenas
        self.base = held if manifest.is_delta else None
        self.prepare, self.prepared, self.prepare_s, self.tail = prepare, None, 0.0, tail
        self.state, self.error, self.failed_with = StageState.RECEIVING, None, None  # set when the stage fails
        self.tensors: dict[str, torch.Tensor] = {}
        self.refused = False  # the update did not fit the device arena (ArenaFull): refused before any bucket
        self.bytes_received = self.bytes_kept = 0  # kept: what this rank staged (its slices, with a layout)
        self.whole: list[str] = []  # without a layout on a split engine: the tensors staged whole, for the report
        self.started = time.perf_counter()
        self.started_at = time.time()  # wall clock, comparable with the client's token timestamps
        self.staged_at = self.receive_s = self.verify_s = 0.0
        self._done = threading.Event()
        self._ready: torch.cuda.Event | None = None  # CUDA: recorded on the side stream once everything is staged
        self._buckets: list[torch.Tensor] = []
        self._thread = threading.Thread(target=self._run, name=f"inflight-stage-v{manifest.version}", daemon=True)

    def start(self) -> StagedUpdate:
        self._thread.start()
        return self

    def _count(self, index: int, nbytes: int) -> None:
        self.bytes_received += nbytes
        if RECEIVE_STALL_HOOK is not None:
            RECEIVE_STALL_HOOK(index, self.manifest.version)

    def _run(self) -> None:
        leave_the_engines_core()
        try:
            side = staging_stream(str(self.device))
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                into = stage_in_arenas(self, side) if self.arenas is not None else None
                self._receive_and_verify(side, into)
                self.bytes_kept = sum(t.nbytes for t in self.tensors.values())
                if self.prepare is not None:  # on the side stream too: its kernels queue there
                    self.prepared = self.prepare(self.tensors, arena_tail(self))
                    self.tensors = self.tensors if self.keeps_tensors and self.tail != "over" else {}
                    self.prepare_s = time.perf_counter() - self.started - self.receive_s - self.verify_s
                if side is not None:
                    self._ready = torch.cuda.Event()
                    self._ready.record(side)  # the commit's stream waits on this: everything staged, prepared too
            self.staged_at = time.time()
            self.state = StageState.STAGED
        except Exception as exc:  # any failure must surface as a status, never kill the worker
            self.refused, self.failed_with = isinstance(exc, ArenaFull), type(exc)
            self.error = f"{type(exc).__name__}: {exc}"
            self.tensors = {}
            self.state = StageState.FAILED
        finally:
            self._announce()
            self._done.set()

    def _receive_and_verify(self, side: torch.cuda.Stream | None, into: dict[str, torch.Tensor] | None) -> None:
        # the base a delta applies to (CUDA: the host arena's), dropped here: a delta's new tensors are copies
        base, self.base = (None if self.base is None else (self.base.version, self.base.tensors)), None
        if self.layout is not None:  # slices of verified tensors (a delta: decoded onto the rank's own), no bucket
            keep, key = self.layout.keep, self.weights_key
            kept_into = None if into is None else (into.pop("buffer"), into)
            group, manifest, count = self.group, self.manifest, self._count
            self.tensors = receive_kept(group, manifest, keep, self.device, count, key, kept_into, base)
            self.receive_s = time.perf_counter() - self.started
            return
        buffers = None if into is None else [into.pop(f"buffer {i}") for i in range(len(update_buffers(self.manifest)))]
        buckets = receive_update(self.group, self.manifest, self.device, on_bucket=self._count, into=buffers)
        if side is not None:
            side.synchronize()  # receive_s is the transfer's, not the time to queue it
            self._buckets = buckets if self.prepare is None else []  # prepared: the views go with the tensors
        self.receive_s = time.perf_counter() - self.started
        self.tensors = unpack_buckets(
            self.manifest, buckets, verify=True, weights_key=self.weights_key, base=base, decoded_into=into
        )
        self.verify_s = time.perf_counter() - self.started - self.receive_s

    def _announce(self) -> None:
        if self.on_finished is None:
            return
        try:
            self.on_finished(self.status())
        except Exception:  # the engine then times out on this update, naming it; the worker must not die of it
            log.exception("could not signal the end of staging v%d to the engine", self.manifest.version)

    @property
    def keeps_tensors(self) -> bool:
        """Whether the worker keeps this update's tensors (a rank's slices, or the copies prepared "over" them) once
        committed: always in place (the rollback source, prepared and copied in too: any `tail`), and when a delta
        may follow (`keep_base`)."""
        return self.prepare is None or self.manifest.keep_base or self.tail is not None

    def kept(self) -> dict[str, torch.Tensor]:
        """The whole tensors (or slices) to keep after the commit: the verified tensors themselves, or with
        `tail` "over" the kernel-format tensors the commit copied in (commit.py sets them), in the device arena until
        the next update moves them to the host arena."""
        return self.tensors

    def release(self) -> None:
        """Drop the references to the staged buffers once committed (what is kept is `kept()`'s, held by the caller)."""
        self.tensors, self._buckets = {}, []

    def ready_on_current_stream(self) -> None:
        """Make the caller's current CUDA stream (the engine's, at commit) wait for everything staged — the buckets
        and, with `double`, the prepared layers — a no-op on CPU; and tell the caching allocator that stream uses
        what was allocated on the side stream, so that memory is not handed out again before the engine is done."""
        if self._ready is None:
            return
        current = torch.cuda.current_stream()
        current.wait_event(self._ready)
        for tensor in self._handed_over():
            tensor.record_stream(current)

    def _handed_over(self) -> Iterator[torch.Tensor]:
        yield from self._buckets
        yield from (t for t in self.tensors.values() if t.is_cuda)  # a delta's decoded tensors are not bucket views
        for _, attributes in self.prepared.layers if self.prepared is not None else []:
            yield from (value for value in attributes.values() if isinstance(value, torch.Tensor) and value.is_cuda)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def status(self) -> StageStatus:
        return stage_status(self)


def held_after(stage: StagedUpdate, version: int) -> HeldTensors | None:
    """What the worker keeps of `version`, `stage`'s update, once committed (`StagedUpdate.kept`), if anything."""
    if not stage.keeps_tensors:
        return None
    reuse = stage.tail == "over"  # the kernel-format copies, not the staged tensors
    return HeldTensors(version, stage.kept(), None if reuse else stage.layout, kernel=reuse)


def stage_status(stage: StagedUpdate) -> StageStatus:
    """Where `stage` stands, as the worker reports it (`StagedUpdate.status`)."""
    return StageStatus(
        version=stage.manifest.version,
        state=stage.state.value,
        error=stage.error,
        bytes_received=stage.bytes_received,
        bytes_total=stage.manifest.total_bytes,
        receive_s=stage.receive_s,
        verify_s=stage.verify_s,
        prepare_s=stage.prepare_s,
        bytes_kept=stage.bytes_kept,
        full_tensors=stage.layout.full if stage.layout is not None else stage.whole,
        refused=stage.refused,
        started_at=stage.started_at,
        staged_at=stage.staged_at,
    )


def arena_tail(stage: StagedUpdate) -> ArenaTail | None:
    """Where `stage`'s prepared layers are materialised (its `tail`): for the copy commit, the device arena beside the
    verified tensors, which are kept (the rollback source, or the next delta's base) — past the update's pieces, and
    over what was read already (a delta's payloads, the trailer); for `low`'s copies, the arena's start, over the
    staged tensors already read (`ReusingTail`); None, as usual, for a swap, whose prepared layers go live."""
    if stage.arenas is None or stage.tail is None:
        return None
    if stage.tail == "over":
        return ReusingTail(stage.arenas.staging)
    beside = BesideBaseTail if stage.tail == "beside-base" else ArenaTail
    return beside(stage.arenas.staging, 0, keep=stage.tensors.values())


def prepares_beside(arena_bytes: int, manifest: UpdateManifest, layout: SliceLayout | None) -> bool:
    """Whether `low`'s copies of an update a delta may follow (its `keep_base`) are prepared beside its tensors, kept
    as the delta's base (`BesideBaseTail`): when the worker's device arena holds those tensors twice and its largest
    layer, as `low`'s plan with deltas makes it (a delta's decoded tensors, and the room its copies keep for a kernel
    format a little larger than the checkpoint's and for the gaps a delta's payloads leave); else the update is
    reloaded in place on the engine thread, which needs no room beyond them."""
    if layout is None:
        kept = {t.name: math.prod(t.shape) * DTYPES[t.dtype].itemsize for t in manifest.tensors}
    else:  # the rank's slices
        pieces = arena_pieces(manifest, layout)
        kept = {name: t.numel() * t.element_size() for name, t in pieces.items() if name != "buffer"}
    sizes = list(kept.values())
    return arena_offsets(sizes + sizes)[1] + weight_sizes(kept).largest_layer <= arena_bytes


def stage_in_arenas(stage: StagedUpdate, side: torch.cuda.Stream | None) -> dict[str, torch.Tensor]:
    """`stage`'s place in its device arena (`lay_out_in_arena`), once the live version kept there moved to the host
    arena (ArenaFull then: nothing received, the version stays where it was). On the staging thread."""
    if stage.held is not None:  # the version every rank kept: out of the device arena before it is overwritten
        stage.held.tensors = stage.arenas.hold(stage.held.tensors)
    if side is not None:
        torch.cuda.synchronize(stage.device)  # the engine's reads of the arena (the last commit's) are done
    at_end = stage.tail == "over"  # the layers are prepared from the arena's start (`ReusingTail`)
    return lay_out_in_arena(stage.arenas.staging, stage.manifest, stage.layout, stage.group, at_end)


def lay_out_in_arena(
    arena: DeviceArena, manifest: UpdateManifest, layout: SliceLayout | None, group: WeightsGroup, at_end: bool = False
) -> dict[str, torch.Tensor]:
    """Every piece `manifest` places in `arena` (`arena_pieces`), each a view, laid out before a bucket moves (from
    the arena's start, or `at_end` ending at its end). An
    update that does not fit is refused here: ArenaFull, once its broadcasts are drained through the arena's start
    (the sender goes on as for any receiver; without it the group would break by its timeout)."""
    try:
        return arena.views(arena_pieces(manifest, layout), at_end)
    except ArenaFull:
        try:
            drain_update(group, manifest, arena.empty(max(update_buffers(manifest), default=0)))
        except Exception:
            log.exception("could not drain refused update v%d (the weights group will time out)", manifest.version)
        raise


def arena_pieces(manifest: UpdateManifest, layout: SliceLayout | None) -> dict[str, torch.Tensor]:
    """Meta tensors of everything an update places in the device arena: whole, every bucket, the trailer and a
    delta's decoded tensors; sliced (`layout`), one receive buffer (the largest bucket) and the rank's kept slices."""
    sizes = update_buffers(manifest)
    if layout is not None:
        pieces = {"buffer": _meta([max(sizes, default=0)], torch.uint8)}
        for t in manifest.tensors:
            kept = layout.keep(t.name, _meta(t.shape, DTYPES[t.dtype]))
            if kept is not None:
                pieces[t.name] = _meta(list(kept.shape), kept.dtype)
        return pieces
    pieces = {f"buffer {i}": _meta([n], torch.uint8) for i, n in enumerate(sizes)}
    decoded = [t for t in manifest.tensors if t.encoding != "full"]
    return pieces | {t.name: _meta(t.shape, DTYPES[t.dtype]) for t in decoded}


def _meta(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def check_committable(stage: StagedUpdate | None, version: int) -> StagedUpdate:
    """`stage` when it holds `version`, staged and verified; else ManifestError naming what is staged (any commit
    path: the model's, vllm_patches/commit.py, or the adapter's, vllm_patches/adapter.py)."""
    if stage is None or stage.state != StageState.STAGED or stage.manifest.version != version:
        got = "nothing" if stage is None else f"v{stage.manifest.version} in state {stage.state.value}"
        detail = f" ({stage.error})" if stage is not None and stage.error else ""
        raise ManifestError(f"cannot commit v{version}: {got} is staged{detail}")
    return stage


class StagedNotifier:
    """A worker's end of the staged signal (vllm_patches/update_frontend.py:StagedSignals, which says why it exists):
    `announce` pushes one update's final status to the engine. Called from the staging thread
    (one at a time: an update begins only after the previous one finished receiving); a lock makes the hand-over of
    the socket between successive staging threads safe."""

    def __init__(self, address: str, worker: int) -> None:
        self.worker = worker
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 1000)  # closing never hangs a worker on an engine that is gone
        self._socket.connect(address)
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()

    def announce(self, ticket: int, status: StageStatus) -> None:
        frame = self._encoder.encode(StagedSignal(ticket, self.worker, status))
        with self._lock:
            self._socket.send(frame)

    def close(self) -> None:
        with self._lock:
            self._socket.close()
        self._context.term()


def _stall_hook_from_env() -> Callable[[int, int], None] | None:
    """Fault injection for tests, read ONCE when the worker imports this module (never per bucket), and absent unless
    INFLIGHT_FAULT_RECEIVE_STALL="<bucket>:<seconds>[:<version>]" is set: after receiving that bucket of any update (or
    only of that version), hold the transfer for that long, so a test can kill this serve or cut its link on cue."""
    spec = os.environ.get("INFLIGHT_FAULT_RECEIVE_STALL", "")
    if not spec:
        return None
    try:
        bucket, seconds, *only = (float(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(
            f"INFLIGHT_FAULT_RECEIVE_STALL is {spec!r}, expected '<bucket>:<seconds>[:<version>]' (e.g. '0:60')"
        ) from None

    def stall(index: int, version: int) -> None:
        if index == int(bucket) and (not only or int(only[0]) == version):
            print(
                f"inflight fault injection: stalling the receive of v{version} after bucket {index} for {seconds}s",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(seconds)

    return stall


# None in production: the receive loop pays one `is not None` per bucket, and parses nothing.
RECEIVE_STALL_HOOK = _stall_hook_from_env()
