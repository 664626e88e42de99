"""Real-engine fixtures of the in-process episode tests (test_episodes.py, test_verifiers_env.py): the session pool's
tiny-qwen2 engine (tests/conftest.py:engine_pool), on the session's event loop (`loop`). Runs in the pytest process."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine(engine_pool, model_dirs):
    with engine_pool.engine(model_dirs["tiny-qwen2"]) as engine:
        yield engine
