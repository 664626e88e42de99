"""inflight/wire/transfer.py:receive_kept, a tensor-parallel worker's receive (issue 41): it keeps only what its
`keep` returns of each tensor, yet every whole tensor is verified as it passes (the manifest's checksums, or the
trailer's after the buckets). A narrow unit test: the group is a stand-in that replays the sender's packed buckets
(the real group is exercised by tests/vllm_patches/test_sliced_staging.py)."""

from __future__ import annotations

import pytest
import torch

from inflight.wire.transfer import receive_buffer, receive_kept
from inflight.wire.weights import ManifestError, pack_bucket, plan_manifest


class Replay:
    """Plays rank 0's broadcasts back: each call fills the receiver's buffer with the next packed bucket."""

    def __init__(self, frames: list[torch.Tensor]):
        self.frames = list(frames)
        self.sizes: list[int] = []

    def broadcast(self, tensor: torch.Tensor, what: str = "bucket") -> None:
        frame = self.frames.pop(0)
        tensor.copy_(frame)
        self.sizes.append(tensor.numel())


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(8, 6, generator=g, dtype=torch.float32) for i in range(5)}


def _frames(manifest, state) -> list[torch.Tensor]:
    out = torch.empty(max(manifest.bucket_sizes), dtype=torch.uint8)
    return [pack_bucket(manifest, i, state, out).clone() for i in range(len(manifest.bucket_sizes))]


def _rows(rank: int):
    return lambda name, whole: whole.narrow(0, rank * 4, 4) if name != "w4" else None


def test_a_rank_keeps_only_its_rows_of_each_verified_tensor_through_one_reused_buffer():
    state = _state()
    manifest = plan_manifest(state, 1, bucket_bytes=2 * 8 * 6 * 4)
    group = Replay(_frames(manifest, state))
    kept = receive_kept(group, manifest, _rows(1))
    assert sorted(kept) == ["w0", "w1", "w2", "w3"]
    for name, tensor in kept.items():
        assert torch.equal(tensor, state[name][4:8]) and tensor.is_contiguous()
    assert len(group.sizes) == len(manifest.bucket_sizes) >= 3


def test_a_tensor_larger_than_a_bucket_arrives_in_parts_and_the_rank_keeps_its_rows_of_the_verified_whole():
    state = {**_state(), "big": torch.randn(64, 6, generator=torch.Generator().manual_seed(1))}
    manifest = plan_manifest(state, 1, bucket_bytes=2 * 8 * 6 * 4)  # "big" is 1536 B: four parts of 384
    parts = manifest.parts()
    assert len(parts) == len(manifest.bucket_sizes) + 3
    packed = _frames(manifest, state)
    group = Replay([packed[i][first:end] for i, first, end in parts])
    kept = receive_kept(group, manifest, lambda name, whole: whole.narrow(0, len(whole) // 2, len(whole) // 2))
    assert torch.equal(kept["big"], state["big"][32:]) and torch.equal(kept["w0"], state["w0"][4:])
    assert group.sizes == [end - first for _, first, end in parts]


def test_a_corrupted_tensor_fails_the_receive_naming_it_though_the_rank_keeps_none_of_its_bad_rows():
    state = _state()
    manifest = plan_manifest(state, 1, bucket_bytes=1 << 20)
    frames = _frames(manifest, state)
    entry = next(t for t in manifest.tensors if t.name == "w2")
    frames[entry.bucket][entry.offset + 4] ^= 0xFF  # a byte of row 0: rank 1 keeps rows 4..7 only
    with pytest.raises(ManifestError, match="tensor w2: checksum"):
        receive_kept(Replay(frames), manifest, _rows(1))


def test_a_delta_update_is_refused_by_a_worker_that_keeps_slices():
    state = _state()
    manifest = plan_manifest(state, 2, bucket_bytes=1 << 20)
    delta = manifest.__class__(**{**{f: getattr(manifest, f) for f in manifest.__struct_fields__}, "base_version": 1})
    with pytest.raises(ManifestError, match="keeps slices"):
        receive_kept(Replay([]), delta, _rows(0))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_the_host_bucket_buffer_goes_back_to_the_os_as_soon_as_the_receive_drops_it():
    """Not to malloc's heap, where a freed buffer of the largest tensor stayed resident under the commit after it
    (checked to fail with a plain torch.empty: once malloc has freed a larger block, 12 MiB come from its heap)."""
    warm = torch.empty(16 << 20, dtype=torch.uint8)
    warm.fill_(1)
    del warm  # malloc's mmap threshold now above 12 MiB
    before = _resident_bytes()
    buffer = receive_buffer(12 << 20, "cpu")
    buffer.fill_(1)  # every page touched, as a received bucket's
    assert _resident_bytes() - before > 11 << 20
    del buffer
    assert _resident_bytes() - before < 1 << 20
