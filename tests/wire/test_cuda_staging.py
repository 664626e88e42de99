"""StagedUpdate on a CUDA device (vllm_patches/staging.py): a real gloo weights group from a sender process, buckets
received on a side stream, checked (a CRC32 from host copies, a sum31 on the device with no host copy), and committed
by device-to-device copies after the committing stream waits for the staging stream. Skipped without CUDA
(scripts/gpu_check.sh runs it on a GPU machine); on CPU the same class is exercised by every real-engine update test."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from inflight.wire.group import GroupAddress, WeightsGroup, open_store
from inflight.wire.transfer import send_update
from inflight.wire.weights import plan_manifest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


def make_state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(1000, 256, generator=gen).to(torch.bfloat16),
        "layers.0.weight": torch.randn(700, 300, generator=gen),
        "layers.0.bias": torch.randn(333, generator=gen).to(torch.float16),
        "head.weight": torch.randn(256, 1000, generator=gen).to(torch.bfloat16),
    }


def sender_main(address: GroupAddress, seed: int, device: str, kind: str) -> None:
    """The learner's side: rank 0 sends its state from `device` (a GPU learner's state is on CUDA)."""
    state = {name: t.to(device) for name, t in make_state(seed).items()}
    group = WeightsGroup(address, 0, store=open_store(address, is_host=False))
    send_update(group, plan_manifest(state, 7, 256 << 10, checksum_kind=kind), state)
    group.close()


@pytest.mark.parametrize("kind", ["crc32", "sum31"])
@pytest.mark.parametrize("sender_device", ["cpu", "cuda"])
def test_cuda_staging_receives_on_a_side_stream_and_commits_bit_exact(sender_device, kind, monkeypatch):
    from inflight.wire import weights
    from vllm_patches.staging import StagedUpdate

    host_copies = []
    to_host = weights._to_host
    monkeypatch.setattr(weights, "_to_host", lambda bucket: host_copies.append(bucket.numel()) or to_host(bucket))

    store = open_store(GroupAddress("127.0.0.1", 0, 2, timeout_s=120.0), is_host=True)
    address = GroupAddress("127.0.0.1", store.port, 2, "cuda-staging", "gloo", 120.0)
    sender = mp.get_context("spawn").Process(target=sender_main, args=(address, 3, sender_device, kind), daemon=True)
    sender.start()
    group = WeightsGroup(address, 1, store)
    state = make_state(3)
    manifest = plan_manifest(state, 7, 256 << 10, checksum_kind=kind)
    on_device = plan_manifest({n: t.cuda() for n, t in state.items()}, 7, 256 << 10, checksum_kind=kind)
    assert on_device.encode() == manifest.encode()  # the same layout and checksums from a CUDA state
    assert len(manifest.bucket_sizes) > 2  # several buckets, one tensor bigger than a bucket
    stage = StagedUpdate(manifest, group, "cuda").start()
    assert stage.wait(120), "the update was not staged within 120 s"
    sender.join(60)
    group.close()
    assert stage.state.value == "staged", stage.error
    # a CRC32 is taken from a host copy of every bucket; a sum31 where the bucket is, on the GPU
    assert (len(host_copies) == len(manifest.bucket_sizes)) if kind == "crc32" else host_copies == []
    params = {name: torch.zeros_like(t, device="cuda") for name, t in state.items()}
    stage.ready_on_current_stream()
    for name, view in stage.tensors.items():
        assert view.is_cuda and view.dtype == state[name].dtype and list(view.shape) == list(state[name].shape)
        params[name].copy_(view)
    torch.cuda.synchronize()
    for name, t in state.items():
        assert torch.equal(params[name].cpu(), t), name


def send_payloads(address: GroupAddress, manifest: bytes, payloads: dict[str, torch.Tensor]) -> None:
    """Rank 0 sends an update already planned (a delta's payloads, say) from a GPU."""
    from inflight.wire.weights import UpdateManifest

    group = WeightsGroup(address, 0, store=open_store(address, is_host=False))
    send_update(group, UpdateManifest.decode(manifest), {n: t.cuda() for n, t in payloads.items()})
    group.close()


def stage_from_sender(manifest, payloads, held=None, arenas=None, layout=None):
    """Receive `manifest` into CUDA buckets from a real sender process: the StagedUpdate once staged."""
    from vllm_patches.staging import StagedUpdate

    store = open_store(GroupAddress("127.0.0.1", 0, 2, timeout_s=120.0), is_host=True)
    address = GroupAddress("127.0.0.1", store.port, 2, "cuda-held", "gloo", 120.0)
    args = (address, manifest.encode(), payloads)
    sender = mp.get_context("spawn").Process(target=send_payloads, args=args, daemon=True)
    sender.start()
    group = WeightsGroup(address, 1, store)
    stage = StagedUpdate(manifest, group, "cuda", held=held, arenas=arenas, layout=layout).start()
    assert stage.wait(120), "the update was not staged within 120 s"
    sender.join(60)
    group.close()
    assert stage.state.value == "staged", stage.error
    return stage


def arenas_for(state: dict[str, torch.Tensor], delta: bool = False):
    """A worker's arenas at the plan's bytes for updates of `state` (vllm_patches/device_plan.py)."""
    from vllm_patches.arenas import StagingArenas
    from vllm_patches.device_plan import staging_plan, weight_sizes

    plan = staging_plan(weight_sizes({n: t.nbytes for n, t in state.items()}), "low", delta, max_ctas=0)
    return StagingArenas(plan.arena_bytes, plan.host_arena_bytes, "cuda")


def test_an_in_place_update_is_staged_in_the_device_arena_and_the_next_one_moves_it_to_the_pinned_host_arena():
    from vllm_patches.staging import HeldTensors

    first, second = make_state(4), make_state(6)
    arenas = arenas_for(first)
    params = {name: torch.zeros_like(t, device="cuda") for name, t in first.items()}
    stage = stage_from_sender(plan_manifest(first, 2, 256 << 10, checksum_kind="sum31"), first, arenas=arenas)
    allocated = torch.cuda.memory_allocated()
    assert all(arenas.staging.holds(t) for t in stage.kept().values())  # the buckets are the arena's
    stage.ready_on_current_stream()
    [params[name].copy_(view) for name, view in stage.tensors.items()]  # the in-place commit's, on the engine's stream
    held = HeldTensors(2, stage.kept())
    stage.release()
    following = stage_from_sender(plan_manifest(second, 3, 256 << 10, "sum31"), second, held=held, arenas=arenas)
    assert all(t.device.type == "cpu" and t.is_pinned() and torch.equal(t, first[n]) for n, t in held.tensors.items())
    assert all(torch.equal(following.tensors[n].cpu(), t) for n, t in second.items())
    assert torch.cuda.memory_allocated() == allocated  # nothing staged outside the arena
    assert all(torch.equal(params[n].cpu(), t) for n, t in first.items())
    arenas.close()


def test_a_delta_on_a_base_held_in_host_memory_decodes_into_the_device_arena_bit_exact():
    from inflight.wire.weights import plan_update
    from vllm_patches.staging import HeldTensors

    base, new = make_state(5), make_state(5)
    new["layers.0.weight"][3:5] += 1.0  # a few rows changed: an indices or bitmask encoding
    manifest, payloads = plan_update(new, 6, 256 << 10, base=(5, base), keep_base=True, checksum_kind="sum31")
    assert any(t.encoding != "full" for t in manifest.tensors)
    arenas = arenas_for(base, delta=True)
    held = HeldTensors(5, arenas.hold(base))  # the live version, in the (pinned) host arena
    stage = stage_from_sender(manifest, payloads, held=held, arenas=arenas)
    assert all(arenas.staging.holds(t) and torch.equal(t.cpu(), new[n]) for n, t in stage.kept().items())
    arenas.close()


class SecondHalfRows:
    """Rank 1 of two, as staging asks it (vllm_patches/placement.py:SliceLayout, which needs vLLM to resolve): the
    second half of every matrix's rows, vectors kept whole."""

    full: list[str] = []

    def keep(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        rows = whole.shape[0]
        return whole.narrow(0, rows // 2, rows - rows // 2) if whole.dim() == 2 else whole


def test_a_tensor_parallel_rank_decodes_a_delta_onto_its_own_rows_held_in_host_memory_into_the_device_arena():
    from inflight.wire.weights import plan_update
    from vllm_patches.arenas import StagingArenas
    from vllm_patches.device_plan import staging_plan, weight_sizes
    from vllm_patches.staging import HeldTensors

    base, new, rows = make_state(5), make_state(5), SecondHalfRows()
    new["layers.0.weight"][::7] += 1.0  # rows in both halves: the changes outside rank 1's rows are skipped
    new["head.weight"][:, ::3] -= 1.0
    manifest, payloads = plan_update(new, 6, 256 << 10, base=(5, base), keep_base=True, checksum_kind="sum31")
    assert {t.encoding for t in manifest.tensors} - {"full"}, "a sparse encoding"
    kept_base = {name: rows.keep(name, t).contiguous() for name, t in base.items()}
    sizes = weight_sizes({n: t.nbytes for n, t in kept_base.items()})
    plan = staging_plan(sizes, "low", True, max_ctas=0, bucket_bytes=max(manifest.bucket_sizes))
    arenas = StagingArenas(plan.arena_bytes, plan.host_arena_bytes, "cuda")
    held = HeldTensors(5, arenas.hold(kept_base), rows)  # the rank's rows of the live version, pinned
    stage = stage_from_sender(manifest, payloads, held=held, arenas=arenas, layout=rows)
    for name, t in stage.kept().items():
        assert t.is_cuda and arenas.staging.holds(t) and torch.equal(t.cpu(), rows.keep(name, new[name])), name
    arenas.close()
