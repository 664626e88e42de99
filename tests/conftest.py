"""Shared fixtures: the prepared models (idempotent; `make test` prepares them first), one event loop for the session,
which the real-engine tests' engines live on, and the session's pool of in-process engines (tests/support.py:EnginePool)
that test modules asking for the same (model, engine config) share. Runs in the pytest process.

With INFLIGHT_COUNT_ENGINE_STARTS=<file> every engine start of the run, in this process or in a serve it launched, is
appended to <file> (vllm_patches/engine.py:count_engine_start) and the count is printed at the end."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/support.py


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    from inflight.models import MODEL_NAMES, prepare

    return {name: prepare(name) for name in MODEL_NAMES}


@pytest.fixture(scope="session")
def loop():
    """One loop for the session: a pool engine serves several modules, and vLLM's AsyncLLM stays on the loop that
    first ran it."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def engine_pool(loop):
    """`with engine_pool.engine(model_dir, **overrides) as engine:` — a shared engine at the checkpoint's weights
    (tests/support.py:EnginePool says what is checked); `keep=False` for a user that changes what cannot be undone."""
    from support import EnginePool

    pool = EnginePool(loop)
    yield pool
    pool.close()


def pytest_terminal_summary(terminalreporter) -> None:
    path = os.environ.get("INFLIGHT_COUNT_ENGINE_STARTS")
    if path and Path(path).exists():
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
        seconds = sum(float(line.split("\t")[3].rstrip("s")) for line in lines)
        terminalreporter.write_line(f"engine starts: {len(lines)} ({seconds:.0f} s starting them), listed in {path}")
