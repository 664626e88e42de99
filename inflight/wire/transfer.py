"""Moving one update over the weights group: double-buffered senders (rank 0) and a bucket receiver (other ranks).

Contract (both sides, in lockstep or the group times out): the receiver must have the manifest before the sender's first
bucket times out; buckets go in manifest order, one broadcast each, each exactly `manifest.bucket_sizes[i]` bytes; with
`manifest.trailer` one more broadcast of `manifest.trailer_nbytes` follows, the checksums and tags.

Two senders: `send_update` packs from tensors that all exist already; `StreamSender` is fed one tensor at a time, in
manifest order, as the learner gathers them, so rank 0 never holds more than the two buckets (and the tensor at hand).
"""

from __future__ import annotations

import math
import mmap
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from inflight.wire.group import WeightsGroup
from inflight.wire.weights import (
    DTYPES,
    ManifestError,
    RunningDigest,
    TensorEntry,
    UpdateManifest,
    apply_delta,
    as_bytes,
    check_base,
    check_digest,
    pack_bucket,
    tensor_digest,
    trailer_entry,
    update_key,
    verifiable,
)


@dataclass
class TransferStats:
    bytes: int = 0
    seconds: float = 0.0
    buckets: int = 0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def send_update(
    group: WeightsGroup,
    manifest: UpdateManifest,
    state: Mapping[str, torch.Tensor],
    pin: bool = False,
    device: torch.device | str | None = None,
) -> TransferStats:
    """Broadcast every bucket of `manifest` from rank 0. Packing bucket k+1 overlaps sending bucket k; a bucket sent in
    parts (one tensor larger than a part) is sent from the tensor itself, never packed. The buckets are on `device`
    (default: the state's); a tensor sent from itself is copied there first when it lives elsewhere."""
    if not manifest.bucket_sizes:
        return TransferStats()
    device = torch.device(device) if device is not None else next(iter(state.values())).device
    parts = _parts_by_bucket(manifest)
    # a tensor larger than a part: the only one with bytes in its bucket
    alone = {i: next(t.name for t in manifest.tensors_in(i) if t.nbytes) for i, p in parts.items() if len(p) > 1}
    size = max((n for i, n in enumerate(manifest.bucket_sizes) if i not in alone), default=0)
    buffers = [torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin) for _ in range(2)]
    stats, start = TransferStats(), time.perf_counter()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-pack") as packer:

        def packed(i: int):
            return None if i in alone else packer.submit(pack_bucket, manifest, i, state, buffers[i % 2])

        pending = packed(0)
        for i in range(len(manifest.bucket_sizes)):
            bucket = pending.result() if pending is not None else as_bytes(state[alone[i]]).to(device)
            if i + 1 < len(manifest.bucket_sizes):
                pending = packed(i + 1)
            for part in parts.get(i, ()):  # none for an update without bytes (a delta where nothing changed)
                group.broadcast(bucket[part[1] : part[2]], what=manifest.part_name(part))
            stats.bytes += manifest.bucket_sizes[i]
            stats.buckets += 1
    stats.seconds = time.perf_counter() - start
    return stats


def _parts_by_bucket(manifest: UpdateManifest) -> dict[int, list[tuple[int, int, int]]]:
    by_bucket: dict[int, list[tuple[int, int, int]]] = {}
    for part in manifest.parts():
        by_bucket.setdefault(part[0], []).append(part)
    return by_bucket


class StreamSender:
    """Rank 0's streaming sender of a `plan_layout` manifest (trailer checksums): `put` each tensor in manifest order;
    a broadcast (a bucket, or one part of a tensor larger than a part: `UpdateManifest.parts`) goes out on a background
    thread as soon as its last byte is in, while the next one fills the other buffer; `finish` sends the last one and
    the trailer. Two buffers of the largest part on `device`, reused, so rank 0 holds two parts whatever the largest
    tensor; host buffers are page-locked where CUDA is present, so a GPU learner's tensors reach them by DMA (into
    pageable memory every device-to-host copy goes through a driver staging buffer, at a fraction of the speed)."""

    def __init__(
        self,
        group: WeightsGroup,
        manifest: UpdateManifest,
        device: torch.device | str,
        weights_key: bytes | None = None,
    ):
        if not manifest.trailer:
            raise ValueError("StreamSender sends trailer manifests (inflight/wire/weights.py:plan_layout)")
        self.group, self.manifest = group, manifest
        self.key = update_key(weights_key, manifest.version) if weights_key is not None else None
        self.parts = manifest.parts()
        self.first_part: dict[int, int] = {}  # bucket → the index of its first part
        for k, (bucket, _, _) in enumerate(self.parts):
            self.first_part.setdefault(bucket, k)
        size = max((end - first for _, first, end in self.parts), default=0)
        pin = torch.device(device).type == "cpu" and torch.cuda.is_available()
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin) for _ in range(2)]
        self.sums: list[bytes] = []
        self._rows = 0  # rows of the current entry already in (an entry sent in pieces)
        self._digest: RunningDigest | None = None  # of an entry sent in parts, as its bytes go out
        self.stats = TransferStats()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-stream")
        self._sending = None
        self._started = time.perf_counter()

    def put(self, name: str, tensor: torch.Tensor, start: int = 0) -> None:
        """Copy `tensor` — the whole of the manifest's next tensor, or its rows `start` .. `start + len(tensor)` —
        into its place, cast to the entry's dtype on the way (no temporary). Rows come in order; the entry is
        checksummed and the next one expected once its last row is in."""
        entry = self.manifest.tensors[len(self.sums)]
        if entry.name != name or start != self._rows:
            raise ValueError(f"StreamSender got {name!r} from row {start}, expected {entry.name!r} from {self._rows}")
        whole = list(tensor.shape) == entry.shape and start == 0
        parted = self.parts[self.first_part[entry.bucket]][2] < self.manifest.bucket_sizes[entry.bucket]
        if parted:
            self._put_parted(entry, tensor, start)
        else:
            self._put_whole_bucket(entry, tensor, start, whole)
        self._rows = 0 if whole or start + len(tensor) == entry.shape[0] else start + len(tensor)
        following = self.manifest.tensors[len(self.sums)] if len(self.sums) < len(self.manifest.tensors) else None
        if self._rows == 0 and (following is None or following.bucket != entry.bucket):
            self._send(len(self.parts) - 1 if following is None else self.first_part[following.bucket] - 1)

    def _put_whole_bucket(self, entry: TensorEntry, tensor: torch.Tensor, start: int, whole: bool) -> None:
        # Bucket k fills buffer k % 2, free again: `_send(k - 1)` waited for bucket k - 2's broadcast before starting.
        raw = self.buffers[self.first_part[entry.bucket] % 2][entry.offset : entry.offset + entry.nbytes]
        typed = raw.view(DTYPES[entry.dtype]).reshape(entry.shape)
        (typed if whole else typed[start : start + len(tensor)]).copy_(tensor)  # the cast happens here, into the bucket
        if whole or start + len(tensor) == entry.shape[0]:
            self.sums.append(trailer_entry(typed, self.key, self.manifest.checksum_kind))

    def _put_parted(self, entry: TensorEntry, tensor: torch.Tensor, start: int) -> None:
        """Rows of a tensor whose bucket goes in parts (it is alone in it, at offset 0): cast into one part's buffer
        at a time, digested as they go, each part sent once full."""
        dtype = DTYPES[entry.dtype]
        itemsize = dtype.itemsize
        if start == 0:
            self._digest = RunningDigest(self.key, self.manifest.checksum_kind)
        flat, done = tensor.reshape(-1), 0
        at = start * (math.prod(entry.shape[1:]) * itemsize)  # this piece's first byte in the bucket
        first = self.first_part[entry.bucket]
        while done < flat.numel():
            k = first + at // self.manifest.part_bytes
            _, begin, end = self.parts[k]
            n = min(flat.numel() - done, (end - at) // itemsize)
            typed = self.buffers[k % 2][at - begin : at - begin + n * itemsize].view(dtype)
            typed.copy_(flat[done : done + n])
            self._digest.update(typed.view(torch.uint8))
            done, at = done + n, at + n * itemsize
            if at == end and at < entry.nbytes:
                self._send(k)  # a full part; the last goes with the entry's end
        if at == entry.nbytes:
            self.sums.append(self._digest.entry())
            self._digest = None

    def _send(self, index: int) -> None:
        """Broadcast part `index` (`self.parts`) from its buffer, once the one before it has gone."""
        self._wait()
        bucket, first, end = self.parts[index]
        what = self.manifest.part_name(self.parts[index])
        self._sending = self._pool.submit(self.group.broadcast, self.buffers[index % 2][: end - first], what=what)
        self.stats.bytes += end - first
        self.stats.buckets += end == self.manifest.bucket_sizes[bucket]

    def _wait(self) -> None:
        if self._sending is not None:
            self._sending.result()  # re-raises a failed broadcast
            self._sending = None

    def abandon(self) -> None:
        """After a failed broadcast: stop, sending nothing more (the group is broken anyway)."""
        self._pool.shutdown(wait=False)

    def finish(self) -> TransferStats:
        """Wait for the last bucket, broadcast the trailer; the transfer's stats. Raises if a tensor is missing."""
        try:
            if len(self.sums) != len(self.manifest.tensors):
                raise ValueError(
                    f"StreamSender got {len(self.sums)} of the manifest's {len(self.manifest.tensors)} tensors"
                )
            self._wait()
            trailer = torch.frombuffer(bytearray(b"".join(self.sums)), dtype=torch.uint8)
            self.group.broadcast(trailer.to(self.buffers[0].device), what=f"trailer of version {self.manifest.version}")
        finally:
            self._pool.shutdown(wait=True)
        self.stats.seconds = time.perf_counter() - self._started
        return self.stats


def receive_update(
    group: WeightsGroup,
    manifest: UpdateManifest,
    device: torch.device | str = "cpu",
    on_bucket: Callable[[int, int], None] | None = None,
    into: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Receive every bucket of `manifest` (and its trailer) into `into` (`update_buffers`' sizes, e.g. views of a
    worker's arena) or else fresh staging buffers; `on_bucket(index, bytes)` reports progress."""
    buckets = (
        into
        if into is not None
        else [torch.empty(n, dtype=torch.uint8, device=device) for n in update_buffers(manifest)]
    )
    for i, first, end in manifest.parts():
        group.broadcast(buckets[i][first:end], what=manifest.part_name((i, first, end)))
        if on_bucket is not None and end == manifest.bucket_sizes[i]:
            on_bucket(i, end)
    if manifest.trailer:  # the checksums, after the buckets (inflight/wire/weights.py:UpdateManifest.trailer)
        group.broadcast(buckets[-1], what=f"trailer of version {manifest.version}")
    return buckets


def update_buffers(manifest: UpdateManifest) -> list[int]:
    """The bytes of every buffer `receive_update` receives `manifest` into: its buckets, then its trailer if any."""
    return list(manifest.bucket_sizes) + ([manifest.trailer_nbytes] if manifest.trailer else [])


def drain_update(group: WeightsGroup, manifest: UpdateManifest, buffer: torch.Tensor) -> None:
    """Receive and drop every broadcast of `manifest` through `buffer` (at least its largest): a receiver that refused
    the update (it would not fit its arena) keeps the group in step with the sender instead of breaking it."""
    sizes = [end - first for _, first, end in manifest.parts()]
    sizes += [manifest.trailer_nbytes] if manifest.trailer else []
    for i, size in enumerate(sizes):
        group.broadcast(buffer[:size], what=f"broadcast {i} of refused version {manifest.version}")


Keep = Callable[[str, torch.Tensor], "torch.Tensor | None"]


def receive_kept(
    group: WeightsGroup,
    manifest: UpdateManifest,
    keep: Keep,
    device: torch.device | str = "cpu",
    on_bucket: Callable[[int, int], None] | None = None,
    weights_key: bytes | None = None,
    into: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None,
    base: tuple[int, Mapping[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Receive `manifest`'s buckets one at a time into one reused buffer and keep only what `keep(name, whole tensor)`
    returns of each tensor (a tensor-parallel rank's slice, one dim narrowed: vllm_patches/placement.py), copied out
    before the next bucket overwrites it; None keeps nothing. Every whole tensor is digested as it streams through and
    checked against the manifest (or its trailer) once all arrived: what is kept is a slice of a tensor that verified.
    A delta (`base`: (its base version, what this rank kept of it)) is applied to what the rank keeps: a sparse entry
    kept whole is decoded and checked whole, a slice is decoded from the payload, whose own digest is checked first.
    Raises ManifestError naming the first tensor that does not verify. `into`: the buffer (the largest bucket, or more)
    and a tensor for each kept piece to copy it to (a worker's arena); without it, the buffer is `receive_buffer`'s
    and each kept piece its own clone."""
    buffer, out = into if into is not None else (receive_buffer(max(manifest.bucket_sizes, default=0), device), {})
    try:
        check_base(manifest, base)
    except ManifestError:
        drain_update(group, manifest, buffer)  # the group stays in step; the sender goes on as for any receiver
        raise
    key = update_key(weights_key, manifest.version) if weights_key is not None else None
    kind, kept, digests = manifest.checksum_kind, {}, {}
    by_bucket: dict[int, list] = {}
    for t in manifest.tensors:
        by_bucket.setdefault(t.bucket, []).append(t)
    parts = _parts_by_bucket(manifest)
    for i, size in enumerate(manifest.bucket_sizes):
        for part in parts.get(i, ()):  # none for a bucket without bytes (a delta where nothing changed)
            group.broadcast(buffer[part[1] : part[2]], what=manifest.part_name(part))
        bucket = buffer[:size]
        digestible = verifiable(bucket, key, kind)
        for t in by_bucket.get(i, []):
            raw, read = bucket[t.offset : t.offset + t.nbytes], digestible[t.offset : t.offset + t.nbytes]
            if t.encoding != "full":
                piece = _kept_of_delta(t, raw, read, keep, base[1], out.get(t.name), key, kind)
            else:
                digests[t.name] = tensor_digest(read, key, kind)
                piece = _kept_copy(keep(t.name, raw.view(DTYPES[t.dtype]).reshape(t.shape)), out.get(t.name))
            if piece is not None:
                kept[t.name] = piece
        if on_bucket is not None:
            on_bucket(i, size)
    if manifest.trailer:
        n = manifest.trailer_nbytes  # the buckets are digested: the buffer is free
        trailer = buffer[:n] if n <= buffer.numel() else _empty(n, device)
        group.broadcast(trailer, what=f"trailer of version {manifest.version}")
        manifest = manifest.with_trailer(trailer)
    for t in manifest.tensors:
        if t.name in digests:
            check_digest(t, digests[t.name], key, kind)
    return kept


def _kept_copy(piece: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor | None:
    """A kept view of a bucket copied out before the next bucket overwrites it: into `out` (the arena), or a clone."""
    if piece is None:
        return None
    return out.copy_(piece) if out is not None else piece.clone(memory_format=_CONTIGUOUS)


def _kept_of_delta(
    t: TensorEntry,
    payload: torch.Tensor,
    read: torch.Tensor,
    keep: Keep,
    base: Mapping[str, torch.Tensor],
    out: torch.Tensor | None,
    key: bytes | None,
    kind: str,
) -> torch.Tensor | None:
    """What `keep` keeps of the new tensor a sparse delta entry encodes, from the payload and the rank's own piece of
    the base: the whole tensor decoded and checked whole, or its slice decoded once the payload (`read`: its bytes
    where they are digested) checked. Nothing kept: the payload is checked all the same."""
    whole = torch.empty(t.shape, dtype=DTYPES[t.dtype], device="meta")
    probe = keep(t.name, whole)  # what would be kept, as a view of the whole: its region
    region = None if probe is None or probe.shape == whole.shape else _region(t, probe, whole)
    if probe is None or region is not None:
        check_digest(t, tensor_digest(read, key, kind), key, kind, payload=True)
    if probe is None:
        return None
    new = apply_delta(t, payload, base, out, region)
    if region is None:
        check_digest(t, tensor_digest(as_bytes(new), key, kind), key, kind)
    return new


def _region(t: TensorEntry, probe: torch.Tensor, whole: torch.Tensor) -> tuple[int, int, int]:
    """(dim, start, length) of `probe`, a view of `whole` narrowed along one dim (ManifestError otherwise)."""
    dims = [d for d, (a, b) in enumerate(zip(probe.shape, whole.shape, strict=True)) if a != b]
    if len(dims) != 1 or probe.stride() != whole.stride():
        raise ManifestError(f"tensor {t.name}: this rank keeps {list(probe.shape)} of it, not rows of one dim")
    dim = dims[0]
    return dim, probe.storage_offset() // whole.stride(dim), probe.shape[dim]


_CONTIGUOUS = torch.contiguous_format


def _empty(nbytes: int, device: torch.device | str) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def receive_buffer(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """`receive_kept`'s one bucket buffer. In host memory it is its own anonymous mapping, unmapped the moment the
    receipt drops it. Why: a bucket holds the largest tensor whole (an embedding or head: half of a small model); from
    malloc's heap, freed, it stays resident until the next trim, under the commit that follows — and a rank staging
    slices then peaked as high as one staging everything (issue 41, benchmarks/sliced_staging.py)."""
    if torch.device(device).type != "cpu" or nbytes == 0:
        return _empty(nbytes, device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
