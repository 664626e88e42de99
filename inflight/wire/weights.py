"""Weight-update manifests and bucket packing: the bytes a learner sends and a serve worker stages.

Both sides import this (it imports torch and msgspec, never vLLM). An update is one `UpdateManifest` (sent first, as
msgpack) followed by its uint8 buckets over the weights group. Every tensor lies wholly in one bucket at a 64-byte
aligned offset, so the receiver can view it in place; a tensor larger than the bucket size gets a bucket of its own,
broadcast in parts of at most the bucket size (`UpdateManifest.parts`): a sender never holds more of it than two parts,
whatever the tensor's size. Each tensor carries a checksum of its bytes, checked by the receiver before anything is
committed: a CRC32 from a learner in host memory, a `sum31` (inflight/wire/checksum.py) from a learner on a GPU, which
both sides compute on the device, so neither copies a byte to the host to check it.

A checksum catches corruption, not forgery: anyone who can write to the weights network can alter a tensor and fix
four of its bytes so the checksum still matches. With a shared secret (`--secret-file` on both sides) every tensor
carries a keyed BLAKE2b tag instead, under a key derived from the secret and the update's version (`update_key`):
without the secret a tag cannot be made, and a tensor of an older update (a replay) carries a tag under another
version's key. Tags are computed in host memory: a GPU serve with a secret copies every bucket out to check it.

A delta update (`base_version` >= 0) sends each tensor in the smallest of three encodings (inflight/wire/delta.py):
whole, or only the elements that changed since `base_version`, which the receiver applies to its copy of that version.
The checksum or tag is always the *whole* new tensor's, checked after the delta is applied: a delta applied to the
wrong base, or altered in transit, fails the same check a corrupt full update does, so a delta update is bitwise
identical to a full one or refused. A sparse entry also carries its payload's own checksum or tag: a tensor-parallel
rank keeps only its slice of the base, so it checks the payload it applies instead (its slice of the base verified
when that version arrived, the delta's base version checked, the decode deterministic).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

import msgspec
import torch

from inflight.wire import delta
from inflight.wire.checksum import CHECKSUM_KINDS, RunningChecksum, bytes_checksum, tensor_checksum

MANIFEST_SCHEMA = 6  # 2: keyed BLAKE2b tags; 3: delta updates; 4: checksum_kind; 5: part_bytes; 6: payload digests
TAG_BYTES = 16
_TRAILER_ENTRY = 4 + TAG_BYTES
ALIGN = 64
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# How a serve's commit puts an update into its live model (vllm_patches/worker_extension.py), the serve's
# --update-memory: "double" swaps in a copy prepared off the engine thread (O(layers) on it; one extra processed copy
# of the weights while staged); "low" reloads into the live storage on the engine thread (O(bytes), no copy; storage
# addresses kept, as CUDA graphs need). Defined here, below both the serve's flags and the engine.
UPDATE_MEMORY = ("double", "low")


class ManifestError(ValueError):
    """A manifest or a staged update does not match what it claims or what the receiver expects."""


class TensorEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one HF-named tensor lies in the buckets, how it is encoded, and what its whole bytes must hash to."""

    name: str
    dtype: str
    shape: list[int]
    bucket: int
    offset: int
    nbytes: int  # bytes in the bucket: the tensor's own for "full", the delta payload's otherwise
    checksum: int = 0  # the manifest's checksum_kind of the whole tensor (a delta: after it is applied)
    tag: bytes = b""  # keyed BLAKE2b of the whole tensor under update_key(secret key, version); empty without a secret
    encoding: str = "full"  # one of inflight/wire/delta.py:ENCODINGS; not "full" only in a delta update
    count: int = 0  # elements changed since the manifest's base_version (a delta entry)
    # A sparse entry's payload, digested as `checksum` and `tag` are: what a tensor-parallel rank that keeps only a
    # slice checks, since it cannot apply the delta to the whole tensor (inflight/wire/transfer.py:receive_kept).
    payload_checksum: int = 0
    payload_tag: bytes = b""


class AdapterSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A LoRA adapter's shape, as PEFT's `adapter_config.json` says it: what an adapter update must match on the serve
    (its `--lora-rank`, and the adapter it loaded at start) before any bucket moves."""

    rank: int
    alpha: float
    targets: list[str]  # module names (q_proj, ...), sorted

    def differences(self, other: AdapterSpec) -> list[str]:
        """What differs from `other`, one 'field: this vs other' each."""
        return [
            f"{field}: {getattr(self, field)!r} vs {getattr(other, field)!r}"
            for field in ("rank", "alpha", "targets")
            if getattr(self, field) != getattr(other, field)
        ]


class UpdateManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Announces one weight update: the version it produces and the layout of every bucket that follows.

    `base_version` -1: a full update. Otherwise a delta on `base_version`, which only a receiver holding exactly that
    version's tensors can apply. `keep_base`: the sender may send a delta on this version next, so the receiver keeps
    its tensors once committed (one copy of the weights in the sent dtype); without it the receiver may free them."""

    schema: int
    version: int
    bucket_sizes: list[int]
    tensors: list[TensorEntry]
    base_version: int = -1
    keep_base: bool = False
    # True: the checksums and tags are not in the entries but in one more broadcast after the last bucket (the
    # trailer, `trailer_nbytes` long): a sender streaming tensors as it gathers them knows them only once sent.
    trailer: bool = False
    checksum_kind: str = "crc32"  # one of inflight/wire/checksum.py:CHECKSUM_KINDS, what every entry's checksum is
    # A LoRA adapter update: the tensors are the adapter's, in PEFT's names (`...q_proj.lora_A.weight`), not the
    # model's; the serve puts them into vLLM's adapter slot (vllm_patches/adapter.py). None: the model's weights.
    adapter: AdapterSpec | None = None
    # The most bytes one broadcast carries: a bucket larger than this (one tensor larger than the bucket size) goes in
    # parts of this size, in order (`parts`). 0: every bucket in one broadcast.
    part_bytes: int = 0

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> UpdateManifest:
        try:
            manifest = msgspec.msgpack.decode(data, type=UpdateManifest)
        except msgspec.DecodeError as exc:
            raise ManifestError(f"update manifest could not be decoded: {exc}") from exc
        if manifest.schema != MANIFEST_SCHEMA:
            raise ManifestError(
                f"manifest.schema is {manifest.schema}, expected {MANIFEST_SCHEMA}: run the same inflight version "
                "on the learner and the servers"
            )
        manifest.validate_layout()
        return manifest

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    @property
    def trailer_nbytes(self) -> int:
        """Bytes of the trailer broadcast (0 without one): per entry, in order, its checksum (4, little-endian) and
        tag."""
        return len(self.tensors) * _TRAILER_ENTRY if self.trailer else 0

    def with_trailer(self, trailer: torch.Tensor) -> UpdateManifest:
        """This manifest with every entry's checksum and tag read from the received `trailer` (uint8)."""
        if trailer.numel() != self.trailer_nbytes:
            raise ManifestError(f"trailer of {trailer.numel()} bytes, the manifest announced {self.trailer_nbytes}")
        raw = trailer.cpu().numpy().tobytes()
        entries = []
        for i, t in enumerate(self.tensors):
            at = i * _TRAILER_ENTRY
            checksum, tag = int.from_bytes(raw[at : at + 4], "little"), raw[at + 4 : at + _TRAILER_ENTRY]
            entries.append(msgspec.structs.replace(t, checksum=checksum, tag=tag if any(tag) else b""))
        return msgspec.structs.replace(self, tensors=entries, trailer=False)

    @property
    def is_delta(self) -> bool:
        return self.base_version >= 0

    def parts(self) -> list[tuple[int, int, int]]:
        """Every broadcast of the buckets, in the order both sides make them: (bucket, first byte, end byte)."""
        step = self.part_bytes or max(self.bucket_sizes, default=1)
        return [(i, a, min(a + step, size)) for i, size in enumerate(self.bucket_sizes) for a in range(0, size, step)]

    def tensors_in(self, bucket: int) -> list[TensorEntry]:
        return [t for t in self.tensors if t.bucket == bucket]

    def part_name(self, part: tuple[int, int, int]) -> str:
        """How a broadcast is named in errors: 'bucket 2/9 of version 4', with 'bytes A-B of' for one part of many."""
        i, a, b = part
        whole = b - a == self.bucket_sizes[i]
        return f"{'' if whole else f'bytes {a}-{b} of '}bucket {i}/{len(self.bucket_sizes)} of version {self.version}"

    def validate_layout(self) -> None:
        """Every entry must lie inside its bucket with its byte count matching its encoding, dtype and shape."""
        if self.checksum_kind not in CHECKSUM_KINDS:
            raise ManifestError(
                f"manifest.checksum_kind is {self.checksum_kind!r}, expected one of {list(CHECKSUM_KINDS)}: run the "
                "same inflight version on the learner and the servers"
            )
        if self.part_bytes < 0 or self.part_bytes % ALIGN:
            raise ManifestError(f"manifest.part_bytes is {self.part_bytes}: expected 0 or a multiple of {ALIGN}")
        for t in self.tensors:
            if t.dtype not in DTYPES:
                raise ManifestError(f"tensor {t.name}: dtype {t.dtype!r} is not one of {sorted(DTYPES)}")
            if self.trailer and (t.encoding != "full" or self.is_delta):
                raise ManifestError(f"tensor {t.name}: a delta update cannot announce its checksums in a trailer")
            if t.encoding not in delta.ENCODINGS or (t.encoding != "full" and not self.is_delta):
                raise ManifestError(
                    f"tensor {t.name}: encoding {t.encoding!r} in a {'delta' if self.is_delta else 'full'} update"
                )
            if not 0 <= t.count <= _numel(t.shape):
                raise ManifestError(f"tensor {t.name}: {t.count} changed elements of {_numel(t.shape)}")
            want = delta.payload_nbytes(t.encoding, _numel(t.shape), _itemsize(t.dtype), t.count)
            if t.nbytes != want:
                raise ManifestError(f"tensor {t.name}: nbytes {t.nbytes} but {t.encoding} of dtype×shape gives {want}")
            if not 0 <= t.bucket < len(self.bucket_sizes):
                raise ManifestError(f"tensor {t.name}: bucket {t.bucket} outside 0..{len(self.bucket_sizes) - 1}")
            if t.offset % ALIGN or t.offset < 0 or t.offset + t.nbytes > self.bucket_sizes[t.bucket]:
                raise ManifestError(f"tensor {t.name}: offset {t.offset}+{t.nbytes} outside its bucket")


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def update_key(weights_key: bytes, version: int) -> bytes:
    """The key every tag of update `version` is made with, from the secret's weights key
    (inflight/wire/secure.py:weights_key): another version, another key, so no tag verifies in another update."""
    return hashlib.blake2b(
        version.to_bytes(8, "little", signed=True), key=weights_key, digest_size=32, person=b"inflight-update"
    ).digest()


def tensor_tag(t: torch.Tensor, key: bytes) -> bytes:
    """Keyed BLAKE2b of the tensor's bytes (a device tensor from a host copy)."""
    return bytes_tag(as_bytes(t).cpu().numpy(), key)


def bytes_tag(data, key: bytes) -> bytes:
    """Keyed BLAKE2b (16 bytes) of a bytes-like object."""
    return hashlib.blake2b(data, key=key, digest_size=TAG_BYTES).digest()


def plan_manifest(
    state: Mapping[str, torch.Tensor],
    version: int,
    bucket_bytes: int,
    checksums: bool = True,
    weights_key: bytes | None = None,
    checksum_kind: str = "crc32",
) -> UpdateManifest:
    """Lay `state` (HF name → tensor) out in buckets of at most `bucket_bytes` (a bigger tensor gets its own), as a full
    update, every tensor with its `checksum_kind` checksum. With `weights_key` every tensor also gets a keyed tag, which
    the receiver then checks instead of the checksum. `pack_bucket`/`send_update` take `state` itself."""
    return plan_update(
        state, version, bucket_bytes, checksums=checksums, weights_key=weights_key, checksum_kind=checksum_kind
    )[0]


def plan_update(
    state: Mapping[str, torch.Tensor],
    version: int,
    bucket_bytes: int,
    checksums: bool = True,
    weights_key: bytes | None = None,
    base: tuple[int, Mapping[str, torch.Tensor]] | None = None,
    keep_base: bool = False,
    checksum_kind: str = "crc32",
    adapter: AdapterSpec | None = None,
    device: torch.device | str | None = None,
) -> tuple[UpdateManifest, dict[str, torch.Tensor]]:
    """`plan_manifest`, and with `base` = (version, its tensors, same names, dtypes and shapes as `state`) a delta on
    that version: each tensor in its smallest encoding (inflight/wire/delta.py). Returns the manifest and the payloads
    (name → what goes into the buckets) that `pack_bucket`/`send_update` take in place of the state. Checksums and tags
    are always of the whole tensors of `state`, of `checksum_kind` (inflight/wire/checksum.py:checksum_kind_for the
    state's device: no host copy). With `adapter`, `state` is that LoRA adapter's tensors (an adapter update).
    `device`: where each tensor (and its base) is encoded and summed, one at a time, when `state` and `base` live
    elsewhere (a learner's host copy of a model too big for its GPU); its payload comes back beside it."""
    if bucket_bytes < ALIGN:
        raise ManifestError(f"bucket_bytes is {bucket_bytes}; it must be at least {ALIGN}")
    key = update_key(weights_key, version) if weights_key is not None else None
    entries, payloads, sizes, used = [], {}, [], 0
    for name, kept in state.items():
        if kept.dtype not in DTYPE_NAMES:
            raise ManifestError(f"tensor {name}: dtype {kept.dtype} cannot be sent; cast it to bfloat16/float32")
        tensor = kept.to(device) if device is not None else kept
        old = base[1][name].to(tensor.device) if base is not None else None
        encoding, count, payload = delta.encode(tensor, old) if old is not None else ("full", 0, kept)
        nbytes = delta.payload_nbytes(encoding, tensor.numel(), tensor.element_size(), count)
        offset, used = _place(sizes, used, nbytes, bucket_bytes)
        # kept with a tag: a corruption's message names its checksum
        checksum = tensor_checksum(tensor, checksum_kind) if checksums else 0
        tag = tensor_tag(tensor, key) if key is not None else b""
        sparse = encoding != "full"
        payload_checksum = bytes_checksum(payload, checksum_kind) if checksums and sparse else 0
        payload_tag = bytes_tag(payload.cpu().numpy(), key) if key is not None and sparse else b""
        payloads[name] = kept if encoding == "full" else payload.to(kept.device)  # no copy back of what is here
        entries.append(
            TensorEntry(
                name,
                DTYPE_NAMES[tensor.dtype],
                list(tensor.shape),
                len(sizes) - 1,
                offset,
                nbytes,
                checksum,
                tag,
                encoding,
                count,
                payload_checksum,
                payload_tag,
            )
        )
    base_version = base[0] if base is not None else -1
    shape = dict(checksum_kind=checksum_kind, adapter=adapter, part_bytes=_aligned(bucket_bytes))
    manifest = UpdateManifest(MANIFEST_SCHEMA, version, sizes, entries, base_version, keep_base, **shape)
    return manifest, payloads


def _place(sizes: list[int], used: int, nbytes: int, bucket_bytes: int) -> tuple[int, int]:
    """Where the next entry of `nbytes` goes in the last bucket of `sizes` (opened, or grown, here): its offset, and
    the bytes the bucket then uses. An entry without bytes (a delta's unchanged tensor) never opens a bucket and lies
    within the current one, and a bucket without bytes yet takes the next tensor however large: no bucket is left
    empty between two (an empty one has no broadcast, and a tensor larger than a bucket stays the only one with bytes
    in its own)."""
    if not sizes or (nbytes and sizes[-1] and used + nbytes > bucket_bytes):
        sizes.append(0)
        used = 0
    offset = used if nbytes else sizes[-1] - sizes[-1] % ALIGN
    sizes[-1] = max(offset + nbytes, sizes[-1])
    return offset, _aligned(offset + nbytes) if nbytes else used


def plan_layout(
    specs: Mapping[str, tuple[str, list[int]]], version: int, bucket_bytes: int, checksum_kind: str = "crc32"
) -> UpdateManifest:
    """A full update's manifest from names, dtypes and shapes alone (name → (dtype, shape), in sending order), its
    checksums and tags to follow in the trailer (`trailer_entry`): what a sender that gathers each tensor only when
    it packs it announces before the first bucket. Same bucket layout as `plan_manifest` gives for the same tensors."""
    state = {name: torch.empty(shape, dtype=DTYPES[dtype], device="meta") for name, (dtype, shape) in specs.items()}
    manifest, _ = plan_update(state, version, bucket_bytes, checksums=False, checksum_kind=checksum_kind)
    return msgspec.structs.replace(manifest, trailer=True)


def trailer_entry(t: torch.Tensor, key: bytes | None, checksum_kind: str = "crc32") -> bytes:
    """One entry of a trailer: the `checksum_kind` checksum of `t`'s bytes and, under `key` (`update_key`), its tag
    (zeros without)."""
    checksum = tensor_checksum(t, checksum_kind).to_bytes(4, "little")
    return checksum + (tensor_tag(t, key) if key is not None else bytes(TAG_BYTES))


class RunningDigest:
    """`trailer_entry` of a tensor whose bytes come in pieces, in order (one sent in parts): `update` each piece (flat
    uint8), then `entry()`."""

    def __init__(self, key: bytes | None, checksum_kind: str = "crc32"):
        self.checksum = RunningChecksum(checksum_kind)
        self.tag = hashlib.blake2b(key=key, digest_size=TAG_BYTES) if key is not None else None

    def update(self, data: torch.Tensor) -> None:
        self.checksum.update(data)
        if self.tag is not None:
            self.tag.update(data.cpu().numpy())

    def entry(self) -> bytes:
        tag = self.tag.digest() if self.tag is not None else bytes(TAG_BYTES)
        return self.checksum.value().to_bytes(4, "little") + tag


def pack_bucket(
    manifest: UpdateManifest, index: int, state: Mapping[str, torch.Tensor], out: torch.Tensor
) -> torch.Tensor:
    """Copy every tensor of bucket `index` into `out` (uint8, at least the bucket's size); return the bucket view."""
    view = out[: manifest.bucket_sizes[index]]
    for t in manifest.tensors:
        if t.bucket == index:
            view[t.offset : t.offset + t.nbytes].copy_(as_bytes(state[t.name]))
    return view


def unpack_buckets(
    manifest: UpdateManifest,
    buckets: list[torch.Tensor],
    verify: bool = True,
    weights_key: bytes | None = None,
    base: tuple[int, Mapping[str, torch.Tensor]] | None = None,
    decoded_into: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the update: for a full entry a view inside the received buckets (no copy), for a delta entry a
    new tensor (or its tensor in `decoded_into`: a worker's arena), `base`'s (version, tensors) with the delta
    applied. Checks sizes and, if asked, checksums of the whole tensors: with `weights_key` every tensor's keyed tag
    (a tensor without one is refused), else its checksum of the manifest's kind (a `sum31` on the buckets' own
    device, no host copy). A delta update without `base` at its `base_version` is refused, naming both versions."""
    if manifest.trailer:  # the checksums came after the buckets
        if len(buckets) != len(manifest.bucket_sizes) + 1:
            raise ManifestError(
                f"received {len(buckets)} buckets, the manifest announced {len(manifest.bucket_sizes)} and a trailer"
            )
        manifest, buckets = manifest.with_trailer(buckets[-1]), buckets[:-1]
    if len(buckets) != len(manifest.bucket_sizes):
        raise ManifestError(f"received {len(buckets)} buckets, the manifest announced {len(manifest.bucket_sizes)}")
    for i, (buf, size) in enumerate(zip(buckets, manifest.bucket_sizes, strict=True)):
        if buf.numel() != size:
            raise ManifestError(f"bucket {i} holds {buf.numel()} bytes, the manifest announced {size}")
    check_base(manifest, base)
    out = {}
    key = update_key(weights_key, manifest.version) if weights_key is not None else None
    kind = manifest.checksum_kind
    on_host = key is not None or kind == "crc32"  # a tag or a CRC32 hashes host bytes; a sum31 is taken where they are
    host: dict[int, torch.Tensor] = {}  # a device bucket checksummed from a host copy (the current one only)
    for t in manifest.tensors:
        raw = buckets[t.bucket][t.offset : t.offset + t.nbytes]
        if t.encoding != "full":
            out[t.name] = apply_delta(t, raw, base[1], (decoded_into or {}).get(t.name))
            if verify:
                _verify(t, as_bytes(out[t.name]), key, kind)
            continue
        if verify and on_host and raw.device.type != "cpu" and t.bucket not in host:
            host = {t.bucket: _to_host(buckets[t.bucket])}
        if verify:
            _verify(t, host[t.bucket][t.offset : t.offset + t.nbytes] if t.bucket in host else raw, key, kind)
        out[t.name] = raw.view(DTYPES[t.dtype]).reshape(t.shape)
    return out


def check_base(manifest: UpdateManifest, base: tuple[int, Mapping[str, torch.Tensor]] | None) -> None:
    """Refuse a delta update unless `base` is (its base_version, tensors), naming both versions."""
    if manifest.is_delta and (base is None or base[0] != manifest.base_version):
        held = "no base" if base is None else f"v{base[0]}"
        raise ManifestError(
            f"update v{manifest.version} is a delta on v{manifest.base_version} but this receiver "
            f"holds {held}: the sender must send a full update"
        )


def apply_delta(
    t: TensorEntry,
    payload: torch.Tensor,
    base: Mapping[str, torch.Tensor],
    out: torch.Tensor | None,
    region: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """`t`'s new tensor, its delta `payload` applied to the base's tensor of its name (into `out`, if given); with
    `region` (dim, start, length) only those rows, onto a base holding only them (a tensor-parallel rank's slice).
    ManifestError when the base is not held in that shape, or the payload contradicts itself."""
    shape = t.shape if region is None else [region[2] if d == region[0] else n for d, n in enumerate(t.shape)]
    held = base.get(t.name)
    if held is None or list(held.shape) != shape or held.dtype != DTYPES[t.dtype]:
        raise ManifestError(f"tensor {t.name}: the delta's base is not held in {t.dtype}{shape}")
    try:
        if region is None:
            return delta.decode(t.encoding, t.count, payload, held, out)
        return delta.decode_slice(t.encoding, t.count, payload, tuple(t.shape), region, held, out)
    except ValueError as exc:
        raise ManifestError(f"tensor {t.name}: {exc} (corrupted in transit)") from exc


def _verify(t: TensorEntry, data: torch.Tensor, key: bytes | None, kind: str) -> None:
    """Check one tensor's bytes (flat uint8) against its tag (with `key`) or its `kind` checksum."""
    check_digest(t, tensor_digest(data, key, kind), key, kind)


def tensor_digest(data: torch.Tensor, key: bytes | None, kind: str) -> bytes | int:
    """One tensor's bytes (flat uint8) digested for `check_digest`: its keyed tag with `key`, else its `kind` checksum.
    A receiver that keeps only a slice digests the whole tensor as it streams through and checks it later, once the
    manifest's values are known (a trailer comes after the buckets)."""
    return bytes_tag(data.cpu().numpy(), key) if key is not None else bytes_checksum(data, kind)


def check_digest(t: TensorEntry, digest: bytes | int, key: bytes | None, kind: str, payload: bool = False) -> None:
    """Refuse `t` unless `digest` (tensor_digest of its bytes, or with `payload` of its delta payload's) is what the
    manifest says, naming the tensor."""
    tag, checksum = (t.payload_tag, t.payload_checksum) if payload else (t.tag, t.checksum)
    of = "delta payload " if payload else ""
    if key is not None:
        if not tag:
            raise ManifestError(
                f"tensor {t.name}: no {of}tag, and this serve has a secret: give the learner the same --secret-file"
            )
        if not hmac.compare_digest(digest, tag):
            raise ManifestError(
                f"tensor {t.name}: its {of}tag does not verify under the update's key (forged, replayed "
                "from another update, or corrupted in transit)"
            )
    elif digest != checksum:
        raise ManifestError(
            f"tensor {t.name}: {of}checksum {digest:#010x} but the manifest says {checksum:#010x}, a {kind} "
            "(corrupted in transit)"
        )


def verifiable(bucket: torch.Tensor, key: bytes | None, kind: str) -> torch.Tensor:
    """The bytes of `bucket` where its digests are taken: a tag or a CRC32 hashes host bytes (a device bucket through
    the reused pinned buffer, valid until the next call), a sum31 is taken where they are."""
    on_host = key is not None or kind == "crc32"
    return _to_host(bucket) if on_host and bucket.device.type != "cpu" else bucket


_PINNED: list[torch.Tensor] = []  # one reusable page-locked buffer for checksumming device buckets


def _to_host(bucket: torch.Tensor) -> torch.Tensor:
    """A host copy of a device bucket through one reused pinned buffer, on the caller's current stream. A copy into
    pageable memory (`.cpu()`) measured on an H100 stalled another thread's kernel launches for ~0.3 s per update;
    allocating page-locked memory per bucket would cost as much again."""
    n = bucket.numel()
    if not _PINNED or _PINNED[0].numel() < n:
        _PINNED[:] = [torch.empty(n, dtype=torch.uint8, pin_memory=True)]
    view = _PINNED[0][:n]
    view.copy_(bucket, non_blocking=True)
    torch.cuda.current_stream(bucket.device).synchronize()
    return view


def check_against(manifest: UpdateManifest, expected: Mapping[str, tuple[str, list[int]]]) -> None:
    """Refuse a manifest whose names, dtypes or shapes differ from `expected` (name → (dtype, shape)).

    The message names the first mismatch so a learner/server model disagreement is found before any bucket moves.
    """
    seen = set()
    for t in manifest.tensors:
        if t.name not in expected:
            raise ManifestError(f"tensor {t.name!r} is not a parameter of the served model (check the model path)")
        dtype, shape = expected[t.name]
        if list(shape) != list(t.shape):
            raise ManifestError(f"tensor {t.name}: shape {t.shape} sent, the served model has {list(shape)}")
        if dtype != t.dtype:
            raise ManifestError(f"tensor {t.name}: dtype {t.dtype} sent, the served model has {dtype}")
        if t.name in seen:
            raise ManifestError(f"tensor {t.name} appears twice in the manifest")
        seen.add(t.name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ManifestError(
            f"{len(missing)} parameters missing from the update, first {missing[0]!r}: send the full state dict"
        )
