"""The prepared swap frees what it replaced: a serve worker's resident memory stays flat over many updates, on the
real engine. (Each update used to keep its whole shadow tree — through vLLM's reload records, loader wrappers that
wrapped the previous update's, and a reference cycle — and with it a processed copy of the weights: a 420-s SmolLM2
run was OOM-killed at 19 GB after 44 updates.)"""

from __future__ import annotations

import statistics

import psutil
import pytest
from support import Sender, load_state, start_engine, stop_engine

pytestmark = pytest.mark.engine
UPDATES = 40


def test_a_worker_does_not_grow_with_the_number_of_prepared_updates(loop, model_dirs):
    a = load_state(model_dirs["tiny-llama"])
    b = {name: (t.float() * 1.01).to(t.dtype) for name, t in a.items()}
    model_mib = sum(t.numel() * t.element_size() for t in a.values()) / 2**20
    engine = start_engine(loop, model_dirs["tiny-llama"], update_memory="double")
    try:
        # The worker's process: EngineCore's own where the worker runs inside it (the suite's TP=1 engines)
        worker = psutil.Process(loop.run_until_complete(engine.llm.collective_rpc("inflight_worker_pid"))[0])
        sender = Sender()
        loop.run_until_complete(sender.connect(engine))
        rss = []
        for i in range(UPDATES):
            loop.run_until_complete(sender.push(engine, (a, b)[i % 2], engine.version + 1))
            rss.append(worker.memory_info().rss / 2**20)
        # Medians of two windows 20 updates apart, after the allocator's first updates: its arenas step up and down by
        # a model size at a time for the first ~30 updates and then hold (60 updates of tiny-llama, both executors,
        # AMD EPYC 2026-11-28), where the leak grew by ~1.9 model sizes with every update, without end.
        early, late = statistics.median(rss[10:20]), statistics.median(rss[30:40])
        print(f"\nworker RSS, medians of updates 11-20 and 31-40: {early:.0f}, {late:.0f} MiB (model {model_mib:.0f})")
        assert late - early < 8 * model_mib, f"the worker grew by {late - early:.0f} MiB over 20 updates: {rss}"
    finally:
        stop_engine(loop, engine)
