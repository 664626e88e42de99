"""The session's engine pool (tests/support.py:EnginePool) cannot make a test pass wrongly: an engine whose weights a
user moved comes back at the checkpoint, bit for bit a fresh engine's outputs; one changed behind the pool's back fails
its next checkout loudly and is stopped. Runs last among the tiny-qwen2 pool users (file order), so in a whole run it
starts no engine of its own; alone it starts one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support import PooledEngine, Sender, greedy, perturbed_checkpoint, pool_key
from transformers import AutoTokenizer

pytestmark = pytest.mark.engine


def fingerprint(completions) -> list:
    return [(list(c.token_ids), list(c.logprobs)) for c in completions]


def test_an_engine_given_back_with_other_weights_is_checked_out_at_the_checkpoint_bit_for_bit(
    loop, engine_pool, model_dirs, tmp_path
):
    a_dir = model_dirs["tiny-qwen2"]
    b = perturbed_checkpoint(a_dir, tmp_path / "B", seed=3)
    tok = AutoTokenizer.from_pretrained(a_dir)
    with engine_pool.engine(a_dir) as engine:
        sender = Sender()
        loop.run_until_complete(sender.connect(engine))
        loop.run_until_complete(sender.push(engine, b, engine.version + 1))
        on_b = loop.run_until_complete(greedy(engine, tok, tag="on-b"))
        moved_to = engine.version
    pooled = engine_pool.idle[pool_key(a_dir, {})]
    assert fingerprint(on_b) != fingerprint(pooled.reference), "B must serve differently for this test to mean much"
    assert pooled.engine is engine and pooled.version == engine.version == moved_to + 1  # A pushed back as the next
    with engine_pool.engine(a_dir) as again:
        assert again is engine
        now = loop.run_until_complete(greedy(again, tok, tag="again"))
        assert fingerprint(now) == fingerprint(pooled.reference)


def test_an_idle_engine_moved_behind_the_pools_back_fails_its_checkout_and_is_stopped(engine_pool):
    """The version check runs no request: a stand-in engine that only has a version and a shutdown is enough."""
    stopped = []
    key = ("tiny-qwen2-stand-in", ())
    pooled = PooledEngine(key, SimpleNamespace(version=4, shutdown=lambda: stopped.append(True)), None, [])
    engine_pool.idle[key] = pooled
    pooled.engine.version = 5  # an update committed while it was idle
    with pytest.raises(AssertionError, match="given back at version 4 and is now at 5"):
        engine_pool.checkout(key)
    assert stopped == [True] and key not in engine_pool.idle


def test_an_idle_engine_whose_weights_changed_fails_its_checkout_bit_for_bit_and_is_stopped(
    loop, engine_pool, model_dirs, tmp_path
):
    """The weights moved behind the pool's back and the version record made to agree: only the outputs tell."""
    a_dir = model_dirs["tiny-qwen2"]
    key = pool_key(a_dir, {})
    with engine_pool.engine(a_dir) as engine:
        pass
    pooled = engine_pool.idle[key]
    sender = Sender()
    loop.run_until_complete(sender.connect(engine))
    b = perturbed_checkpoint(a_dir, tmp_path / "B", seed=4)
    loop.run_until_complete(sender.push(engine, b, engine.version + 1))
    pooled.version = engine.version
    with pytest.raises(AssertionError, match="differ from the fresh engine's"):
        engine_pool.checkout(key)
    assert key not in engine_pool.idle
