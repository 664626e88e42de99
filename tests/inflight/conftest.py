"""Real-engine fixtures of the in-process episode tests (test_episodes.py, test_verifiers_env.py): one tiny-qwen2
engine per module on the module's event loop (`loop`, tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine(loop, model_dirs):
    from support import start_engine, stop_engine

    engine = start_engine(loop, model_dirs["tiny-qwen2"])
    yield engine
    stop_engine(loop, engine)
