"""Fixtures the tensor-parallel engine tests share."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def one_core_per_worker():
    """Each of a TP=2 CPU engine's two workers bound to its own core, restored after the module."""
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    yield
    if before is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before
