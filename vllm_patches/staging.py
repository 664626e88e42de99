"""StagedUpdate: one weight update being received, off the engine thread, into buffers outside the model.

Owned by the worker extension. `start()` returns at once; a daemon thread receives every bucket over the weights group,
then views and verifies every tensor (size, and its CRC32 or, with a secret, its keyed tag) and, when the engine swaps
prepared weights (`--update-memory double`), loads and processes them into vLLM's kernel layout. Forward passes keep
running the whole time because nothing here touches the live parameters; only `worker_extension.commit_staged` does,
between two engine steps.

On a CUDA device the buckets are allocated and received on a side stream of their own, so the transfer (NCCL's
broadcast, or gloo's host-to-device copies) queues behind nothing the engine runs and the engine's kernels queue
behind nothing of it; `ready_on_current_stream()` makes the committing stream wait for the staged data (an event, not
a host synchronisation) before the device-to-device copies into the parameters.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from enum import Enum

import torch

from inflight.wire.group import WeightsGroup
from inflight.wire.transfer import receive_update
from inflight.wire.weights import UpdateManifest, unpack_buckets
from vllm_patches.rpc import StageStatus


class StageState(str, Enum):
    RECEIVING = "receiving"
    STAGED = "staged"
    FAILED = "failed"
    COMMITTED = "committed"


class StagedUpdate:
    """Receives `manifest`'s buckets from `group` on a background thread and holds the verified tensors."""

    def __init__(
        self,
        manifest: UpdateManifest,
        group: WeightsGroup,
        device: torch.device | str = "cpu",
        weights_key: bytes | None = None,
        prepare: Callable[[dict], object] | None = None,
        base: tuple[int, dict[str, torch.Tensor]] | None = None,
    ):
        """`weights_key`: verify every tensor's keyed tag under it (a serve with --secret-file), not its CRC32.
        `prepare`: also build the processed weights from the verified tensors on this thread (`self.prepared`, e.g.
        vllm_patches/prepared.py:prepare), then release the tensors unless the manifest says `keep_base`; the update is
        staged only once that is done. `base`: (version, whole tensors) the receiver holds, what a delta update
        (`manifest.base_version`) is applied to; a delta on anything else fails the stage, naming both versions."""
        self.manifest, self.group, self.device, self.weights_key = manifest, group, device, weights_key
        self.base = base
        self.prepare, self.prepared, self.prepare_s = prepare, None, 0.0
        self.state = StageState.RECEIVING
        self.error: str | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.bytes_received = 0
        self.started = time.perf_counter()
        self.started_at = time.time()  # wall clock, comparable with the client's token timestamps
        self.staged_at = 0.0
        self.receive_s = self.verify_s = 0.0
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
            cuda = torch.device(self.device).type == "cuda"
            side = torch.cuda.Stream(device=self.device) if cuda else None
            with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                buckets = receive_update(self.group, self.manifest, self.device, on_bucket=self._count)
                if cuda:
                    self._ready, self._buckets = torch.cuda.Event(), buckets
                    self._ready.record(side)
                    self._ready.synchronize()  # receive_s is the transfer's, not the time to queue it
                self.receive_s = time.perf_counter() - self.started
                # CUDA: host copies, side stream
                self.tensors = unpack_buckets(
                    self.manifest, buckets, verify=True, weights_key=self.weights_key, base=self.base
                )
            self.base = None  # a delta's new tensors are copies: the base is no longer needed here
            self.verify_s = time.perf_counter() - self.started - self.receive_s
            if self.prepare is not None:
                del buckets  # the tensors are views of them: they go together, once prepared (and not kept)
                self.prepared = self.prepare(self.tensors)
                self.tensors = self.tensors if self.manifest.keep_base else {}
                self.prepare_s = time.perf_counter() - self.started - self.receive_s - self.verify_s
            self.staged_at = time.time()
            self.state = StageState.STAGED
        except Exception as exc:  # any failure must surface as a status, never kill the worker
            self.error = f"{type(exc).__name__}: {exc}"
            self.tensors = {}
            self.state = StageState.FAILED
        finally:
            self._done.set()

    def ready_on_current_stream(self) -> None:
        """Make the caller's current CUDA stream wait for the staged buckets (a no-op on CPU), and tell the caching
        allocator that stream uses them: their memory is not handed out again before its copies have run."""
        if self._ready is not None:
            current = torch.cuda.current_stream()
            current.wait_event(self._ready)
            for bucket in self._buckets:
                bucket.record_stream(current)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def status(self) -> StageStatus:
        return StageStatus(
            version=self.manifest.version,
            state=self.state.value,
            error=self.error,
            bytes_received=self.bytes_received,
            bytes_total=self.manifest.total_bytes,
            receive_s=self.receive_s,
            verify_s=self.verify_s,
            prepare_s=self.prepare_s,
            started_at=self.started_at,
            staged_at=self.staged_at,
        )


def spare_cores() -> set[int]:
    """The cores this process may run on but its compute threads do not, or an empty set where there are none.

    vLLM's CPU worker pins itself (and its OpenMP team) to the cores it computes on; its parent, the EngineCore, may
    use the rest (vLLM keeps one for scheduling). The EngineCore only busy-waits on the worker's answer while a step
    runs (a `sched_yield` loop), so on such a core background work gets nearly all of it, where on the worker's own
    core every cycle it takes is one the decode does not get. An unpinned worker (GPU) has none: its parent's cores
    are its own."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or the parent is gone
        return os.sched_getaffinity(os.getppid()) - os.sched_getaffinity(0)
    return set()


def leave_the_engines_core() -> None:
    """Move the calling (background) thread off the worker's compute cores where there are spare ones, and lower its
    priority to nice 10, so where it must share a core the engine's threads get ~90% of it. (Nice 19 starved the
    preparation for tens of seconds under load; a niced thread holding the GIL cannot starve the engine: the engine
    blocks on the GIL, not runnable, so the holder runs until Python's switch interval hands the GIL over.)

    Measured on 2 cores (SmolLM2, 16 requests decoding): on the EngineCore's core instead of on both, a prepared update
    was built in 0.5-0.7 s instead of 1.6-2.9 s, and the tokens an update cost the decode fell from ~155 to ~95 (8
    updates each, against the quiet seconds after each). Settings of this thread only; threads it starts inherit
    them."""
    spare = spare_cores()
    with contextlib.suppress(AttributeError, OSError):
        if spare:
            os.sched_setaffinity(0, spare)
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


@contextlib.contextmanager
def on_spare_cores():
    """Run the calling thread on `spare_cores()` for the block (unchanged where there are none), then put its own
    cores back. Threads created inside keep the spare cores: used to start the weights group, whose transport thread
    (gloo's TCP loop) then receives each update's bytes beside the decode instead of on its core."""
    spare, own = spare_cores(), None
    with contextlib.suppress(AttributeError, OSError):
        if spare:
            own = os.sched_getaffinity(0)
            os.sched_setaffinity(0, spare)
    try:
        yield
    finally:
        if own is not None:
            os.sched_setaffinity(0, own)


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
