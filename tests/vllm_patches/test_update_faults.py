"""A weight update is all-or-nothing on both commit paths, on the real engine: a failure half-way through preparing
the processed copy, half-way through swapping it in (`--update-memory double`), or half-way through the in-place
reload (`low`) leaves the served weights and the version exactly as they were — the first served checkpoint, or the
last committed update — and the next update commits. Faults are injected in the worker with INFLIGHT_FAULT_UPDATE
(vllm_patches/faults.py), read when the engine's worker starts."""

from __future__ import annotations

import pytest
from support import PROMPTS, Sender, greedy, load_state, perturbed_checkpoint, start_engine, stop_engine
from transformers import AutoTokenizer

from vllm_patches.update_frontend import UpdateError

pytestmark = pytest.mark.engine


def same_outputs(got, want) -> bool:
    return [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in want]


# Update 1 fails (nothing committed yet: the served checkpoint must stay), update 2 commits B, update 3 fails (B, the
# last committed update, must stay), update 4 commits A again.
@pytest.mark.parametrize(
    ("update_memory", "planned"), [("double", "prepare@1,swap@3"), ("low", "apply@1,apply@3")], ids=["double", "low"]
)
def test_a_failure_half_way_through_an_update_leaves_weights_and_version_as_they_were(
    loop, model_dirs, tmp_path, monkeypatch, update_memory, planned
):
    monkeypatch.setenv("INFLIGHT_FAULT_UPDATE", planned)
    a_dir = model_dirs["tiny-qwen2"]
    a, b = load_state(a_dir), perturbed_checkpoint(a_dir, tmp_path / "B", seed=7)
    tok = AutoTokenizer.from_pretrained(a_dir)
    engine = start_engine(loop, a_dir, update_memory=update_memory)
    try:
        sender = Sender()
        loop.run_until_complete(sender.connect(engine))
        served_a = loop.run_until_complete(greedy(engine, tok, tag="a"))

        def push_fails(state, phase: str) -> None:
            version = engine.version
            with pytest.raises(UpdateError, match=f"injected fault: update \\d failed half-way through {phase}"):
                loop.run_until_complete(sender.push(engine, state, version + 1))
            assert engine.version == version

        push_fails(b, "prepare" if update_memory == "double" else "apply")
        still_a = loop.run_until_complete(greedy(engine, tok, tag="a-after-fault"))
        assert same_outputs(still_a, served_a), "a failed first update changed the served weights"
        assert {v for o in still_a for v in o.versions} == {0}

        loop.run_until_complete(sender.push(engine, b, engine.version + 1))
        served_b = loop.run_until_complete(greedy(engine, tok, tag="b"))
        assert not same_outputs(served_b, served_a), "B must differ from A"

        push_fails(a, "swap" if update_memory == "double" else "apply")
        still_b = loop.run_until_complete(greedy(engine, tok, tag="b-after-fault"))
        assert same_outputs(still_b, served_b), "a failed update did not leave the last committed weights"
        assert {v for o in still_b for v in o.versions} == {1}

        loop.run_until_complete(sender.push(engine, a, engine.version + 1))
        again_a = loop.run_until_complete(greedy(engine, tok, PROMPTS, tag="a-again"))
        assert [o.token_ids for o in again_a] == [o.token_ids for o in served_a]
    finally:
        stop_engine(loop, engine)
