"""Fixtures the tensor-parallel engine tests share: each worker on its own core, and one fresh two-worker engine per
model whose answers and placements every module compares against (`fresh_tp2`)."""

from __future__ import annotations

import json
import os

import pytest
from filelock import FileLock
from tp_support import Answer, FreshTP2, ask_a_fresh_engine


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


@pytest.fixture(scope="module")
def fresh_tp2(loop, model_dirs, tmp_path_factory, one_core_per_worker):
    """get(name) -> FreshTP2, made once per suite run: the first module to ask starts the engine, the others (on any
    xdist worker: the record lies in the run's shared temp dir, under a file lock) read what it said. Exact
    comparisons across engines hold on one machine (test_swap_exact.assert_same_outputs), so one fresh engine is as
    good a reference as one per module, and saves a two-worker engine start (~25 s here) for each module after the
    first."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # every worker's basetemp sits in the run's own directory
    root = shared / "fresh-tp2"
    root.mkdir(exist_ok=True)

    def get(name: str) -> FreshTP2:
        here = root / name
        with FileLock(str(root / f"{name}.lock")):
            if not (here / "said.json").exists():
                ask_a_fresh_engine(loop, model_dirs[name], here)
        said = json.loads((here / "said.json").read_text())
        answers = [Answer(a["token_ids"], a["logprobs"]) for a in said["answers"]]
        return FreshTP2(here / "B", answers, said["placements"], said["refused"])

    return get
