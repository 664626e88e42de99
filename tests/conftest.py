"""Shared fixtures: the prepared models (idempotent; `make test` prepares them first) and, for real-engine tests, one
event loop per module, so engines started on it outlive a single test. Runs in each pytest process (`make test` runs
two, pytest-xdist's workers, each given whole modules: a module's engine is started once, on one worker)."""

from __future__ import annotations

import asyncio
import sys
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
