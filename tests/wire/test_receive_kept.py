"""inflight/wire/transfer.py:receive_kept, a tensor-parallel worker's receive (issue 41): it keeps only what its
`keep` returns of each tensor, yet every whole tensor is verified as it passes (the manifest's checksums, or the
trailer's after the buckets); a delta is decoded onto the rank's own slices of the base, each payload checked first.
A narrow unit test: the group is a stand-in that replays the sender's packed buckets (the real group is exercised by
tests/vllm_patches/test_sliced_staging.py)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from inflight.wire.secure import weights_key
from inflight.wire.transfer import receive_buffer, receive_kept
from inflight.wire.weights import ManifestError, pack_bucket, plan_manifest, plan_update


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


def _delta_case(weights_key: bytes | None = None):
    """A base and a new version of four tensors, each kept differently by rank 1, and the delta between them: the
    rows of w0 (bitmask), the columns of w1 (indices), w2 whole (bitmask), w3 not at all, w4's rows (sent in full)."""
    g = torch.Generator().manual_seed(2)
    base = {f"w{i}": torch.randn(16, 12, generator=g).to(torch.bfloat16) for i in range(5)}
    new = {name: t.clone() for name, t in base.items()}
    for name, fraction in {"w0": 0.3, "w1": 0.01, "w2": 0.3, "w3": 0.3, "w4": 1.0}.items():
        flat = new[name].view(-1)
        where = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * fraction))]
        flat[where] += 1
    manifest, payloads = plan_update(new, 8, bucket_bytes=1 << 10, weights_key=weights_key, base=(7, base))
    return base, new, manifest, payloads


def _rank1(name: str, whole: torch.Tensor) -> torch.Tensor | None:
    return {"w0": whole.narrow(0, 8, 8), "w1": whole.narrow(1, 6, 6), "w2": whole, "w3": None, "w4": whole[8:]}[name]


def _kept_base(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: kept.clone() for name in base if (kept := _rank1(name, base[name])) is not None}


def test_a_rank_keeps_its_rows_or_columns_of_a_delta_decoded_from_the_payload_onto_its_own_slice_of_the_base():
    base, new, manifest, payloads = _delta_case()
    assert {t.name: t.encoding for t in manifest.tensors} == {
        "w0": "bitmask", "w1": "indices", "w2": "bitmask", "w3": "bitmask", "w4": "full"
    }  # fmt: skip
    kept = receive_kept(Replay(_frames(manifest, payloads)), manifest, _rank1, base=(7, _kept_base(base)))
    assert sorted(kept) == ["w0", "w1", "w2", "w4"]
    for name, tensor in kept.items():
        assert _bits(tensor) == _bits(_rank1(name, new[name])), name
    into = {name: torch.full_like(t, 7.0) for name, t in kept.items()}  # a worker's arena: decoded in place
    buffer = torch.empty(max(manifest.bucket_sizes), dtype=torch.uint8)
    again = receive_kept(
        Replay(_frames(manifest, payloads)), manifest, _rank1, into=(buffer, into), base=(7, _kept_base(base))
    )
    assert all(again[name] is into[name] and _bits(again[name]) == _bits(kept[name]) for name in kept)


def test_a_corrupted_delta_payload_fails_naming_the_tensor_though_the_bad_byte_lies_outside_the_ranks_columns():
    base, new, manifest, payloads = _delta_case()
    entry = next(t for t in manifest.tensors if t.name == "w1")
    frames = _frames(manifest, payloads)
    values = entry.offset + entry.nbytes - entry.count * 2  # w1's values follow its int32 indices
    index = frames[entry.bucket][entry.offset : values].clone().view(torch.int32)
    first_outside = next(i for i, at in enumerate(index.tolist()) if at % 12 < 6)  # a change to a column rank 0 keeps
    frames[entry.bucket][values + 2 * first_outside] ^= 0x01
    with pytest.raises(ManifestError, match="tensor w1: delta payload checksum"):
        receive_kept(Replay(frames), manifest, _rank1, base=(7, _kept_base(base)))


def test_with_a_secret_a_slice_of_a_delta_is_checked_by_its_payloads_tag_and_a_replayed_delta_is_refused():
    key = weights_key(b"a shared secret of 32 bytes....!")
    base, new, manifest, payloads = _delta_case(key)
    kept = receive_kept(
        Replay(_frames(manifest, payloads)), manifest, _rank1, weights_key=key, base=(7, _kept_base(base))
    )
    assert _bits(kept["w0"]) == _bits(new["w0"][8:])
    replay = msgspec.structs.replace(manifest, version=9, base_version=8)  # the same delta presented as v8 -> v9
    with pytest.raises(ManifestError, match="tensor w0: its delta payload tag does not verify"):
        receive_kept(Replay(_frames(manifest, payloads)), replay, _rank1, weights_key=key, base=(8, kept))


def test_a_delta_on_a_version_the_rank_does_not_hold_is_refused_once_its_broadcasts_are_drained():
    base, _, manifest, payloads = _delta_case()
    group = Replay(_frames(manifest, payloads))
    with pytest.raises(ManifestError, match="update v8 is a delta on v7 but this receiver holds v6"):
        receive_kept(group, manifest, _rank1, base=(6, _kept_base(base)))
    assert group.frames == [] and group.sizes == [end - first for _, first, end in manifest.parts()]
    with pytest.raises(ManifestError, match=r"tensor w0: the delta's base is not held in bfloat16\[8, 12\]"):
        receive_kept(
            Replay(_frames(manifest, payloads)), manifest, _rank1, base=(7, {**_kept_base(base), "w0": base["w0"]})
        )


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


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
