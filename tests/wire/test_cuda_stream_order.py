"""Stream order of a staged update on CUDA (vllm_patches/staging.py: `staging_stream`, the event recorded once
everything is staged, `ready_on_current_stream`), with torch alone: a decode loop reads the live weights on the
engine's stream while a staging thread writes each new version on the worker's staging stream; the commit makes the
decode stream wait on the staging event and records the new tensor on it. Thousands of swaps, no torn read (a read
that sees two versions at once), and the allocator's reserved memory flat across them. Skipped without CUDA
(scripts/gpu_check.sh runs it on a GPU machine); the CPU half checks that a CPU worker has no staging stream."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from vllm_patches.staging import staging_stream

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
ELEMENTS = 1 << 24  # 64 MiB of fp32 per version: a fill takes long enough to be caught half-way without the wait
SWAPS = 2000


def test_a_cpu_worker_has_no_staging_stream():
    assert staging_stream("cpu") is None


@cuda
def test_the_staging_stream_is_made_once_per_device_and_kept_across_updates():
    assert staging_stream("cuda:0") is staging_stream("cuda:0")
    assert staging_stream("cuda:0") != torch.cuda.current_stream()


def _stager(handed: queue.Queue, stop: threading.Event) -> None:
    """Writes version v into a fresh tensor on the staging stream, records the event, hands both over (as
    StagedUpdate._run does with the prepared layers)."""
    side = staging_stream("cuda:0")
    for version in range(1, SWAPS + 1):
        if stop.is_set():
            return
        with torch.cuda.stream(side):
            new = torch.empty(ELEMENTS, device="cuda:0")
            new.fill_(float(version))
            ready = torch.cuda.Event()
            ready.record(side)
        handed.put((version, new, ready))


def _decode_loop(handed: queue.Queue) -> tuple[list[tuple[float, float]], list[int]]:
    live = torch.zeros(ELEMENTS, device="cuda:0")
    reads, reserved, committed = [], [], 0
    while committed < SWAPS:
        try:
            version, new, ready = handed.get_nowait()
        except queue.Empty:
            version = None
        if version is not None:  # the commit: as ready_on_current_stream, then the reference swap
            current = torch.cuda.current_stream()
            current.wait_event(ready)
            new.record_stream(current)
            live, committed = new, version
            reserved.append(torch.cuda.memory_reserved())
        reads.append(torch.stack([live.min(), live.max()]))  # one decode step's read of the weights
    torch.cuda.synchronize()
    return [tuple(r.tolist()) for r in reads], reserved


@cuda
def test_a_decode_stream_never_reads_a_half_written_update_across_thousands_of_swaps():
    handed, stop = queue.Queue(maxsize=2), threading.Event()
    stager = threading.Thread(target=_stager, args=(handed, stop), daemon=True)
    stager.start()
    try:
        reads, reserved = _decode_loop(handed)
    finally:
        stop.set()
        stager.join(60)
    torn = [(low, high) for low, high in reads if low != high]
    assert not torn, f"{len(torn)} of {len(reads)} reads saw two versions at once, e.g. {torn[:3]}"
    versions = [low for low, _ in reads]
    assert versions == sorted(versions) and versions[-1] == SWAPS
    # one persistent staging stream: its freed blocks are reused, so reserved memory stops growing after warm-up
    assert max(reserved[SWAPS // 2 :]) <= max(reserved[: SWAPS // 2]), "reserved memory grew across updates"
