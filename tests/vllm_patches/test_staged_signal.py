"""The staged signal over its real ZeroMQ ipc channel, without an engine: a worker's staging thread pushes
(vllm_patches/staging.py:StagedNotifier), the engine's event loop awaits
(vllm_patches/update_frontend.py:StagedSignals). The
engine tests (test_inflight.py, test_bad_updates.py) run it between real processes."""

from __future__ import annotations

import asyncio
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from inflight.wire.weights import plan_manifest
from vllm_patches.rpc import StageStatus
from vllm_patches.staging import StagedNotifier, StagedUpdate
from vllm_patches.update_frontend import StagedSignals


def a_status(state: str = "staged", version: int = 7, error: str | None = None) -> StageStatus:
    return StageStatus(version, state, error, 48, 48, 0.1, 0.0, time.time(), time.time())


def announce_later(notifier: StagedNotifier, signals: list[tuple[int, StageStatus]], delay_s: float = 0.2):
    def run():
        time.sleep(delay_s)
        for ticket, status in signals:
            notifier.announce(ticket, status)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def channel():
    """The engine's end, made and awaited on one event loop, and two workers' ends."""
    loop = asyncio.new_event_loop()
    signals = loop.run_until_complete(_make_signals())
    workers = [StagedNotifier(signals.address, rank) for rank in range(2)]
    yield loop, signals, workers
    for worker in workers:
        worker.close()
    signals.close()
    loop.close()


async def _make_signals() -> StagedSignals:
    return StagedSignals()


def test_the_engine_waits_for_every_worker_and_drops_the_signal_of_an_update_it_gave_up_on(channel):
    loop, signals, (w0, w1) = channel
    late = a_status(version=6)
    announce_later(w1, [(1, late), (2, a_status())])  # ticket 1: an update the engine timed out on earlier
    announce_later(w0, [(2, a_status())], delay_s=0.4)
    start = time.monotonic()
    statuses = loop.run_until_complete(signals.wait(ticket=2, workers=2, timeout_s=10))
    assert [s.version for s in statuses] == [7, 7] and all(s.state == "staged" for s in statuses)
    assert time.monotonic() - start < 5, "the wait ends when the last worker signals, not at the timeout"


def test_a_failed_worker_ends_the_wait_with_its_error_once_the_other_worker_ended_too(channel):
    """The other rank is still preparing the update that failed on one (test_tensor_parallel_faults.py): the error
    returns when it ends, so the next update's begin finds both ranks idle."""
    loop, signals, (w0, w1) = channel
    announce_later(w0, [(3, a_status("failed", error="ManifestError: w: checksum mismatch"))], delay_s=0.0)
    announce_later(w1, [(3, a_status())], delay_s=0.6)
    start = time.monotonic()
    statuses = loop.run_until_complete(signals.wait(ticket=3, workers=2, timeout_s=10))
    waited = time.monotonic() - start
    failed = ("failed", "ManifestError: w: checksum mismatch")
    assert [(s.state, s.error) for s in statuses] == [failed, ("staged", None)]
    assert 0.5 < waited < 5, f"the wait must end with the last worker's signal, not before nor at the timeout: {waited}"


def test_a_failure_whose_other_worker_never_ends_is_returned_at_the_deadline_not_as_a_timeout(channel):
    loop, signals, (w0, _) = channel
    announce_later(w0, [(5, a_status("failed", error="ManifestError: w: checksum mismatch"))], delay_s=0.0)
    statuses = loop.run_until_complete(signals.wait(ticket=5, workers=2, timeout_s=1))
    assert [(s.state, s.error) for s in statuses] == [("failed", "ManifestError: w: checksum mismatch")]


def test_a_refusal_ends_the_wait_at_once_for_the_refusing_rank_takes_no_part_in_the_transfer(channel):
    loop, signals, (w0, _) = channel
    refused = a_status("failed", error="ArenaFull: 3 GiB do not fit")
    refused.refused = True
    announce_later(w0, [(6, refused)], delay_s=0.0)
    start = time.monotonic()
    statuses = loop.run_until_complete(signals.wait(ticket=6, workers=2, timeout_s=10))
    assert [s.refused for s in statuses] == [True] and time.monotonic() - start < 5


def test_a_wait_with_no_signal_times_out_naming_how_many_workers_signalled(channel):
    loop, signals, (w0, _) = channel
    announce_later(w0, [(4, a_status())], delay_s=0.0)
    with pytest.raises(TimeoutError, match="1 of 2 workers signalled staged within 1s"):
        loop.run_until_complete(signals.wait(ticket=4, workers=2, timeout_s=1))


def test_the_channel_lives_in_a_directory_only_this_user_can_enter_and_is_removed_on_close():
    loop = asyncio.new_event_loop()
    signals = loop.run_until_complete(_make_signals())
    directory = Path(signals.address.removeprefix("ipc://")).parent
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    signals.close()
    loop.close()
    assert not directory.exists()


def test_a_staging_thread_announces_its_failure_to_its_listener():
    """StagedUpdate hands its final status to `on_finished` from its own thread: here a receive that cannot start
    (no weights group) fails, and the listener hears it once, failed, with the error."""
    manifest = plan_manifest({"w": torch.ones(4, 3)}, version=7, bucket_bytes=1 << 10)
    heard: list[StageStatus] = []
    stage = StagedUpdate(manifest, group=None, on_finished=heard.append).start()
    assert stage.wait(30)
    assert [(s.version, s.state) for s in heard] == [(7, "failed")] and heard[0].error
