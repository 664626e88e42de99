"""Unit tests of delta updates (inflight/wire/delta.py, and plan_update/unpack_buckets in inflight/wire/weights.py):
a delta reproduces the sender's tensors bit for bit or is refused. No processes, no group."""

from __future__ import annotations

import msgspec
import pytest
import torch

from inflight.wire import delta
from inflight.wire.secure import weights_key
from inflight.wire.weights import ManifestError, UpdateManifest, pack_bucket, plan_update, unpack_buckets

BUCKET_BYTES = 4096


def changed(state: dict[str, torch.Tensor], fractions: dict[str, float], seed: int = 1) -> dict[str, torch.Tensor]:
    """`state` with that fraction of each named tensor's elements replaced by other values."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        new = t.clone().reshape(-1)
        k = int(new.numel() * fractions.get(name, 0.0))
        where = torch.randperm(new.numel(), generator=gen)[:k]
        new[where] = (new[where].float() + 1.0 + torch.rand(k, generator=gen)).to(t.dtype)
        out[name] = new.reshape(t.shape)
    return out


def base_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 40, generator=gen).to(torch.bfloat16),  # 4000 B: a bucket of its own
        "norm.weight": torch.randn(30, generator=gen),
        "proj.weight": torch.randn(20, 33, generator=gen).to(torch.float16),
        "head.weight": torch.randn(9, 13, generator=gen).to(torch.bfloat16).index_fill(0, torch.tensor([0]), 0.0),
        "bias": torch.randn(11, generator=gen),
    }


def send(manifest: UpdateManifest, payloads: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    out = torch.empty(max(manifest.bucket_sizes), dtype=torch.uint8)
    return [pack_bucket(manifest, i, payloads, out).clone() for i in range(len(manifest.bucket_sizes))]


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_delta_update_reproduces_every_tensor_bit_for_bit_in_the_smallest_encoding_and_fewer_bytes():
    base = base_state()
    new = changed(base, {"embed.weight": 0.01, "norm.weight": 1.0, "proj.weight": 0.2})
    new["head.weight"][0, 3] = -0.0  # was 0.0: equal as numbers, a change in bits
    assert new["head.weight"][0, 3] == base["head.weight"][0, 3]
    manifest, payloads = plan_update(new, 5, BUCKET_BYTES, base=(4, base), keep_base=True)
    encodings = {t.name: t.encoding for t in manifest.tensors}
    assert encodings == {"embed.weight": "indices", "norm.weight": "full", "proj.weight": "bitmask",
                         "head.weight": "indices", "bias": "indices"}  # fmt: skip
    assert manifest.base_version == 4 and manifest.keep_base and manifest.is_delta
    counts = {t.name: (t.count, t.nbytes) for t in manifest.tensors}
    assert counts["head.weight"] == (1, 6) and counts["bias"] == (0, 0)  # unchanged: nothing sent
    full, _ = plan_update(new, 5, BUCKET_BYTES)
    print(f"\ndelta {manifest.total_bytes} B vs full {full.total_bytes} B")
    assert manifest.total_bytes < 0.5 * full.total_bytes
    received = unpack_buckets(UpdateManifest.decode(manifest.encode()), send(manifest, payloads), base=(4, base))
    assert {n: bits(t) for n, t in received.items()} == {n: bits(t) for n, t in new.items()}
    assert all(bits(base[n]) == bits(base_state()[n]) for n in base), "applying a delta must not modify its base"


def test_a_delta_on_another_version_than_the_receiver_holds_is_refused_naming_both():
    base = base_state()
    manifest, payloads = plan_update(changed(base, {"proj.weight": 0.1}), 5, BUCKET_BYTES, base=(4, base))
    with pytest.raises(ManifestError, match=r"delta on v4 but this receiver holds v3: the sender must send a full"):
        unpack_buckets(manifest, send(manifest, payloads), base=(3, base))
    with pytest.raises(ManifestError, match=r"delta on v4 but this receiver holds no base"):
        unpack_buckets(manifest, send(manifest, payloads))


def test_a_delta_applied_to_a_base_whose_contents_differ_fails_the_whole_tensors_checksum():
    base = base_state()
    manifest, payloads = plan_update(changed(base, {"proj.weight": 0.1}), 5, BUCKET_BYTES, base=(4, base))
    drifted = dict(base, **{"proj.weight": base["proj.weight"] * 2})  # the right version number, other contents
    with pytest.raises(ManifestError, match=r"tensor proj.weight: checksum .* \(corrupted in transit\)"):
        unpack_buckets(manifest, send(manifest, payloads), base=(4, drifted))


def test_an_altered_delta_payload_is_refused_by_its_checksum_or_its_own_consistency():
    base = base_state()
    manifest, payloads = plan_update(changed(base, {"embed.weight": 0.01}), 5, BUCKET_BYTES, base=(4, base))
    entry = next(t for t in manifest.tensors if t.name == "embed.weight")
    buckets = send(manifest, payloads)
    buckets[entry.bucket][entry.offset + 1] ^= 0x40  # an index pushed far outside the tensor
    with pytest.raises(ManifestError, match=r"tensor embed.weight: an index of the delta lies outside"):
        unpack_buckets(manifest, buckets, base=(4, base))
    buckets = send(manifest, payloads)
    buckets[entry.bucket][entry.offset + entry.nbytes - 1] ^= 0x01  # a value's last bit
    with pytest.raises(ManifestError, match=r"tensor embed.weight: checksum"):
        unpack_buckets(manifest, buckets, base=(4, base))


def test_with_a_secret_a_delta_carries_the_whole_tensors_tag_and_a_replayed_delta_is_refused():
    base, key = base_state(), weights_key(b"a shared secret of 32 bytes....!")
    new = changed(base, {"proj.weight": 0.2})
    manifest, payloads = plan_update(new, 5, BUCKET_BYTES, weights_key=key, base=(4, base))
    received = unpack_buckets(manifest, send(manifest, payloads), weights_key=key, base=(4, base))
    assert bits(received["proj.weight"]) == bits(new["proj.weight"])
    replay = msgspec.structs.replace(manifest, version=6, base_version=5)  # the same delta presented as v5 -> v6
    with pytest.raises(ManifestError, match="does not verify under the update's key"):
        unpack_buckets(replay, send(manifest, payloads), weights_key=key, base=(5, new))


def test_a_sparse_encoding_in_a_full_update_or_a_count_beyond_the_tensor_is_refused_at_decode():
    base = base_state()
    manifest, _ = plan_update(changed(base, {"proj.weight": 0.2}), 5, BUCKET_BYTES, base=(4, base))
    as_full = msgspec.structs.replace(manifest, base_version=-1)
    with pytest.raises(ManifestError, match=r"tensor embed.weight: encoding 'indices' in a full update"):
        UpdateManifest.decode(as_full.encode())
    tensors = [msgspec.structs.replace(t, count=10**6) if t.name == "proj.weight" else t for t in manifest.tensors]
    with pytest.raises(ManifestError, match=r"tensor proj.weight: 1000000 changed elements of 660"):
        UpdateManifest.decode(msgspec.structs.replace(manifest, tensors=tensors).encode())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.bool])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 1.0])
def test_encode_then_decode_is_the_identity_on_the_bits_for_every_dtype(dtype, fraction):
    gen = torch.Generator().manual_seed(3)
    old = (torch.randn(777, generator=gen) * 5).to(dtype)
    new = old.clone()
    where = torch.randperm(777, generator=gen)[: int(777 * fraction)]
    new[where] = ~new[where] if dtype == torch.bool else (new[where].double() + 1).to(dtype)
    encoding, count, payload = delta.encode(new, old)
    assert count == len(where) and payload.numel() == delta.payload_nbytes(encoding, 777, old.element_size(), count)
    assert bits(delta.decode(encoding, count, payload, old)) == bits(new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.bool])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("chunk", [delta.CHUNK, 16])
def test_a_slice_decoded_from_the_payload_onto_the_bases_slice_equals_the_whole_decode_narrowed(
    dtype, fraction, chunk, monkeypatch
):
    """What a tensor-parallel rank holds: its rows of one dim. `chunk` 16: the decode walks the tensor in 16-element
    chunks (a bitmask's bits and the indices are unpacked a chunk at a time), as it walks a large one."""
    monkeypatch.setattr(delta, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(4)
    shape = (6, 10, 7)
    old = (torch.randn(shape, generator=gen) * 5).to(dtype)
    new = old.clone().reshape(-1)
    where = torch.randperm(new.numel(), generator=gen)[: int(new.numel() * fraction)]
    new[where] = ~new[where] if dtype == torch.bool else (new[where].double() + 1).to(dtype)
    new = new.reshape(shape)
    encoding, count, payload = delta.encode(new, old)
    assert bits(delta.decode(encoding, count, payload, old)) == bits(new)
    for dim, start, length in [(0, 0, 3), (0, 3, 3), (1, 5, 5), (2, 1, 4), (2, 0, 7)]:
        base = old.narrow(dim, start, length).contiguous()
        got = delta.decode_slice(encoding, count, payload, shape, (dim, start, length), base)
        assert bits(got) == bits(new.narrow(dim, start, length)), (encoding, dim, start, length)
    with pytest.raises(ValueError, match=r"the base slice is \[6, 10, 7\]; rows 0..3 of dim 0: \(3, 10, 7\)"):
        delta.decode_slice(encoding, count, payload, shape, (0, 0, 3), old)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("sliced", [False, True])
def test_a_decode_allocates_a_chunks_workspace_beyond_its_output_however_large_the_tensor(sliced, monkeypatch):
    """8M bf16 elements, 85% changed (a bitmask near its upper range): decoded whole, the changed elements' indices
    alone would take 54 MiB; a chunk at a time the decode stays within `DECODE_WORKSPACE_BYTES` of 256K-element
    chunks (24 MiB). Checked to fail with the whole tensor as one chunk."""
    monkeypatch.setattr(delta, "CHUNK", 1 << 18)
    bound = delta.WORKSPACE_PER_ELEMENT * delta.CHUNK
    gen = torch.Generator().manual_seed(5)
    shape = (1024, 8192)
    old = torch.randn(shape, generator=gen).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[torch.rand(new.numel(), generator=gen) < 0.85] += 1
    encoding, count, payload = delta.encode(new, old)
    assert encoding == "bitmask"
    region = (1, 4096, 4096) if sliced else (0, 0, 1024)
    base = old.narrow(region[0], region[1], region[2]).contiguous()
    out = torch.zeros_like(base)  # every page resident before: the output is not the workspace
    del new
    before = _resident_bytes()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) from here
    if sliced:
        delta.decode_slice(encoding, count, payload, shape, region, base, out)
    else:
        delta.decode(encoding, count, payload, base, out)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    assert peak - before < bound, f"{(peak - before) / 2**20:.1f} MiB beyond the output, bound {bound / 2**20:.0f}"


@pytest.mark.parametrize("fraction", [0.02, 0.85])
def test_an_encode_allocates_a_chunks_workspace_beyond_its_payload_however_large_the_tensor(fraction, monkeypatch):
    """8M bf16 elements, 2% changed (indices) or 85% (a bitmask near its upper range): a chunk at a time the encode
    stays within `ENCODE_WORKSPACE_BYTES` of 256K-element chunks (24 MiB) beyond its payload. Checked to fail with the
    whole tensor as one chunk: its masks, shifted bits, indices and values grew 62 MiB at 2%, 73 at 85%."""
    monkeypatch.setattr(delta, "CHUNK", 1 << 18)
    bound = delta.WORKSPACE_PER_ELEMENT * delta.CHUNK
    gen = torch.Generator().manual_seed(6)
    old = torch.randn(1024, 8192, generator=gen).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[torch.rand(new.numel(), generator=gen) < fraction] += 1
    before = _resident_bytes()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) from here
    encoding, count, payload = delta.encode(new, old)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    assert encoding == ("indices" if fraction < 0.03 else "bitmask")
    grown = peak - before - payload.numel()
    assert grown < bound, f"{grown / 2**20:.1f} MiB beyond the payload, bound {bound / 2**20:.0f}"
    assert torch.equal(delta.decode(encoding, count, payload, old), new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.bool])
@pytest.mark.parametrize("fraction", [0.0, 0.02, 0.3, 1.0])
def test_an_encode_a_chunk_at_a_time_gives_the_bytes_of_the_whole_tensor_at_once(fraction, dtype, monkeypatch):
    """4096-element chunks over 37,037 elements (a last partial chunk): the encoding, count and payload bytes of one
    chunk for the whole tensor."""
    gen = torch.Generator().manual_seed(8)
    old = (torch.randn(37, 1001, generator=gen) > 0) if dtype == torch.bool else torch.randn(37, 1001, generator=gen)
    old = old.to(dtype)
    new = old.clone()
    flip = torch.rand(new.numel(), generator=gen) < fraction
    new.view(-1)[flip] = ~new.view(-1)[flip] if dtype == torch.bool else new.view(-1)[flip] + 1
    monkeypatch.setattr(delta, "CHUNK", 1 << 30)
    whole = delta.encode(new, old)
    monkeypatch.setattr(delta, "CHUNK", 1 << 12)
    chunked = delta.encode(new, old)
    assert chunked[:2] == whole[:2] and torch.equal(chunked[2], whole[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("fraction", [0.0, 0.02, 0.3, 1.0])
def test_an_encode_on_a_gpu_gives_the_bytes_of_the_encode_on_the_host(fraction, monkeypatch):
    """The learner encodes on its weights device (a GPU for NCCL), chunk by chunk with one count sync: the same
    encoding, count and payload bytes as on the host, across chunk boundaries and a last partial chunk."""
    monkeypatch.setattr(delta, "CHUNK", 1 << 12)
    gen = torch.Generator().manual_seed(7)
    old = torch.randn(37, 1001, generator=gen).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[torch.rand(new.numel(), generator=gen) < fraction] += 1
    on_host = delta.encode(new, old)
    on_gpu = delta.encode(new.cuda(), old.cuda())
    assert on_gpu[:2] == on_host[:2] and torch.equal(on_gpu[2].cpu(), on_host[2])


class Recorded:
    """A weights group reduced to what crosses it: each broadcast's bytes, in order, for `Replay` to play back (a
    narrow stand-in; the real group carries deltas in tests/vllm_patches/test_delta_updates.py and
    test_sliced_staging.py)."""

    def __init__(self):
        self.frames: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, what: str = "") -> None:
        self.frames.append(tensor.clone())


@pytest.mark.parametrize("nothing_changed", [False, True])
def test_a_delta_whose_unchanged_tensors_take_no_bytes_leaves_no_bucket_empty_and_crosses_whole(nothing_changed):
    """An unchanged tensor after one larger than a bucket once opened a bucket of 0 bytes, which has no broadcast:
    the learner's send failed on it (KeyError), and a rank keeping slices would have skipped its tensors. A delta in
    which nothing changed (a step whose loss was 0) has no bytes at all and still reaches every receiver."""
    from test_receive_kept import Replay

    from inflight.wire.transfer import receive_kept, receive_update, send_update

    gen = torch.Generator().manual_seed(6)
    base = {name: torch.randn(n, 16, generator=gen).to(torch.bfloat16) for name, n in
            [("norm.weight", 1), ("embed.weight", 300), ("mid.weight", 2), ("head.weight", 300)]}  # fmt: skip
    new = {name: t.clone() for name, t in base.items()}
    if not nothing_changed:
        new["embed.weight"] += 1.0  # 9600 B in full, the next in a bitmask of 5400 B: each beyond a 4096-B bucket
        new["head.weight"][::2] += 1.0
    manifest, payloads = plan_update(new, 3, BUCKET_BYTES, base=(2, base))
    if nothing_changed:
        assert manifest.bucket_sizes == [0]
    else:
        assert {t.name: t.nbytes for t in manifest.tensors} == {
            "norm.weight": 0, "embed.weight": 9600, "mid.weight": 0, "head.weight": 5400
        }  # fmt: skip
        assert manifest.bucket_sizes == [9600, 5400]
    UpdateManifest.decode(manifest.encode())  # valid: every entry inside its bucket, aligned
    sent = Recorded()
    send_update(sent, manifest, payloads)
    whole = unpack_buckets(manifest, receive_update(Replay(sent.frames), manifest), base=(2, base))
    half = {name: t[len(t) // 2 :].clone() for name, t in base.items()}
    rows = receive_kept(Replay(sent.frames), manifest, lambda name, w: w[len(w) // 2 :], base=(2, half))
    for name, t in new.items():
        assert bits(whole[name]) == bits(t) and bits(rows[name]) == bits(t[len(t) // 2 :]), name
