"""Unit tests of the update manifest and bucket packing (inflight/wire/weights.py): no processes, no group."""

from __future__ import annotations

import os
import pickle
import zlib
from pathlib import Path

import msgspec
import pytest
import torch
from crc_forgery import forge_crc32

from inflight.wire.checksum import tensor_checksum
from inflight.wire.secure import weights_key
from inflight.wire.weights import (
    ALIGN,
    MANIFEST_SCHEMA,
    TAG_BYTES,
    ManifestError,
    TensorEntry,
    UpdateManifest,
    check_against,
    pack_bucket,
    plan_manifest,
    unpack_buckets,
)

BUCKET_BYTES = 4096


def mixed_state() -> dict[str, torch.Tensor]:
    """Odd byte counts (so alignment padding is needed), three float dtypes, and one tensor bigger than a bucket."""
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=gen).to(torch.bfloat16),
        "norm.weight": torch.randn(3, generator=gen),
        "big.weight": torch.randn(40, 33, generator=gen).to(torch.float16),
        "huge.weight": torch.randn(2000, generator=gen),  # 8000 B fp32 > BUCKET_BYTES
        "bias": torch.randn(11, generator=gen).to(torch.float16),
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "head.weight": torch.randn(9, 13, generator=gen),
    }


def send_buckets(manifest: UpdateManifest, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """What the receiver ends up with: every bucket packed, then copied into its own buffer as a broadcast would."""
    out = torch.empty(max(manifest.bucket_sizes), dtype=torch.uint8)
    return [pack_bucket(manifest, i, state, out).clone() for i in range(len(manifest.bucket_sizes))]


def expected_layout(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int]]]:
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    return {name: (names[t.dtype], list(t.shape)) for name, t in state.items()}


def entry(manifest: UpdateManifest, name: str) -> TensorEntry:
    return next(t for t in manifest.tensors if t.name == name)


def replace_entry(manifest: UpdateManifest, name: str, **changes) -> UpdateManifest:
    tensors = [msgspec.structs.replace(t, **changes) if t.name == name else t for t in manifest.tensors]
    return msgspec.structs.replace(manifest, tensors=tensors)


# --- plan / pack / unpack -----------------------------------------------------------------------------------------


def test_round_trip_of_mixed_dtypes_and_shapes_is_bit_exact():
    state = mixed_state()
    manifest = plan_manifest(state, version=3, bucket_bytes=BUCKET_BYTES)
    received = unpack_buckets(manifest, send_buckets(manifest, state))
    assert list(received) == list(state)
    for name, tensor in state.items():
        got = received[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    assert manifest.version == 3 and manifest.schema == MANIFEST_SCHEMA


def test_a_tensor_larger_than_the_bucket_size_gets_a_bucket_of_its_own():
    state = mixed_state()
    manifest = plan_manifest(state, version=0, bucket_bytes=BUCKET_BYTES)
    huge = entry(manifest, "huge.weight")
    assert huge.nbytes > BUCKET_BYTES
    assert [t.name for t in manifest.tensors if t.bucket == huge.bucket] == ["huge.weight"]
    assert huge.offset == 0 and manifest.bucket_sizes[huge.bucket] == huge.nbytes
    small = [size for i, size in enumerate(manifest.bucket_sizes) if i != huge.bucket]
    assert small and all(size <= BUCKET_BYTES for size in small)
    assert len(manifest.bucket_sizes) >= 3  # a bucket before the huge tensor and one after it


def test_every_offset_is_64_byte_aligned_and_tensors_in_a_bucket_do_not_overlap():
    manifest = plan_manifest(mixed_state(), version=0, bucket_bytes=BUCKET_BYTES)
    assert any(t.nbytes % ALIGN for t in manifest.tensors)  # otherwise alignment is not exercised
    for bucket in range(len(manifest.bucket_sizes)):
        spans = sorted((t.offset, t.offset + t.nbytes) for t in manifest.tensors if t.bucket == bucket)
        assert all(start % ALIGN == 0 for start, _ in spans)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False))
        assert spans[-1][1] == manifest.bucket_sizes[bucket]


def test_unpacked_tensors_are_views_of_the_received_buckets_not_copies():
    state = mixed_state()
    manifest = plan_manifest(state, version=0, bucket_bytes=BUCKET_BYTES)
    buckets = send_buckets(manifest, state)
    received = unpack_buckets(manifest, buckets)
    head = entry(manifest, "head.weight")
    buckets[head.bucket][head.offset : head.offset + 4].zero_()
    assert received["head.weight"].flatten()[0].item() == 0.0


def test_plan_refuses_a_dtype_the_wire_cannot_carry():
    with pytest.raises(ManifestError, match=r"tensor q: dtype torch\.complex64 cannot be sent"):
        plan_manifest({"q": torch.zeros(2, dtype=torch.complex64)}, version=0, bucket_bytes=BUCKET_BYTES)


def test_unpack_detects_a_flipped_byte_and_names_the_tensor():
    state = mixed_state()
    manifest = plan_manifest(state, version=0, bucket_bytes=BUCKET_BYTES)
    buckets = send_buckets(manifest, state)
    bias = entry(manifest, "bias")
    buckets[bias.bucket][bias.offset + 3] ^= 0x10
    with pytest.raises(ManifestError, match=r"tensor bias: checksum 0x[0-9a-f]{8} but the manifest says"):
        unpack_buckets(manifest, buckets)
    assert unpack_buckets(manifest, buckets, verify=False)["bias"].shape == (11,)  # verify=False really skips it


def test_unpack_rejects_a_bucket_of_the_wrong_size():
    state = mixed_state()
    manifest = plan_manifest(state, version=0, bucket_bytes=BUCKET_BYTES)
    buckets = send_buckets(manifest, state)
    buckets[1] = buckets[1][:-1]
    with pytest.raises(ManifestError, match=rf"bucket 1 holds {manifest.bucket_sizes[1] - 1} bytes, the manifest"):
        unpack_buckets(manifest, buckets)


def test_unpack_rejects_a_missing_bucket():
    state = mixed_state()
    manifest = plan_manifest(state, version=0, bucket_bytes=BUCKET_BYTES)
    buckets = send_buckets(manifest, state)[:-1]
    with pytest.raises(ManifestError, match=rf"received {len(buckets)} buckets, the manifest announced"):
        unpack_buckets(manifest, buckets)


# --- manifest encode / decode / validate ---------------------------------------------------------------------------


def test_manifest_survives_encode_and_decode_unchanged():
    manifest = plan_manifest(mixed_state(), version=42, bucket_bytes=BUCKET_BYTES)
    data = manifest.encode()
    assert isinstance(data, bytes)
    decoded = UpdateManifest.decode(data)
    assert decoded == manifest
    assert decoded.total_bytes == sum(manifest.bucket_sizes)
    assert entry(decoded, "norm.weight").checksum == tensor_checksum(mixed_state()["norm.weight"], "crc32")


def test_decode_rejects_an_unknown_schema_number_naming_the_field():
    manifest = msgspec.structs.replace(plan_manifest(mixed_state(), 0, BUCKET_BYTES), schema=MANIFEST_SCHEMA + 1)
    with pytest.raises(ManifestError, match=rf"manifest\.schema is {MANIFEST_SCHEMA + 1}, expected {MANIFEST_SCHEMA}"):
        UpdateManifest.decode(manifest.encode())


def test_decode_rejects_garbage_bytes():
    with pytest.raises(ManifestError, match="update manifest could not be decoded: MessagePack data is malformed"):
        UpdateManifest.decode(b"\xc1 this is not msgpack")


def test_decode_rejects_a_field_of_the_wrong_type_naming_it():
    raw = {"schema": MANIFEST_SCHEMA, "version": "seven", "bucket_sizes": [], "tensors": []}
    with pytest.raises(ManifestError, match=r"Expected `int`, got `str` - at `\$\.version`"):
        UpdateManifest.decode(msgspec.msgpack.encode(raw))


def test_decode_rejects_an_unknown_field_naming_it():
    raw = {"schema": MANIFEST_SCHEMA, "version": 0, "bucket_sizes": [], "tensors": [], "shell": "rm -rf /"}
    with pytest.raises(ManifestError, match="unknown field `shell`"):
        UpdateManifest.decode(msgspec.msgpack.encode(raw))


class _Tripwire:
    """Creating a file when unpickled proves whether a decoder ran pickle on the payload."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_decode_rejects_a_pickle_payload_without_unpickling_it(tmp_path):
    marker = tmp_path / "unpickled"
    payload = pickle.dumps({"schema": MANIFEST_SCHEMA, "version": 0, "bucket_sizes": [], "tensors": [],
                            "x": _Tripwire(marker)})  # fmt: skip
    pickle.loads(payload)  # the tripwire works: a real unpickle leaves the marker
    assert marker.is_dir()
    marker.rmdir()
    with pytest.raises(ManifestError, match="update manifest could not be decoded"):
        UpdateManifest.decode(payload)
    assert not marker.exists()


def test_validate_layout_rejects_an_entry_that_runs_past_its_bucket():
    manifest = plan_manifest(mixed_state(), 0, BUCKET_BYTES)
    head = entry(manifest, "head.weight")
    end_of_bucket = -(-manifest.bucket_sizes[head.bucket] // ALIGN) * ALIGN  # aligned, so only the size check fails
    bad = replace_entry(manifest, "head.weight", offset=end_of_bucket)
    with pytest.raises(ManifestError, match=r"tensor head\.weight: offset \d+\+468 outside its bucket"):
        bad.validate_layout()
    with pytest.raises(ManifestError, match=r"tensor head\.weight: offset"):
        UpdateManifest.decode(bad.encode())


def test_validate_layout_rejects_a_misaligned_offset():
    bad = replace_entry(plan_manifest(mixed_state(), 0, BUCKET_BYTES), "norm.weight", offset=ALIGN + 4)
    with pytest.raises(ManifestError, match=r"tensor norm\.weight: offset 68\+12"):
        bad.validate_layout()


def test_validate_layout_rejects_a_bucket_index_that_does_not_exist():
    manifest = plan_manifest(mixed_state(), 0, BUCKET_BYTES)
    bad = replace_entry(manifest, "bias", bucket=len(manifest.bucket_sizes))
    with pytest.raises(ManifestError, match=rf"tensor bias: bucket {len(manifest.bucket_sizes)} outside 0\.\."):
        bad.validate_layout()


def test_validate_layout_rejects_nbytes_that_disagree_with_dtype_and_shape():
    bad = replace_entry(plan_manifest(mixed_state(), 0, BUCKET_BYTES), "bias", nbytes=24)
    with pytest.raises(ManifestError, match=r"tensor bias: nbytes 24 but full of dtype×shape gives 22"):
        bad.validate_layout()


def test_validate_layout_rejects_an_unknown_dtype_name():
    bad = replace_entry(plan_manifest(mixed_state(), 0, BUCKET_BYTES), "bias", dtype="float8")
    with pytest.raises(ManifestError, match=r"tensor bias: dtype 'float8' is not one of"):
        bad.validate_layout()


# --- check_against: the receiver's model must match what is sent ---------------------------------------------------


def test_check_against_accepts_a_manifest_that_matches_the_served_model():
    state = mixed_state()
    check_against(plan_manifest(state, 0, BUCKET_BYTES), expected_layout(state))


def test_check_against_names_a_tensor_the_served_model_does_not_have():
    state = mixed_state()
    expected = expected_layout(state)
    del expected["bias"]
    with pytest.raises(ManifestError, match=r"tensor 'bias' is not a parameter of the served model"):
        check_against(plan_manifest(state, 0, BUCKET_BYTES), expected)


def test_check_against_names_a_tensor_with_the_wrong_shape():
    state = mixed_state()
    expected = expected_layout(state)
    expected["head.weight"] = ("float32", [13, 9])
    with pytest.raises(ManifestError, match=r"head\.weight: shape \[9, 13\] sent, the served model has \[13, 9\]"):
        check_against(plan_manifest(state, 0, BUCKET_BYTES), expected)


def test_check_against_names_a_tensor_with_the_wrong_dtype():
    state = mixed_state()
    expected = expected_layout(state)
    expected["embed.weight"] = ("float32", [7, 5])
    with pytest.raises(ManifestError, match=r"tensor embed\.weight: dtype bfloat16 sent, the served model has float32"):
        check_against(plan_manifest(state, 0, BUCKET_BYTES), expected)


def test_check_against_names_the_first_missing_tensor_and_how_many():
    state = mixed_state()
    expected = expected_layout(state)
    sent = {k: v for k, v in state.items() if k not in ("norm.weight", "bias")}
    with pytest.raises(ManifestError, match=r"2 parameters missing from the update, first 'bias'"):
        check_against(plan_manifest(sent, 0, BUCKET_BYTES), expected)


def test_check_against_rejects_a_tensor_sent_twice():
    state = mixed_state()
    manifest = plan_manifest(state, 0, BUCKET_BYTES)
    twice = msgspec.structs.replace(manifest, tensors=[*manifest.tensors, entry(manifest, "norm.weight")])
    with pytest.raises(ManifestError, match=r"tensor norm\.weight appears twice in the manifest"):
        check_against(twice, expected_layout(state))


def test_check_against_reports_the_first_mismatch_in_manifest_order():
    state = mixed_state()
    expected = expected_layout(state)
    expected["embed.weight"] = ("bfloat16", [5, 7])  # first tensor in the manifest: wrong shape
    expected["head.weight"] = ("bfloat16", [9, 13])  # last tensor: wrong dtype
    del expected["bias"]  # in between: unknown to the served model
    with pytest.raises(ManifestError, match=r"^tensor embed\.weight: shape"):
        check_against(plan_manifest(state, 0, BUCKET_BYTES), expected)
    expected["embed.weight"] = ("bfloat16", [7, 5])
    with pytest.raises(ManifestError, match=r"^tensor 'bias' is not a parameter"):
        check_against(plan_manifest(state, 0, BUCKET_BYTES), expected)


def forged(manifest: UpdateManifest, state: dict[str, torch.Tensor], name: str) -> list[torch.Tensor]:
    """The buckets of `state` with tensor `name` altered and its CRC32 fixed to what the manifest says."""
    t = entry(manifest, name)
    buckets = send_buckets(manifest, state)
    raw = buckets[t.bucket][t.offset : t.offset + t.nbytes]
    raw[:8] ^= 0x5A  # the attacker's change
    crc = t.checksum if t.checksum else zlib.crc32(_bytes_of(state[name]))
    raw[-4:] = torch.frombuffer(bytearray(forge_crc32(raw[:-4].numpy().tobytes(), crc)), dtype=torch.uint8)
    assert zlib.crc32(raw.numpy()) == crc and not torch.equal(raw, torch.frombuffer(bytearray(_bytes_of(state[name])),
                                                                                      dtype=torch.uint8))  # fmt: skip
    return buckets


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_an_altered_tensor_with_its_crc32_recomputed_passes_crc32_and_is_refused_by_the_keyed_tag():
    state, key = mixed_state(), weights_key(b"a shared secret of 32 bytes....!")
    name = "big.weight"
    plain = plan_manifest(state, 3, BUCKET_BYTES)
    unpack_buckets(plain, forged(plain, state, name))  # CRC32 alone: the forgery goes through
    tagged = plan_manifest(state, 3, BUCKET_BYTES, weights_key=key)
    assert all(len(t.tag) == TAG_BYTES for t in tagged.tensors)
    received = unpack_buckets(tagged, send_buckets(tagged, state), weights_key=key)  # the genuine update verifies
    assert all(torch.equal(received[n], state[n]) for n in state)
    with pytest.raises(ManifestError, match=f"tensor {name}: its tag does not verify"):
        unpack_buckets(tagged, forged(tagged, state, name), weights_key=key)


def test_a_replayed_update_or_one_without_tags_or_under_another_secret_is_refused():
    state, key = mixed_state(), weights_key(b"a shared secret of 32 bytes....!")
    old = plan_manifest(state, 3, BUCKET_BYTES, weights_key=key)
    replay = msgspec.structs.replace(old, version=4)  # v3's tensors and tags presented as v4
    with pytest.raises(ManifestError, match="does not verify under the update's key"):
        unpack_buckets(replay, send_buckets(old, state), weights_key=key)
    with pytest.raises(ManifestError, match="does not verify"):
        unpack_buckets(old, send_buckets(old, state), weights_key=weights_key(b"another secret, also 32 bytes..."))
    untagged = plan_manifest(state, 3, BUCKET_BYTES)
    with pytest.raises(ManifestError, match="no tag, and this serve has a secret: give the learner the same"):
        unpack_buckets(untagged, send_buckets(untagged, state), weights_key=key)
