"""Issue 40's device checks, torch alone (no vLLM): each skips without CUDA, and scripts/gpu_check.sh runs them on a
GPU machine. The CPU tests of the same decisions are tests/inflight/test_machine.py (point 1),
tests/vllm_patches/test_device_plan.py (points 4 and 5) and tests/wire/test_group.py (point 6).

1. a child forked after the serve front end's device checks initialises CUDA (and one forked after the old check,
   `torch.cuda.is_available()`, does not: the check can fail);
4. staging that overflows its device arena is refused while a concurrent "engine" stream keeps its cached blocks
   (a plain allocation that overflows makes the caching allocator free them: `num_alloc_retries`);
5. pinned host memory after ten updates stays at the arena's planned bytes;
6. a weights-group broadcast stalled by a sleeping peer does not delay kernels on another stream (two GPUs);
7. a captured CUDA graph computes with prepared weights copied into its parameters' storage the way the copy commit
   writes them (vllm_patches/kernel_copy.py's names and checks, then one `copy_` per parameter as vLLM's kernel-format
   reload does), and with the old ones when new tensors are swapped in by reference (why `double` copies under
   graphs); `low`'s copies, prepared over their own staged tensors on the staging stream, or beside a delta's base
   over its decoded payloads, are exact.

Whether CUDA is there is asked without initialising it here (inflight/machine.py:cuda_device_count): check 1 needs a
parent that never ran cuInit."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from inflight import machine

GPUS = machine.cuda_device_count()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no CUDA")

FORK_AFTER = """
import os, sys, torch
{check}
pid = os.fork()
if pid == 0:
    try:
        torch.ones(4, device="cuda").sum().item()
        os._exit(0)
    except Exception as exc:
        print("child:", exc, file=sys.stderr)
        os._exit(3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""
FRONT_END_CHECKS = """
from inflight import machine
device = machine.serve_device()
precision = machine.resolve_precision("auto", device)
env = machine.front_end_process_env(device, os.environ)
assert device == "cuda" and not torch.cuda.is_initialized(), (device, precision)
"""


def fork_after(check: str) -> subprocess.CompletedProcess:
    script = FORK_AFTER.format(check=textwrap.dedent(check))
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)


def test_1_a_child_forked_after_the_front_ends_device_checks_initialises_cuda():
    done = fork_after(FRONT_END_CHECKS)
    assert done.returncode == 0, done.stderr[-2000:]


def test_1_the_check_can_fail_a_child_forked_after_a_bare_availability_check_cannot_use_cuda():
    done = fork_after("torch.cuda.is_available()")
    assert done.returncode == 3, f"expected the forked child to fail (CUDA initialization error): {done.stderr}"


def test_4_staging_that_overflows_its_arena_is_refused_and_the_engines_cached_blocks_survive():
    from vllm_patches.arenas import ArenaFull, DeviceArena

    engine = torch.cuda.Stream()
    arena = DeviceArena(64 << 20, "cuda")
    with torch.cuda.stream(engine):  # the engine's working set, freed into its cache as between two steps
        blocks = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
        del blocks
    engine.synchronize()
    reserved, retries = torch.cuda.memory_reserved(), torch.cuda.memory_stats().get("num_alloc_retries", 0)
    staged: list[BaseException] = []

    def stage() -> None:
        try:
            arena.empty((64 << 20) + 1)  # one byte more than the plan
        except ArenaFull as exc:
            staged.append(exc)

    thread = threading.Thread(target=stage)
    thread.start()
    with torch.cuda.stream(engine):  # a concurrent prefill reuses its cached blocks
        again = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
    thread.join()
    engine.synchronize()
    stats = torch.cuda.memory_stats()
    assert len(staged) == 1, "the overflowing update must be refused"
    assert stats.get("num_alloc_retries", 0) == retries, "the engine's cached blocks were freed"
    assert torch.cuda.memory_reserved() == reserved and len(again) == 4


def test_4_the_hazard_a_plain_staging_allocation_that_fails_frees_the_engines_cached_blocks():
    engine = torch.cuda.Stream()
    with torch.cuda.stream(engine):
        block = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        del block
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert cached >= 512 << 20
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(torch.OutOfMemoryError):  # more than the device has free and the cache holds together
        torch.empty(free + cached + (1 << 30), dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_stats().get("num_alloc_retries", 0) > retries  # the cache was emptied to retry
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < cached  # the engine's blocks are gone


def test_5_pinned_host_memory_after_ten_updates_stays_at_the_arenas_planned_bytes():
    from vllm_patches.arenas import HostArena, arena_offsets, caching_allocator_bytes

    shapes = [(1000, 1000), (333, 77), (4096,)]
    sizes = [2 * int(torch.Size(s).numel()) for s in shapes]
    _, planned = arena_offsets(sizes)
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    before = stats().get("allocated_bytes.current", 0)
    arena = HostArena(planned, pin=True)
    try:
        for step in range(10):
            update = {f"t{i}": torch.full(s, step, dtype=torch.bfloat16, device="cuda") for i, s in enumerate(shapes)}
            held = arena.copy_in(update)
        assert arena.pinned and arena.nbytes == planned
        assert stats().get("allocated_bytes.current", 0) == before, "something else was pinned"
        assert all(bool((t == 9).all()) for t in held.values())
    finally:
        arena.close()
    old = [torch.empty(s, dtype=torch.bfloat16, pin_memory=True) for s in shapes for _ in range(2)]
    if stats():
        assert stats()["allocated_bytes.current"] - before >= caching_allocator_bytes(sizes) // 2
    del old


def _sleeping_peer(port: int, sleep_s: float) -> None:
    from inflight.wire.group import GroupAddress, WeightsGroup

    torch.cuda.set_device(1)
    member = WeightsGroup(GroupAddress("127.0.0.1", port, 2, "stalled", "nccl", 60.0), 0)
    time.sleep(sleep_s)  # a slow learner: the serve's broadcast waits on it
    member.broadcast(torch.ones(64 << 20, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()


def _kernels_s(stream: torch.cuda.Stream, a: torch.Tensor) -> float:
    torch.cuda.synchronize(0)
    start = time.perf_counter()
    with torch.cuda.stream(stream):
        for _ in range(50):
            a = a @ a
            a = a / a.norm()
    stream.synchronize()
    return time.perf_counter() - start


@pytest.mark.skipif(GPUS < 2, reason="a weights group needs two GPUs (NCCL refuses two ranks on one device)")
def test_6_a_broadcast_stalled_by_a_sleeping_peer_does_not_delay_kernels_on_another_stream():
    from inflight.wire.group import GroupAddress, WeightsGroup, open_store

    store = open_store(GroupAddress("127.0.0.1", 0, 2, timeout_s=60.0), is_host=True)
    peer = mp.get_context("spawn").Process(target=_sleeping_peer, args=(store.port, 4.0))
    peer.start()
    torch.cuda.set_device(0)
    member = WeightsGroup(GroupAddress("127.0.0.1", store.port, 2, "stalled", "nccl", 60.0), 1, store)
    a = torch.randn(4096, 4096, device="cuda")
    engine = torch.cuda.Stream()
    alone = min(_kernels_s(engine, a) for _ in range(3))
    bucket = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    receiving = threading.Thread(target=member.broadcast, args=(bucket,))
    with torch.cuda.stream(torch.cuda.Stream()):
        receiving.start()
        time.sleep(0.5)  # the broadcast's kernel is resident, spinning for the sleeping peer
        beside = min(_kernels_s(engine, a) for _ in range(3))
    receiving.join(60)
    peer.join(60)
    print(f"\n50 matmuls alone {alone * 1e3:.1f} ms, beside a stalled broadcast {beside * 1e3:.1f} ms")
    assert beside < 1.5 * alone and peer.exitcode == 0


def test_6_the_weights_groups_nccl_kernels_are_capped_at_max_ctas_on_this_torch():
    """One GPU can hold no two NCCL ranks, so the part of point 6 that one GPU proves: torch's NCCL options carry
    `max_ctas` on this build (limit_ctas would otherwise leave NCCL's default silently), and a group built with the cap
    forms and broadcasts."""
    import torch.distributed as dist

    from inflight.wire.group import WEIGHTS_MAX_CTAS, GroupAddress, WeightsGroup, limit_ctas

    opts = dist.ProcessGroupNCCL.Options()
    limit_ctas(opts, WEIGHTS_MAX_CTAS)
    assert opts.config.max_ctas == WEIGHTS_MAX_CTAS
    torch.cuda.set_device(0)
    group = WeightsGroup(GroupAddress("127.0.0.1", 0, 1, "capped", "nccl", 60.0), 0)
    bucket = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
    group.broadcast(bucket)
    torch.cuda.synchronize()
    assert int(bucket[-1]) == (1 << 20) - 1
    group.close()


def test_6_a_group_formed_on_a_joining_thread_broadcasts_from_another_thread():
    """A serve worker forms the weights group on a thread of its own (vllm_patches/joining.py, so the engine decodes
    meanwhile) and its staging thread broadcasts on it: an NCCL communicator made on one thread, used from another.
    One GPU holds one rank, so the group is of one; no control (the device a one-GPU thread sets cannot be wrong)."""
    from inflight.wire.group import GroupAddress
    from vllm_patches.joining import GroupJoin

    formed = []
    address = GroupAddress("127.0.0.1", 0, 1, "joined-off-thread", "nccl", 60.0)
    join = GroupJoin(address, 0, torch.device("cuda", 0), lambda j, g: formed.append(g) or True).start()
    deadline = time.monotonic() + 60
    while join.state().state == "joining" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert join.state().state == "joined", join.state().error
    bucket = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
    staging = threading.Thread(target=formed[0].broadcast, args=(bucket,))
    staging.start()
    staging.join(60)
    torch.cuda.synchronize()
    assert int(bucket[-1]) == (1 << 20) - 1
    formed[0].close()


def captured_linear() -> tuple[torch.nn.Module, torch.Tensor, torch.cuda.CUDAGraph, torch.Tensor]:
    """A model of one linear layer, its input, and a CUDA graph captured on it with its output buffer."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(64, 64, bias=False, device="cuda").requires_grad_(False)
    x = torch.randn(8, 64, device="cuda")
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        model.proj(x)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model.proj(x)
    return model, x, graph, out


def test_7_a_cuda_graph_replays_on_prepared_weights_copied_into_its_parameters_storage():
    from vllm_patches.kernel_copy import kernel_weights

    model, x, graph, out = captured_linear()
    new = torch.randn(64, 64, device="cuda")
    weights = kernel_weights([(model.proj, {"_parameters": {"weight": new}})], model)
    assert [name for name, _ in weights] == ["proj.weight"]
    with torch.no_grad():
        for name, tensor in weights:  # vLLM's kernel-format reload: one copy_ per named parameter
            model.get_parameter(name).copy_(tensor)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x @ new.t())


def test_7_the_hazard_a_graph_keeps_computing_with_the_old_weights_when_new_ones_are_swapped_in_by_reference():
    model, x, graph, out = captured_linear()
    old = model.proj.weight.detach().clone()
    model.proj.__dict__["_parameters"] = {"weight": torch.nn.Parameter(torch.randn_like(old), requires_grad=False)}
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x @ old.t())
    assert not torch.allclose(out, x @ model.proj.weight.t())


def staging_setup(count: int, numel: int) -> tuple[list, list, torch.cuda.Stream, torch.cuda.Event, list]:
    """`count` sources of `numel` floats (1.0, 2.0, ...), as many zeroed live tensors, the staging stream, its ready
    event and the list its layers go into; every allocation done before staging starts."""
    sources = [torch.full((numel,), float(i + 1), device="cuda") for i in range(count)]
    live = [torch.zeros(numel, device="cuda") for _ in range(count)]
    torch.cuda.synchronize()
    return sources, live, torch.cuda.Stream(), torch.cuda.Event(), []


def commit_behind_one_event(stage, ready: torch.cuda.Event, live: list, layers: list) -> None:
    """Run `stage` on a thread of its own (the staging thread), then copy its `layers` into `live` on the engine's
    stream behind `ready`, as the commit does, and wait for the copies."""
    thread = threading.Thread(target=stage)
    thread.start()
    thread.join()
    torch.cuda.current_stream().wait_event(ready)
    for target, layer in zip(live, layers, strict=True):
        target.copy_(layer)  # the commit's copies, on the engine's stream
    torch.cuda.synchronize()


def test_7_lows_copies_prepared_over_their_staged_tensors_on_the_staging_stream_are_exact():
    """`low` on a GPU (vllm_patches/arenas.py:ReusingTail): on the staging thread's stream each layer is materialised
    over staged bytes an earlier layer's copy read, those reads still queued when the layer's writes are; one stream
    orders them. Every layer must equal what it was made from, lie in the arena, and reach the live tensors through
    the engine stream's copy behind one event, as `low`'s commit copies them in."""
    from vllm_patches.arenas import DeviceArena, ReusingTail

    count, numel = 8, 4 << 20  # 16 MiB tensors: copies that take long enough to still be queued
    arena = DeviceArena((count + 1) * numel * 4 + 4096, "cuda")  # the update and one layer's room
    staged = arena.views({f"t{i}": torch.empty(numel, device="meta") for i in range(count)}, at_end=True)
    sources, live, side, ready, layers = staging_setup(count, numel)

    def stage() -> None:
        with torch.cuda.stream(side):
            for tensor, source in zip(staged.values(), sources, strict=True):
                tensor.copy_(source)  # the receive
            tail = ReusingTail(arena)
            with tail:
                for _, view in tail.track(list(staged.items())):
                    layer = torch.empty_strided((numel,), (1,), dtype=torch.float32, device="cuda")
                    layers.append(layer.copy_(view))  # a loader's copy into the materialised layer
                    del view
            ready.record(side)

    commit_behind_one_event(stage, ready, live, layers)
    assert all(arena.holds(layer) for layer in layers) and len(layers) == count
    for i, target in enumerate(live):
        assert torch.equal(target, sources[i]), f"layer {i} was written over before its source was read"


def test_7_lows_copies_prepared_beside_a_deltas_base_over_its_decoded_payloads_are_exact():
    """`low` on a GPU for an update a delta may follow (vllm_patches/arenas.py:BesideBaseTail): the staging stream
    decodes each payload into its kept tensor (the next delta's base), then materialises the layers in the gaps the
    payloads leave between the kept tensors, over payload bytes whose decode is still queued; one stream orders them.
    Every layer must equal its kept tensor, lie in a payload's gap, leave every kept tensor as decoded, and reach the
    live tensors through the engine stream's copy behind one event."""
    from vllm_patches.arenas import BesideBaseTail, DeviceArena

    count, numel = 8, 4 << 20  # 16 MiB tensors: decodes that take long enough to still be queued
    arena = DeviceArena(2 * count * numel * 4 + 4096, "cuda")  # payloads and kept tensors, interleaved
    names = [name for i in range(count) for name in (f"payload {i}", f"kept {i}")]
    views = arena.views({name: torch.empty(numel, device="meta") for name in names})
    payloads = [views[f"payload {i}"] for i in range(count)]
    kept = [views[f"kept {i}"] for i in range(count)]
    sources, live, side, ready, layers = staging_setup(count, numel)

    def stage() -> None:
        with torch.cuda.stream(side):
            for payload, source in zip(payloads, sources, strict=True):
                payload.copy_(source)  # the receive
            for target, payload in zip(kept, payloads, strict=True):
                torch.mul(payload, 2.0, out=target)  # the delta's decode into the kept tensor
            with BesideBaseTail(arena, 0, keep=kept):
                for target in kept:
                    layer = torch.empty_strided((numel,), (1,), dtype=torch.float32, device="cuda")
                    layers.append(layer.copy_(target))  # a loader's copy into the materialised layer
            ready.record(side)

    commit_behind_one_event(stage, ready, live, layers)
    gaps = {p.data_ptr() for p in payloads}
    assert len(layers) == count and all(layer.data_ptr() in gaps for layer in layers)
    for i in range(count):
        assert torch.equal(live[i], 2 * sources[i]), f"layer {i} was made over a payload before it was decoded"
        assert torch.equal(kept[i], 2 * sources[i]), f"kept tensor {i} (the delta's base) was written over"
