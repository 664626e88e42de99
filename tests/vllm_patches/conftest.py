"""Real-engine fixtures: one event loop per module, so engines started on it outlive a single test."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
