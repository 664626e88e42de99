"""Shared fixtures: the prepared models (idempotent; `make test` prepares them first) and, for real-engine tests, one
event loop per module, so engines started on it outlive a single test."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/support.py


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    from inflight.models import MODEL_NAMES, prepare

    return {name: prepare(name) for name in MODEL_NAMES}


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
