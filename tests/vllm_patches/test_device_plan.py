"""The staging plan (vllm_patches.device_plan.py): the device bytes an update needs, reserved out of the fraction of
the GPU vLLM would otherwise give its KV cache, or a refusal naming the numbers and the fix. Pure arithmetic, so it is
decided here on CPU; the checkpoint reader runs on a real prepared model."""

from __future__ import annotations

import math

import pytest
from safetensors import safe_open

from inflight.models import model_dir
from inflight.wire.delta import DECODE_WORKSPACE_BYTES
from vllm_patches.device_plan import (
    GIB,
    StagingPlan,
    TensorParallel,
    WeightSizes,
    checkpoint_weight_bytes,
    plan_gpu_memory,
    rank_numel,
    staging_plan,
)

TWO_B_BF16 = 2_000_000_000 * 2
H100 = 80 * GIB


@pytest.mark.parametrize(
    ("update_memory", "delta", "peak", "host"),
    [("low", False, 1, 1), ("double", False, 2, 0), ("low", True, 2, 1), ("double", True, 3, 1)],
)
def test_an_update_needs_its_buckets_plus_the_processed_copy_in_double_plus_decoded_deltas_and_holds_nothing_after(
    update_memory, delta, peak, host
):
    plan = StagingPlan(weight_bytes=TWO_B_BF16, update_memory=update_memory, delta=delta)
    decoding = DECODE_WORKSPACE_BYTES if delta else 0  # a chunk's at a time, however large the tensor
    assert (plan.peak_bytes, plan.host_bytes) == (peak * TWO_B_BF16 + decoding, host * TWO_B_BF16)
    assert ("pinned host memory kept between updates" in plan.describe()) == bool(host)


def test_a_2b_bf16_model_at_0_9_of_an_80gb_gpu_gets_its_double_update_set_aside_from_the_kv_cache():
    plan = plan_gpu_memory(StagingPlan(TWO_B_BF16, "double", delta=False), H100, 0.9)
    assert plan.engine_utilization == pytest.approx(0.9 - 2 * TWO_B_BF16 / H100)
    # what vLLM may take plus what the update takes is still the fraction the user gave
    assert plan.engine_utilization * H100 + plan.staging.peak_bytes == pytest.approx(0.9 * H100)
    assert "becomes 0.807" in plan.describe() and "7.45 GiB on the device at its peak" in plan.describe()


def test_a_model_whose_update_leaves_vllm_too_little_is_refused_naming_the_numbers_and_every_flag_that_helps():
    fifteen_b = 15_000_000_000 * 2
    with pytest.raises(ValueError) as refused:
        plan_gpu_memory(StagingPlan(fifteen_b, "double", delta=True), H100, 0.9)
    text = str(refused.value)
    for words in (
        "--gpu-memory-utilization 0.9",
        "80.0 GiB",
        "83.91 GiB on the device at its peak",
        "--full-every 1",
    ):
        assert words in text
    with pytest.raises(ValueError, match="pass --update-memory low"):
        plan_gpu_memory(StagingPlan(fifteen_b, "double", delta=False), H100, 0.8)
    # a 7B model's double update fits at 0.8
    assert plan_gpu_memory(StagingPlan(7_000_000_000 * 2, "double", delta=False), H100, 0.8).engine_utilization > 0.4


def test_the_checkpoint_reader_counts_every_tensor_of_a_real_model_from_the_headers_alone():
    where = model_dir("smollm2")
    expected = 0
    for path in sorted(where.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                expected += f.get_tensor(name).numel()
    assert expected > 100_000_000  # SmolLM2-135M
    assert checkpoint_weight_bytes(where, "bfloat16") == 2 * expected
    assert checkpoint_weight_bytes(where, "float32") == 4 * expected


def test_an_unresolved_dtype_is_refused_naming_the_value():
    with pytest.raises(ValueError, match="'auto'"):
        checkpoint_weight_bytes(model_dir("smollm2"), "auto")


def test_the_cpu_only_moe_reload_fix_runs_on_a_cpu_model_and_on_no_other():
    import torch

    from vllm_patches.commit import moe_reload_needs_fresh_kernels

    assert moe_reload_needs_fresh_kernels(torch.nn.Linear(2, 2))
    assert not moe_reload_needs_fresh_kernels(torch.nn.Linear(2, 2, device="meta"))  # not CPU: no prepack to redo
    assert not moe_reload_needs_fresh_kernels(torch.nn.Module())


@pytest.mark.parametrize(
    ("cores", "workers", "bind"),
    [([0, 1], 2, "0|1"), (list(range(8)), 2, "0-3|4-7"), ([0, 2, 4, 6], 2, "0,2|4,6"), ([3, 1, 2], 1, "1-3")],
)
def test_a_cpu_tensor_parallel_serve_gives_each_worker_an_equal_share_of_its_cores(cores, workers, bind):
    from vllm_patches.device_plan import cpu_threads_bind

    assert cpu_threads_bind(cores, workers) == bind


def test_more_cpu_workers_than_cores_is_refused_naming_the_flag_and_the_fix():
    from vllm_patches.device_plan import cpu_threads_bind

    with pytest.raises(ValueError, match="--tensor-parallel-size 3 on a CPU serve") as refused:
        cpu_threads_bind([0, 1], 3)
    assert "--serve-cores, e.g. 0-2" in str(refused.value)


def test_a_layers_bytes_group_its_block_and_the_largest_tensor_and_layer_are_found():
    from vllm_patches.device_plan import weight_sizes

    sizes = weight_sizes(
        {
            "model.embed_tokens.weight": 100,
            "model.layers.0.mlp.up_proj.weight": 30,
            "model.layers.0.mlp.down_proj.weight": 30,
            "model.layers.1.mlp.experts.w13": 70,
            "model.layers.10.self_attn.q_proj.weight": 5,
        }
    )
    assert (sizes.total, sizes.largest_tensor, sizes.largest_layer) == (235, 100, 100)  # the embedding is a layer
    assert weight_sizes({"model.layers.1.a": 70, "model.layers.1.b": 40, "lm_head.weight": 90}).largest_layer == 110


def test_the_staging_plan_counts_checksum_padding_the_reloaded_layer_and_the_weights_groups_buffers():
    """Issue 40, point 4: memory outside the old plan — sum31's padded copy and workspace, `low`'s materialised layer,
    the communicator's buffers, deltas and their decode's workspace — is in the peak the engine's fraction is lowered
    by."""
    from inflight.wire.checksum import SUM31_WORKSPACE_BYTES, sum31_pad_bytes
    from vllm_patches.device_plan import NCCL_BYTES_PER_CHANNEL, WeightSizes, staging_plan

    sizes = WeightSizes(total=TWO_B_BF16, largest_tensor=(1 << 20) + 3, largest_layer=300 << 20)
    low = staging_plan(sizes, "low", delta=False, max_ctas=4)
    extra = sum31_pad_bytes((1 << 20) + 3) + SUM31_WORKSPACE_BYTES + (300 << 20) + 4 * NCCL_BYTES_PER_CHANNEL
    assert low.peak_bytes == TWO_B_BF16 + extra
    double = staging_plan(sizes, "double", delta=True, max_ctas=4)
    decoding = DECODE_WORKSPACE_BYTES  # a delta decoded a chunk at a time
    assert double.peak_bytes == 3 * TWO_B_BF16 + extra - (300 << 20) + decoding  # no in-place reload in double
    assert sum31_pad_bytes(1 << 17) == 0 and sum31_pad_bytes(1) == 1 << 17


def test_pinned_host_memory_is_planned_for_every_commit_that_writes_into_the_live_storage():
    """`low` and `double` under CUDA graphs (its prepared layers copied in) keep the staged version to roll back to;
    `double` swapping its layers in keeps nothing unless deltas need a base. The device peak is the path's own."""
    from vllm_patches.device_plan import WeightSizes, staging_plan

    sizes = WeightSizes(total=TWO_B_BF16, largest_tensor=1 << 20, largest_layer=300 << 20)
    kept = {
        (memory, copy, delta): staging_plan(sizes, memory, delta, 0, copy_commit=copy).host_bytes
        for memory, copy, delta in [("low", False, False), ("double", True, False), ("double", False, False),
                                    ("double", False, True)]
    }  # fmt: skip
    assert kept == {
        ("low", False, False): TWO_B_BF16,
        ("double", True, False): TWO_B_BF16,
        ("double", False, False): 0,
        ("double", False, True): TWO_B_BF16,
    }
    swap, copy = (staging_plan(sizes, "double", False, 0, copy_commit=c).peak_bytes for c in (False, True))
    assert swap == copy


def test_lows_copies_are_planned_in_the_device_arena_as_one_layer_beside_the_update_and_doubles_as_a_second_copy():
    """`low`'s copies are prepared over the staged tensors (vllm_patches/arenas.py:ReusingTail): the arena holds the
    update and its largest layer, the layer the in-place reload would materialise on the engine's stream, so the peak
    is `low`'s either way; `double`'s copy commit prepares beside them: another 1x. Sliced staging adds its buffer.
    The host arena keeps the kernel format of low's copies: one layer's room more."""
    from vllm_patches.arenas import ALIGN
    from vllm_patches.device_plan import ARENA_BYTES_PER_TENSOR, WeightSizes, staging_plan

    sizes = WeightSizes(total=TWO_B_BF16, largest_tensor=1 << 20, largest_layer=300 << 20, count=10)
    slack = 10 * ARENA_BYTES_PER_TENSOR + ALIGN
    reload, copies = (staging_plan(sizes, "low", False, 0, copy_commit=c) for c in (False, True))
    assert reload.arena_bytes == TWO_B_BF16 + slack
    assert copies.arena_bytes == TWO_B_BF16 + slack + (300 << 20) + slack
    assert copies.peak_bytes == reload.peak_bytes and copies.host_bytes == reload.host_bytes == TWO_B_BF16
    # what low's copies keep is the kernel format, which may outgrow the checkpoint's by the layer's room: the host
    # arena that keeps it between updates has the same room (else StagingArenas.hold would refuse every next update)
    assert copies.host_arena_bytes == reload.host_arena_bytes + (300 << 20) + slack
    double = staging_plan(sizes, "double", False, 0, copy_commit=True)
    assert double.arena_bytes == 2 * (TWO_B_BF16 + slack) and double.host_arena_bytes == reload.host_arena_bytes
    sliced = staging_plan(sizes, "low", False, 0, bucket_bytes=64 << 20, copy_commit=True)
    assert sliced.arena_bytes == (64 << 20) + TWO_B_BF16 + slack + (300 << 20) + slack


def test_a_host_arena_holds_one_version_in_exactly_its_planned_bytes_and_refuses_more():
    """Issue 40, point 5: one buffer reused by every update, never a second copy; the old per-update pinned copies
    cost 2x rounded up to powers of two."""
    import torch

    from vllm_patches.arenas import ArenaFull, HostArena, arena_offsets, caching_allocator_bytes

    tensors = {"a": torch.arange(6, dtype=torch.bfloat16).view(2, 3), "b": torch.ones(5, dtype=torch.float32)}
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    offsets, planned = arena_offsets(sizes)
    assert offsets == [0, 64] and planned == 128
    arena = HostArena(planned, pin=False)
    buffer = arena.buffer.data_ptr()
    for step in range(10):
        held = arena.copy_in({name: t + step for name, t in tensors.items()})
        assert arena.buffer.data_ptr() == buffer and arena.nbytes == planned
    assert torch.equal(held["a"], tensors["a"] + 9) and torch.equal(held["b"], tensors["b"] + 9)
    with pytest.raises(ArenaFull, match="need 192 bytes of host arena, the plan sized 128"):
        arena.views({**tensors, "c": torch.zeros(1)})
    assert arena.empty(128).numel() == 128
    with pytest.raises(ArenaFull, match="need 192 bytes of host arena"):
        arena.empty(129)
    assert caching_allocator_bytes([12, 20]) == 2 * (16 + 32)
    assert caching_allocator_bytes([3 << 30]) == 2 * (4 << 30)  # a 3 GiB expert block pins 8 GiB the old way


# Issue 41: each tensor-parallel rank stages only its slice. The models are their published config.json facts
# (benchmarks/tp_plan.py); the totals must be the published parameter counts.
@pytest.mark.parametrize(
    ("model", "billions"),
    [("Llama-3.1-70B", 70.55), ("Qwen2.5-32B", 32.76), ("Qwen3-30B-A3B", 30.53), ("Qwen3-235B-A22B", 235.09)],
)
def test_the_real_configs_lay_out_checkpoints_of_their_published_parameter_counts(model, billions):
    from benchmarks.tp_plan import MODELS, checkpoint

    total = sum(math.prod(shape) for shape in checkpoint(MODELS[model]).values())
    assert total / 1e9 == pytest.approx(billions, rel=0.01)


def test_a_rank_keeps_its_share_of_every_sharded_tensor_at_least_one_kv_head_and_the_norms_whole():
    split = TensorParallel(tp=8, kv_heads=4)
    assert rank_numel("model.layers.0.self_attn.q_proj.weight", [8192, 4096], split) == 1024 * 4096
    assert rank_numel("model.layers.0.self_attn.k_proj.weight", [512, 4096], split) == 128 * 4096  # one kv head
    assert rank_numel("model.layers.0.self_attn.o_proj.weight", [4096, 8192], split) == 4096 * 1024
    assert rank_numel("model.layers.0.mlp.experts.3.down_proj.weight", [4096, 1536], split) == 4096 * 192
    ep = TensorParallel(tp=8, kv_heads=4, expert_parallel=True)
    assert rank_numel("model.layers.0.mlp.experts.3.down_proj.weight", [4096, 1536], ep) == 4096 * 1536 // 8
    assert rank_numel("lm_head.weight", [151936, 4096], split) == 18992 * 4096
    assert rank_numel("model.norm.weight", [4096], split) == 4096
    assert rank_numel("model.layers.0.mlp.gate.weight", [128, 4096], split) == 128 * 4096  # the router: replicated


def test_70b_fits_at_tp8_on_80gb_and_at_tp4_on_141gb_with_either_commit_path_where_whole_staging_fit_nowhere():
    from benchmarks.tp_plan import plan_row

    for tp, gpu in ((8, "H100 80 GB"), (4, "H200 141 GB")):
        for memory in ("low", "double"):
            row = plan_row("Llama-3.1-70B", tp, False, gpu, memory)
            assert row.fits and not row.fits_whole, row
            assert row.rank_gib == pytest.approx(row.whole_gib / tp, rel=0.01)
            assert row.left_gib > 0.25 * row.rank_gib  # the KV cache's room, beyond the rank's live weights
    assert not plan_row("Llama-3.1-70B", 4, False, "H100 80 GB", "low").fits


def test_a_rank_of_32b_at_tp2_holds_half_the_model_and_fits_an_80gb_gpu_in_place_and_141gb_either_path():
    from benchmarks.tp_plan import plan_row

    low80 = plan_row("Qwen2.5-32B", 2, False, "H100 80 GB", "low")
    assert low80.rank_gib == pytest.approx(low80.whole_gib / 2, rel=0.01) and not low80.fits_whole
    # the commit's carriers allocate nothing (vllm_patches/placement.py:SliceCarrier): the peak is the rank's slice,
    # the bucket buffer and one layer, and 8.7 GiB are left, beyond the quarter-of-the-weights margin (7.6 GiB)
    assert low80.fits and low80.peak_gib < 0.55 * low80.whole_gib and low80.left_gib > 0.25 * low80.rank_gib
    assert plan_row("Qwen2.5-32B", 2, False, "H100 80 GB", "low", utilization=0.95).fits
    assert not plan_row("Qwen2.5-32B", 2, False, "H100 80 GB", "double", utilization=0.95).fits  # no processed copy
    for memory in ("low", "double"):
        assert plan_row("Qwen2.5-32B", 2, False, "H200 141 GB", memory).fits


def test_moe_ranks_under_expert_parallel_keep_whole_experts_and_235b_fits_at_tp8_only_in_place_on_141gb():
    from benchmarks.tp_plan import plan_row

    for memory in ("low", "double"):
        row = plan_row("Qwen3-30B-A3B", 4, True, "H100 80 GB", memory)
        assert row.fits and row.rank_gib == pytest.approx(row.whole_gib / 4, rel=0.02)
    assert plan_row("Qwen3-235B-A22B", 8, True, "H200 141 GB", "low", utilization=0.95).fits
    assert not plan_row("Qwen3-235B-A22B", 8, True, "H200 141 GB", "double", utilization=0.95).fits
    assert not plan_row("Qwen3-235B-A22B", 8, True, "H100 80 GB", "low", utilization=0.95).fits  # 55 GiB a rank


def test_a_sliced_plan_counts_one_bucket_buffer_as_big_as_the_largest_tensor_not_the_model():
    sizes = WeightSizes(total=10 * GIB, largest_tensor=2 * GIB, largest_layer=GIB // 2)
    sliced = staging_plan(sizes, "low", False, max_ctas=0, bucket_bytes=64 << 20)
    whole = staging_plan(sizes, "low", False, max_ctas=0)
    assert sliced.peak_bytes - whole.peak_bytes == 2 * GIB  # the buffer; the commit's carriers allocate nothing


def test_a_rank_staging_slices_decodes_a_delta_onto_its_kept_slices_so_deltas_add_only_the_decodes_workspace():
    sizes = WeightSizes(total=10 * GIB, largest_tensor=2 * GIB, largest_layer=GIB // 2)
    plain, deltas = (staging_plan(sizes, "low", d, max_ctas=0, bucket_bytes=64 << 20) for d in (False, True))
    assert deltas.peak_bytes - plain.peak_bytes == DECODE_WORKSPACE_BYTES
    assert deltas.arena_bytes == plain.arena_bytes  # the receive buffer and the slices, a delta's or a full update's
    whole, whole_deltas = (staging_plan(sizes, "low", d, max_ctas=0) for d in (False, True))
    assert whole_deltas.peak_bytes - whole.peak_bytes == 10 * GIB + DECODE_WORKSPACE_BYTES  # decoded beside payloads


def _arena_needs(manifest) -> int:
    """The device-arena bytes a worker lays `manifest` out in (vllm_patches/staging.py:arena_pieces)."""
    from vllm_patches.arenas import arena_offsets
    from vllm_patches.staging import arena_pieces

    pieces = arena_pieces(manifest, None)
    return arena_offsets([t.numel() * t.element_size() for t in pieces.values()])[1]


def test_the_device_arena_holds_a_whole_update_and_only_a_plan_with_deltas_holds_a_deltas_decoded_tensors_too():
    """Issue 40, point 4: the arena the plan sizes is the bound staging lays an update out in; a delta's decoded
    tensors come beside its payloads, so a plan without deltas refuses it (the serve plans deltas when its learner
    says --full-every > 1: tests/inflight/test_membership.py)."""
    import torch

    from inflight.wire.weights import plan_update
    from vllm_patches.device_plan import weight_sizes

    base = {f"model.layers.{i}.mlp.w": torch.randn(64, 64).to(torch.bfloat16) for i in range(6)}
    base["model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    new = {name: t.clone() for name, t in base.items()}
    for t in new.values():
        t.view(-1)[::7] += 1.0  # a seventh of the elements changed: bitmask encodings
    sizes = weight_sizes({name: t.nbytes for name, t in base.items()})
    whole, deltas = (staging_plan(sizes, "low", delta, max_ctas=0) for delta in (False, True))
    full, _ = plan_update(new, 2, 8 << 10)
    delta, _ = plan_update(new, 2, 8 << 10, base=(1, base))
    assert all(t.encoding == "bitmask" for t in delta.tensors)
    assert _arena_needs(full) <= whole.arena_bytes and _arena_needs(delta) > whole.arena_bytes
    assert _arena_needs(delta) <= deltas.arena_bytes <= 2 * sizes.total + sizes.count * 3 * 64 + 64
    assert whole.host_arena_bytes == whole.arena_bytes  # the held version: the update's tensors, once


class _Replay:
    """Plays rank 0's packed buckets back into whatever buffer the receiver broadcasts into (no group: a unit test)."""

    def __init__(self, frames):
        self.frames = list(frames)

    def broadcast(self, tensor, what: str = "bucket") -> None:
        tensor.copy_(self.frames.pop(0))


def test_a_ranks_arena_follows_its_slice_plan_and_its_kept_slices_are_received_into_it():
    """A tensor-parallel rank's device arena is its slice plan's (`rank_sizes`: one receive buffer and the rank's
    slices, no carriers), smaller than the whole update, and `arena_pieces` of its layout fits it; given the arena
    (`into`) the receipt copies each verified slice into the arena's views, without one each slice is its own copy."""
    import torch

    from inflight.wire.transfer import receive_kept
    from inflight.wire.weights import pack_bucket, plan_manifest
    from vllm_patches.arenas import DeviceArena, arena_offsets
    from vllm_patches.device_plan import rank_sizes
    from vllm_patches.placement import Placement, SliceLayout
    from vllm_patches.staging import arena_pieces

    g = torch.Generator().manual_seed(0)
    state, placements = {}, []
    for i in range(4):
        up, down = f"model.layers.{i}.mlp.up_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"
        state[up], state[down] = torch.randn(64, 48, generator=g), torch.randn(48, 64, generator=g)
        placements += [
            Placement(up, "slice", (64, 48), up, 0, 32, 32),
            Placement(down, "slice", (48, 64), down, 1, 32, 32),
        ]
    state["model.norm.weight"] = torch.ones(48)
    placements.append(Placement("model.norm.weight", "replicated", (48,), "model.norm.weight"))
    layout, manifest = SliceLayout(placements), plan_manifest(state, 1, bucket_bytes=32 << 10)
    sizes = rank_sizes({n: list(t.shape) for n, t in state.items()}, 4, TensorParallel(tp=2, kv_heads=2))
    plan = staging_plan(sizes, "low", False, max_ctas=0, bucket_bytes=32 << 10)
    needs = {
        how: arena_offsets([t.numel() * t.element_size() for t in arena_pieces(manifest, how).values()])[1]
        for how in (layout, None)
    }
    assert needs[layout] <= plan.arena_bytes < needs[None]
    frames = [
        pack_bucket(manifest, i, state, torch.empty(max(manifest.bucket_sizes), dtype=torch.uint8)).clone()
        for i in range(len(manifest.bucket_sizes))
    ]
    arena = DeviceArena(plan.arena_bytes, "cpu")
    pieces = arena.views(arena_pieces(manifest, layout))
    kept = receive_kept(_Replay(frames), manifest, layout.keep, into=(pieces.pop("buffer"), pieces))
    alone = receive_kept(_Replay(frames), manifest, layout.keep)
    assert sorted(kept) == sorted(alone) == sorted(state)
    for name, tensor in kept.items():
        expected = layout.keep(name, state[name])
        assert arena.holds(tensor) and not arena.holds(alone[name])
        assert torch.equal(tensor, expected) and torch.equal(alone[name], expected)


def test_a_reusing_tail_materialises_layers_only_below_the_staged_bytes_the_loaders_may_still_read():
    """`low`'s preparation (vllm_patches/arenas.py:ReusingTail): the update lies at the arena's end; a layer is
    served from its start while it stays below the tensors not handed out yet, the views handed out and alive, and the
    tensors the loaders buffer; a view that died frees its bytes. Beyond that: ArenaFull, nothing written."""
    import torch

    from vllm_patches.arenas import ArenaFull, DeviceArena, ReusingTail

    arena = DeviceArena(1024, "cpu")
    staged = arena.views({"a": torch.empty(64, device="meta"), "b": torch.empty(64, device="meta")}, at_end=True)
    assert [t.data_ptr() - arena.buffer.data_ptr() for t in staged.values()] == [512, 768]
    for t in staged.values():
        t.fill_(1.0)
    tail, buffered = ReusingTail(arena), []
    weights = tail.track(staged.items(), lambda: buffered)
    with tail:
        _, a = next(weights)  # the loaders read `a`: 512 bytes below it are free
        layer = torch.empty_strided((128,), (1,), dtype=torch.float32)
        assert layer.data_ptr() == arena.buffer.data_ptr() and tail.used == 512
        with pytest.raises(ArenaFull, match="reached the staged tensors the loaders still read"):
            torch.empty_strided((16,), (1,), dtype=torch.float32)
        buffered.append(a[32:])  # a loader's buffer holds a part of `a` beyond the view's own life
        del a
        _, b = next(weights)  # the loaders move on to `b`: `a`'s view is dropped, its buffered part still to be read
        assert tail.limit() == 512 + 128
        buffered.clear()
        assert tail.limit() == 768  # `a` is read: its bytes go to the next layer, up to `b`
        second = torch.empty_strided((64,), (1,), dtype=torch.float32)
        assert second.data_ptr() - arena.buffer.data_ptr() == 512
        assert torch.equal(b, torch.ones(64)), "a layer was written over a tensor still to be read"


def test_an_arena_tail_fills_the_gaps_between_the_kept_tensors_first_and_never_writes_over_them():
    """The copy commit's preparation (vllm_patches/arenas.py:ArenaTail) around the tensors the commit keeps: each
    layer at the lowest gap it fits, a gap too small left for a smaller one, and ArenaFull past the arena's end."""
    import torch

    from vllm_patches.arenas import ArenaFull, ArenaTail, DeviceArena

    arena = DeviceArena(1024, "cpu")
    pieces = {"a": torch.empty(16, device="meta"), "gap": torch.empty(32, device="meta")}
    kept = arena.views(pieces | {"c": torch.empty(16, device="meta")})  # bytes 0-64, 64-192, 192-256
    kept |= arena.views({"b": torch.empty(16, device="meta")}, at_end=True)  # bytes 960-1024
    kept.pop("gap")  # read already (a delta's payload): free again
    for t in kept.values():
        t.fill_(1.0)
    tail = ArenaTail(arena, 0, keep=kept.values())
    at = lambda t: t.data_ptr() - arena.buffer.data_ptr()  # noqa: E731
    with tail:
        big = torch.empty_strided((48,), (1,), dtype=torch.float32)  # 192 bytes: past `c`, the gap is 128
        small = torch.empty_strided((32,), (1,), dtype=torch.float32)  # 128 bytes: the gap
        rest = torch.empty_strided((128,), (1,), dtype=torch.float32)  # 512 bytes: up to `b`
        with pytest.raises(ArenaFull, match="left beside its tensors"):
            torch.empty_strided((1,), (1,), dtype=torch.float32)
    assert (at(big), at(small), at(rest)) == (256, 64, 448)
    for t in (big, small, rest):
        t.fill_(2.0)
    assert all(torch.equal(t, torch.ones(16)) for t in kept.values()), "a layer was written over a kept tensor"


def test_lows_copies_of_an_update_a_delta_may_follow_are_prepared_beside_it_where_the_plan_with_deltas_sized_it():
    """`low` keeps an update a delta may follow (`keep_base`) as checkpoint-format tensors, the delta's base, so its
    copies go beside them (`BesideBaseTail`), not over them. The plan with deltas has the room (the one it keeps for a
    delta's decoded tensors): a full update and a delta, whose kept tensors lie between its read payloads, take their
    copies there, and no kept byte changes; the plan without deltas has not, nor one without the copies' room for a
    layer (a kernel format a little larger, a delta's payload gaps): reloaded in place (`prepares_beside`)."""
    import torch

    from inflight.wire.transfer import receive_update, update_buffers
    from inflight.wire.weights import pack_bucket, plan_update, unpack_buckets
    from vllm_patches.arenas import BesideBaseTail, DeviceArena
    from vllm_patches.device_plan import weight_sizes
    from vllm_patches.staging import arena_pieces, prepares_beside

    g = torch.Generator().manual_seed(0)
    base = {f"model.layers.{i}.mlp.w": torch.randn(32, 32 + 8 * i, generator=g) for i in range(6)}
    base["model.norm.weight"] = torch.ones(32)
    new = {name: t.clone() for name, t in base.items()}
    for t in new.values():
        t.view(-1)[::9] += 1.0  # a ninth changed: bitmask encodings, decoded into the arena
    new["model.layers.2.mlp.w"] += 1.0  # all of it: sent in full, kept as a view of its payload bucket
    sizes = weight_sizes({name: t.nbytes for name, t in base.items()})
    plans = {d: staging_plan(sizes, "low", d, max_ctas=0, copy_commit=True) for d in (False, True)}
    no_layer_room = staging_plan(sizes, "low", True, max_ctas=0)  # deltas, but not the copies' largest layer
    for state, delta_base in ((new, None), (new, (1, base))):
        manifest, payloads = plan_update(state, 2, 16 << 10, base=delta_base, keep_base=True)
        assert prepares_beside(plans[True].arena_bytes, manifest, None)
        assert not prepares_beside(plans[False].arena_bytes, manifest, None)
        assert not prepares_beside(no_layer_room.arena_bytes, manifest, None)
        arena = DeviceArena(plans[True].arena_bytes, "cpu")
        views = arena.views(arena_pieces(manifest, None))
        buffers = [views.pop(f"buffer {i}") for i in range(len(update_buffers(manifest)))]
        frames = [pack_bucket(manifest, i, payloads, torch.empty_like(b)).clone() for i, b in enumerate(buffers)]
        buckets = receive_update(_Replay(frames), manifest, "cpu", into=buffers)
        kept = unpack_buckets(manifest, buckets, verify=True, base=delta_base, decoded_into=views)
        assert all(arena.holds(t) for t in kept.values())
        with BesideBaseTail(arena, 0, keep=kept.values()):  # the kernel-format copies: as large as the tensors
            copies = {name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for name, t in kept.items()}
        for t in copies.values():
            assert arena.holds(t)
            t.fill_(-1.0)
        assert all(torch.equal(kept[name], t) for name, t in new.items()), "a copy was made over the delta's base"
