"""StagedUpdate on a CUDA device (vllm_patches/staging.py): a real gloo weights group from a sender process, buckets
received on a side stream, CRC-checked from host copies, and committed by device-to-device copies after the
committing stream waits for the staging stream. Skipped without CUDA (scripts/gpu_check.sh runs it on a GPU machine);
on CPU the same class is exercised by every real-engine update test."""

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


def sender_main(address: GroupAddress, seed: int, device: str) -> None:
    """The learner's side: rank 0 sends its state from `device` (a GPU learner's state is on CUDA)."""
    state = {name: t.to(device) for name, t in make_state(seed).items()}
    group = WeightsGroup(address, 0, store=open_store(address, is_host=False))
    send_update(group, plan_manifest(state, 7, 256 << 10), state)
    group.close()


@pytest.mark.parametrize("sender_device", ["cpu", "cuda"])
def test_cuda_staging_receives_on_a_side_stream_and_commits_bit_exact(sender_device):
    from vllm_patches.staging import StagedUpdate

    store = open_store(GroupAddress("127.0.0.1", 0, 2, timeout_s=120.0), is_host=True)
    address = GroupAddress("127.0.0.1", store.port, 2, "cuda-staging", "gloo", 120.0)
    sender = mp.get_context("spawn").Process(target=sender_main, args=(address, 3, sender_device), daemon=True)
    sender.start()
    group = WeightsGroup(address, 1, store)
    state = make_state(3)
    manifest = plan_manifest(state, 7, 256 << 10)
    on_device = plan_manifest({n: t.cuda() for n, t in state.items()}, 7, 256 << 10)
    assert on_device.encode() == manifest.encode()  # the same layout and checksums from a CUDA state
    assert len(manifest.bucket_sizes) > 2  # several buckets, one tensor bigger than a bucket
    stage = StagedUpdate(manifest, group, "cuda").start()
    assert stage.wait(120), "the update was not staged within 120 s"
    sender.join(60)
    group.close()
    assert stage.state.value == "staged", stage.error
    params = {name: torch.zeros_like(t, device="cuda") for name, t in state.items()}
    stage.ready_on_current_stream()
    for name, view in stage.tensors.items():
        assert view.is_cuda and view.dtype == state[name].dtype and list(view.shape) == list(state[name].shape)
        params[name].copy_(view)
    torch.cuda.synchronize()
    for name, t in state.items():
        assert torch.equal(params[name].cpu(), t), name
