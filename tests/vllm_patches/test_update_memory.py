"""The prepared swap frees what it replaced: a serve worker's resident memory stays flat over many updates, on the
real engine. (Each update used to keep its whole shadow tree — through vLLM's reload records, loader wrappers that
wrapped the previous update's, and a reference cycle — and with it a processed copy of the weights: a 420-s SmolLM2
run was OOM-killed at 19 GB after 44 updates.)"""

from __future__ import annotations

import psutil
import pytest
from support import Sender, load_state, start_engine, stop_engine

pytestmark = pytest.mark.engine


def test_a_worker_does_not_grow_with_the_number_of_prepared_updates(loop, model_dirs):
    a = load_state(model_dirs["tiny-llama"])
    b = {name: (t.float() * 1.01).to(t.dtype) for name, t in a.items()}
    model_mib = sum(t.numel() * t.element_size() for t in a.values()) / 2**20
    engine = start_engine(loop, model_dirs["tiny-llama"], update_memory="double")
    try:
        worker = psutil.Process(loop.run_until_complete(engine.llm.collective_rpc("inflight_worker_pid"))[0])
        sender = Sender()
        loop.run_until_complete(sender.connect(engine))
        rss = []
        for i in range(16):
            loop.run_until_complete(sender.push(engine, (a, b)[i % 2], engine.version + 1))
            rss.append(worker.memory_info().rss / 2**20)
        growth = rss[-1] - rss[5]  # after the allocator's first few updates settle
        print(f"\nworker RSS after updates 6 and 16: {rss[5]:.0f} and {rss[-1]:.0f} MiB (model {model_mib:.0f} MiB)")
        # The leak kept ~1.9 model sizes per update here: 10 updates ~ 19 model sizes. Allow 4 for the allocator.
        assert growth < 4 * model_mib, f"the worker grew by {growth:.0f} MiB over 10 updates: {rss}"
    finally:
        stop_engine(loop, engine)
