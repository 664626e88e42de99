"""The per-tensor checksums of an update (inflight/wire/checksum.py): `sum31` against a plain-Python reading of its
definition, the corruptions it must see, the kind a sender picks, and a manifest of each kind verified (or refused)
on receipt. The CUDA half (a GPU's sum equal to the host's, bit for bit, on every size and dtype) runs on a GPU
machine (scripts/gpu_check.sh)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from inflight.wire import checksum
from inflight.wire.checksum import bytes_checksum, checksum_kind_for, sum31, tensor_checksum
from inflight.wire.weights import ManifestError, UpdateManifest, pack_bucket, plan_manifest, unpack_buckets

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
P = (1 << 31) - 1


def reference_sum31(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    words = [int.from_bytes(data[i : i + 2], "little") for i in range(0, len(data), 2)]
    return sum(w * ((i + 1) * 48271 % P) for i, w in enumerate(words)) % P


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [0, 1, 2, 7, 64, 1001, 4096 + 3])
def test_sum31_is_the_position_weighted_word_sum_modulo_the_prime(n, monkeypatch):
    monkeypatch.setattr(checksum, "_ROW_WORDS", 8)  # rows and chunks of rows: their sums must add up as one
    monkeypatch.setattr(checksum, "_ROW_WEIGHTS", {})
    monkeypatch.setattr(checksum, "_CHUNK_ROWS", 3)
    data = random_bytes(n)
    assert sum31(data) == reference_sum31(data.numpy().tobytes())


@pytest.mark.parametrize("kind", ["crc32", "sum31"])
def test_a_running_checksum_fed_in_pieces_of_any_size_equals_the_checksum_of_the_whole(kind, monkeypatch):
    """A tensor sent in parts is checksummed part by part (inflight/wire/weights.py:RunningDigest): with 16-byte rows
    nearly every piece ends inside a row, and sum31 must carry the rest into the next."""
    monkeypatch.setattr(checksum, "_ROW_WORDS", 8)
    monkeypatch.setattr(checksum, "_ROW_WEIGHTS", {})
    monkeypatch.setattr(checksum, "_CHUNK_ROWS", 3)
    data = random_bytes(4099, seed=3)
    for cuts in ([], [1], [5, 6, 16, 17, 40], list(range(3, 4099, 7)), [2048]):
        running = checksum.RunningChecksum(kind)
        for first, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
            running.update(data[first:end])
        assert running.value() == bytes_checksum(data, kind), cuts


def test_sum31_sees_every_single_word_changed_and_two_different_words_swapped():
    data = random_bytes(2048, seed=1)
    base = sum31(data)
    for at in range(0, 2048, 2):
        changed = data.clone()
        changed[at] ^= 1 + at % 255
        assert sum31(changed) != base, at
    words = data.view(torch.int16).clone()
    i, j = 10, 700
    assert words[i] != words[j]
    words[[i, j]] = words[[j, i]]
    assert sum31(words.view(torch.uint8)) != base


def test_a_tensor_checksum_is_that_of_its_bytes_whatever_its_dtype_or_layout():
    t = torch.randn(33, 17).to(torch.bfloat16)
    as_bytes = t.contiguous().reshape(-1).view(torch.uint8)
    for kind in ("crc32", "sum31"):
        assert (
            tensor_checksum(t.t().contiguous().t(), kind) == tensor_checksum(t, kind) == bytes_checksum(as_bytes, kind)
        )
    with pytest.raises(ValueError, match=r"checksum kind is 'md5', expected one of \['crc32', 'sum31'\]"):
        bytes_checksum(as_bytes, "md5")


def test_a_sender_on_an_accelerator_sums_on_it_and_one_in_host_memory_takes_crc32():
    assert checksum_kind_for("cpu") == "crc32"
    assert checksum_kind_for("cuda:1") == checksum_kind_for(torch.device("cuda")) == "sum31"


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {"a.weight": torch.randn(40, 30, generator=gen).to(torch.bfloat16), "b.bias": torch.randn(11, generator=gen)}


def buckets_of(manifest: UpdateManifest, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [
        pack_bucket(manifest, i, tensors, torch.empty(size, dtype=torch.uint8)).clone()
        for i, size in enumerate(manifest.bucket_sizes)
    ]


def test_a_sum31_manifest_round_trips_verifies_and_refuses_a_flipped_byte_naming_the_kind():
    manifest = UpdateManifest.decode(plan_manifest(state(), 3, 1 << 20, checksum_kind="sum31").encode())
    assert manifest.checksum_kind == "sum31"
    assert [t.checksum for t in manifest.tensors] == [tensor_checksum(t, "sum31") for t in state().values()]
    buckets = buckets_of(manifest, state())
    assert all(torch.equal(t, state()[n]) for n, t in unpack_buckets(manifest, buckets).items())
    entry = manifest.tensors[1]
    buckets[entry.bucket][entry.offset + 5] ^= 0x40
    with pytest.raises(ManifestError, match=r"tensor b.bias: checksum 0x[0-9a-f]{8} but .*, a sum31 \(corrupted"):
        unpack_buckets(manifest, buckets)


def test_a_manifest_naming_an_unknown_checksum_kind_is_refused_at_decode_naming_the_field():
    manifest = msgspec.structs.replace(plan_manifest(state(), 3, 1 << 20), checksum_kind="xxhash")
    with pytest.raises(ManifestError, match=r"manifest.checksum_kind is 'xxhash', expected one of"):
        UpdateManifest.decode(manifest.encode())


@cuda
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 3, 4097, (1 << 22) + 5, 3 << 23])
def test_a_gpu_sums_every_size_and_dtype_bit_for_bit_as_the_host_does(n, dtype):
    t = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) if dtype.is_floating_point else None
    t = random_bytes(n, seed=n) if t is None else t
    assert tensor_checksum(t.cuda(), "sum31") == tensor_checksum(t, "sum31")


def test_sum31_over_several_full_rows_is_still_the_plain_definition():
    data = random_bytes(3 * (1 << 17) + 5, seed=2)  # three rows of 2^16 words and a partial fourth
    assert sum31(data) == reference_sum31(data.numpy().tobytes())
