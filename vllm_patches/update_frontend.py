"""WeightUpdates: one weight update's choreography on the engine side, in one of five interruption modes.

Called through `vllm_patches/engine.py:InflightEngine.update` (the serve's control client, tests, benchmarks). One way:
pause as the mode says, begin staging on every worker (`inflight_begin_update`, which returns at once), await every
worker's staged signal (`StagedSignals`: the workers tell, nothing asks), commit between two engine steps (the
EngineCore utility `inflight_commit`, below), resume.

  never-stop    stage in the background while decoding continues; commit between two steps (the only stall)
  keep-pause    pause (keep, KV kept) for the whole transfer, commit, resume — what PipelineRL/TRL do
  drain         pause (wait: running requests finish, new ones queue), transfer, commit, resume
  abort-resume  pause (abort), transfer, commit, resume; aborted requests are resubmitted by the generation
  blocking      the engine must be idle (synchronous RL: generate, train, update); refused otherwise

Why the staged signal has a channel of its own: the engine must wait for staging without stalling decoding, and vLLM
offers no way to do that through its own calls. A worker runs its RPCs one at a time on the thread that runs
`execute_model`, and EngineCore runs a utility call between two steps, so an RPC that blocked until staging finished
would stop decoding for as long as staging takes; asking "staged yet?" again and again costs a step gap per ask (and
vLLM's shm reader then busy-spins for a second after each, starving the staging thread of the GIL). Instead each
worker's staging thread pushes one `vllm_patches/rpc.py:StagedSignal` when it finishes
(`vllm_patches/staging.py:StagedNotifier`) to a ZeroMQ PULL socket this engine binds on an ipc path in a private
directory (mode 0700: only this user can connect), awaited with `zmq.asyncio`: nothing polls, and EngineCore and the
worker never wait for it. Messages are msgpack-encoded `StagedSignal` records, validated on decode.

Runs in the front-end process (the serve's, or a test's), on the engine's asyncio loop. The update's EngineCore half,
the utilities `inflight_commit` and `inflight_park`, is vllm_patches/update_enginecore.py; the workers' half is
vllm_patches/worker_extension.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from vllm_patches.generation import RunningRequests, ServedVersion
from vllm_patches.rpc import CommitApplied, CommitResult, StagedSignal, StageStatus, rpc_result
from vllm_patches.update_enginecore import RANKS_SPLIT

if TYPE_CHECKING:  # see vllm_patches/generation.py: vLLM is imported by whoever starts the engine
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

MODES = ("never-stop", "keep-pause", "drain", "abort-resume", "blocking")


@dataclass
class UpdateReport:
    """What one `update()` cost: `stall_s` is the time generation could not make progress because of it."""

    version: int
    mode: str
    total_s: float = 0.0
    stall_s: float = 0.0
    commit_s: float = 0.0
    receive_s: float = 0.0
    prepare_s: float = 0.0  # loading into the processed copy off the engine thread (update_memory "double")
    bytes: int = 0
    bytes_kept: int = 0  # what one worker staged: its tensor-parallel slices, or `bytes`
    full_tensors: list[str] = field(default_factory=list)  # kept whole on a worker: layout not known
    staging_window: tuple[float, float] = (0.0, 0.0)  # wall clock: receive started, all buckets verified
    parked: bool = False  # the workers waited for staging in a blocking call (paused modes: inflight_park, below)
    workers: list[CommitApplied] = field(default_factory=list)


class UpdateError(RuntimeError):
    """A weight update was refused or failed; the live weights and the version are unchanged."""


class StagedSignals:
    """The engine's end: awaits every worker's `StagedSignal` for one update, dropping signals of older updates."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="inflight-staged-"))  # 0700: the socket is this user's alone
        self.address = f"ipc://{self._dir / 'staged'}"
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.bind(self.address)
        self._decoder = msgspec.msgpack.Decoder(StagedSignal)

    async def wait(self, ticket: int, workers: int, timeout_s: float) -> list[StageStatus]:
        """Every worker's final status for the update begun under `ticket`, by rank; a failure once the others ended too
        (they may still be preparing it: the next begin would be refused there) or alone at the deadline, a refusal at
        once (its rank takes no part); raises TimeoutError naming what arrived if not all signalled in `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        arrived: dict[int, StageStatus] = {}
        while len(arrived) < workers:
            remaining = deadline - loop.time()
            failed = [s for s in arrived.values() if s.state == "failed"]
            if failed and (failed[0].refused or remaining <= 0):
                return failed[:1]
            if remaining <= 0:
                raise TimeoutError(f"{len(arrived)} of {workers} workers signalled staged within {timeout_s:.0f}s")
            try:
                frame = await asyncio.wait_for(self._socket.recv(), remaining)
            except asyncio.TimeoutError:
                continue  # the loop's deadline check raises with what arrived
            signal = self._decode(frame)
            if signal is None or signal.ticket != ticket:
                continue  # a late signal of an update the engine gave up on
            arrived[signal.worker] = signal.status
        return [arrived[rank] for rank in sorted(arrived)]

    def _decode(self, frame: bytes) -> StagedSignal | None:
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as exc:  # only this user's processes can connect: a worker of another version
            log.warning("dropped a malformed staged signal (%s): the worker and the engine must be one release", exc)
            return None

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class WeightUpdates:
    """Runs weight updates one at a time against `llm`; sets `served` on every commit."""

    def __init__(self, llm: AsyncLLM, served: ServedVersion, requests: RunningRequests, signals: StagedSignals):
        self.llm, self.served, self.requests, self.signals = llm, served, requests, signals
        self.stalled_s = 0.0  # generation seconds lost to updates (counted only when something was generating)
        self.refused = 0  # updates a worker refused: they would not fit its staging arena (decoding went on)
        self._lock = asyncio.Lock()
        self._tickets = itertools.count(1)  # matches each update with its workers' staged signals

    async def run(self, manifest_bytes: bytes, mode: str, kv: str, timeout_s: float) -> UpdateReport:
        """Receive and commit one update in `mode`. Raises `UpdateError` with weights and version unchanged."""
        if mode not in MODES:
            raise ValueError(f"mode is {mode!r}, expected one of {MODES}")
        async with self._lock:
            report = UpdateReport(version=-1, mode=mode)
            busy = bool(self.requests.ids)  # a stall costs generation only when something was generating
            start = time.perf_counter()
            paused = await self._pause_for(mode)
            try:
                ticket = next(self._tickets)
                begun = await self._begin(manifest_bytes, ticket)
                report.version = begun[0].version
                parked = self._park(timeout_s) if paused else None
                staged = await self._await_staged(ticket, len(begun), timeout_s)
                if parked is not None:
                    report.parked = await parked
                report.receive_s, report.prepare_s = staged.receive_s, staged.prepare_s
                report.bytes, report.bytes_kept = staged.bytes_received, staged.bytes_kept
                report.full_tensors = staged.full_tensors
                report.staging_window = (staged.started_at, staged.staged_at)
                await self._commit(report, kv)
            finally:
                if paused:
                    await self.llm.resume_generation()
                    self.requests.resume()
            report.total_s = time.perf_counter() - start
            report.stall_s = report.total_s if paused else report.commit_s
            if busy:
                self.stalled_s += report.stall_s
            return report

    async def _pause_for(self, mode: str) -> bool:
        if mode == "never-stop":
            return False
        if mode == "blocking":
            if self.requests.ids:
                raise UpdateError(f"mode blocking needs an idle engine; {len(self.requests.ids)} requests are running")
            return False
        if mode == "abort-resume":
            self.requests.abort_all()
            await self.llm.pause_generation(mode="abort", clear_cache=False)
        else:
            await self.llm.pause_generation(mode="keep" if mode == "keep-pause" else "wait", clear_cache=False)
        return True

    def _park(self, timeout_s: float) -> asyncio.Task:
        """While paused, the workers wait for staging in a blocking call instead of spinning on their RPC queue
        (`inflight_park` says why); the commit queues behind it. A failed park costs nothing."""

        async def park() -> bool:
            try:
                return bool(await self.llm.engine_core.call_utility_async("inflight_park", timeout_s))
            except Exception:
                log.exception("EngineCore could not park during a paused update (the update goes on)")
                return False

        return asyncio.ensure_future(park())

    async def _begin(self, manifest_bytes: bytes, ticket: int) -> list[StageStatus]:
        try:
            statuses = await self.llm.collective_rpc("inflight_begin_update", args=(manifest_bytes, ticket))
        except Exception as exc:
            raise UpdateError(f"update refused before any bucket was received: {exc}") from exc
        return rpc_result(statuses, list[StageStatus], "inflight_begin_update")

    async def _await_staged(self, ticket: int, workers: int, timeout_s: float) -> StageStatus:
        """The first worker's status once every worker signalled staged; raises UpdateError on a failure or timeout."""
        try:
            statuses = await self.signals.wait(ticket, workers, timeout_s)
        except TimeoutError as exc:
            # One question after giving up, for the error message only: how far staging got.
            progress = await self.llm.collective_rpc("inflight_update_status")
            got = rpc_result(progress, list[StageStatus], "inflight_update_status")
            raise UpdateError(f"update not staged within {timeout_s:.0f}s ({exc}): {got[0]}") from exc
        failed = [s for s in statuses if s.state == "failed"]
        if failed and failed[0].refused:
            self.refused += 1
            raise UpdateError(f"update v{failed[0].version} refused, weights untouched: {failed[0].error}")
        if failed:
            raise UpdateError(f"update v{failed[0].version} failed while staging: {failed[0].error}")
        return statuses[0]

    async def _commit(self, report: UpdateReport, kv: str) -> None:
        try:
            result = await self.llm.engine_core.call_utility_async("inflight_commit", report.version, kv)
        except Exception as exc:
            if RANKS_SPLIT in str(exc):
                # A rank could not roll back: its weights are neither version. Serving on would mix them; stop.
                log.critical("stopping the engine: %s", exc)
                self.llm.shutdown()
                raise UpdateError(f"commit of v{report.version} failed and the engine was stopped: {exc}") from exc
            raise UpdateError(f"commit of v{report.version} failed: {exc}") from exc
        committed = rpc_result(result, CommitResult, "inflight_commit")
        report.commit_s, report.workers = committed.stall_s, committed.workers
        self.served.number = report.version
