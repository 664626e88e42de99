"""Delta encoding of one tensor against the version the receiver already holds.

Between two RL steps most elements of a weight do not change *in the serve's dtype*: an AdamW step moves each element by
about the learning rate, and a bf16 element only changes when that crosses one of its rounding boundaries (measured on
SmolLM2 at the demo's lr 3e-5: 4-9% of the elements per step; at lr 1e-6 far fewer). So a delta sends only the changed
elements, in whichever of three encodings is smallest for that tensor:

- `full`: the tensor's bytes, as a full update sends them.
- `indices`: `count` int32 flat indices, then the `count` new values (the sparse case: cheaper below ~3% changed).
- `bitmask`: one bit per element (little-endian within each byte, element i in byte i // 8, bit i % 8), then the
  `count` new values in element order (cheaper between ~3% and ~90% changed for bf16).

"Changed" is bitwise (the elements compared as integers of their width): -0.0 vs 0.0 or two NaN payloads differ, so
applying a delta reproduces the sender's tensor bit for bit, which the receiver then proves with the full tensor's
checksum or tag (inflight/wire/weights.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

ENCODINGS = ("full", "indices", "bitmask")
_INDEX = torch.int32
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width, flat (a view: no copy for a contiguous tensor)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat if t.dtype == torch.bool else flat.view(_INT_OF_WIDTH[t.element_size()])


# Elements encoded or decoded at once (a multiple of 8, so a chunk's bits start on a byte): the changed-element mask, a
# bitmask's packed or unpacked bits, the indices of the changed elements and a slice's index arithmetic are made for a
# chunk, not for the whole tensor (for a 778M-element embedding they would take tens of GB beside the model or the
# arena). `DECODE_WORKSPACE_BYTES` bounds what a decode allocates beyond its output: 96 bytes an element of a chunk
# (measured on CPU, 64M bf16 elements, 85% changed: 71 MiB of resident growth for a slice's decode, 38 MiB for the
# whole tensor's); an encode beyond its payload takes less, and is held to the same bound (tests/wire/test_delta.py).
CHUNK = 1 << 20
WORKSPACE_PER_ELEMENT = 96
DECODE_WORKSPACE_BYTES = ENCODE_WORKSPACE_BYTES = WORKSPACE_PER_ELEMENT * CHUNK


def payload_nbytes(encoding: str, numel: int, itemsize: int, count: int) -> int:
    """Bytes a tensor of `numel` elements of `itemsize` bytes with `count` changed elements takes in `encoding`."""
    if encoding == "full":
        return numel * itemsize
    if encoding == "indices":
        return count * (_INDEX.itemsize + itemsize)
    if encoding == "bitmask":
        return (numel + 7) // 8 + count * itemsize
    raise ValueError(f"encoding is {encoding!r}, expected one of {list(ENCODINGS)}")


def encode(new: torch.Tensor, base: torch.Tensor) -> tuple[str, int, torch.Tensor]:
    """`new` against `base` (same dtype and shape): (encoding, changed count, payload as flat uint8), the smallest.
    Compared and packed `CHUNK` elements at a time, like the decode: beyond the payload it allocates a chunk's masks,
    indices and values (`ENCODE_WORKSPACE_BYTES`), not the whole tensor's, on the learner's device beside its model."""
    if new.dtype != base.dtype or new.shape != base.shape:
        raise ValueError(f"delta base is {base.dtype}{list(base.shape)}, the tensor {new.dtype}{list(new.shape)}")
    ours, theirs = _bits(new), _bits(base)
    numel, itemsize = new.numel(), new.element_size()
    chunks = [(first, min(CHUNK, numel - first)) for first in range(0, numel, CHUNK)]
    counted = [(ours[f : f + n] != theirs[f : f + n]).sum() for f, n in chunks]
    counts = torch.stack(counted).tolist() if counted else []  # one device sync, not one a chunk
    count = sum(counts)
    sizes = {e: payload_nbytes(e, numel, itemsize, count) for e in ENCODINGS}
    if numel >= 2**31:
        del sizes["indices"]  # an int32 index cannot address it
    encoding = min(sizes, key=lambda e: (sizes[e], ENCODINGS.index(e)))  # ties go to the simpler encoding
    flat = new.detach().contiguous().reshape(-1)
    if encoding == "full":
        return encoding, count, flat.view(torch.uint8) if new.dtype != torch.bool else flat.to(torch.uint8)
    payload = torch.empty(sizes[encoding], dtype=torch.uint8, device=new.device)
    split, seen = payload.numel() - count * itemsize, 0
    for (first, n), changes in zip(chunks, counts, strict=True):
        changed = ours[first : first + n] != theirs[first : first + n]
        if encoding == "bitmask":  # a chunk starts on a byte: CHUNK is a multiple of 8
            payload[first // 8 : (first + n + 7) // 8] = _pack_bits(changed)
        elif changes:
            index = changed.nonzero().reshape(-1).add_(first).to(_INDEX)
            payload[seen * _INDEX.itemsize : (seen + changes) * _INDEX.itemsize] = _as_uint8(index)
        payload[split + seen * itemsize : split + (seen + changes) * itemsize] = _as_uint8(
            flat[first : first + n][changed]
        )
        seen += changes
    return encoding, count, payload


def decode(
    encoding: str, count: int, payload: torch.Tensor, base: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A new tensor (or `out`, contiguous, of `base`'s shape and dtype on the payload's device: a worker's arena):
    `base` with the changed elements of `payload` (flat uint8, `payload_nbytes` long) applied.
    Raises ValueError when the payload contradicts itself (an index out of range, a bitmask whose set bits are not
    `count`)."""
    numel = base.numel()
    _check_size(encoding, count, payload, numel, base.element_size())
    out = _from_base(base, payload, out)
    flat = out.view(-1)
    if encoding == "full":
        flat.view(torch.uint8)[:] = payload  # (bool: the same single bytes)
        return out
    # index_copy_ on the integer view: ~7x faster on CPU than a boolean-mask index_put, and bit-exact for any dtype
    for index, values in _changes(encoding, count, payload, numel, base.dtype):
        _bits(flat).index_copy_(0, index, _bits(values))
    return out


def decode_slice(
    encoding: str,
    count: int,
    payload: torch.Tensor,
    shape: tuple[int, ...],
    region: tuple[int, int, int],
    base: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """What a tensor-parallel rank keeps of the new tensor of `shape` that `payload` encodes: `region` = (dim, start,
    length), the rows it keeps along that dim, decoded onto `base`, the same rows of the base (its own slice: the rank
    holds no more). Equal bit for bit to `decode(...)` of the whole tensor narrowed to `region`; the payload's changes
    outside the region are skipped. Raises ValueError as `decode` does, or when `base` is not the region's shape."""
    dim, start, length = region
    kept = tuple(length if d == dim else n for d, n in enumerate(shape))
    if tuple(base.shape) != kept:
        raise ValueError(f"the base slice is {list(base.shape)}; rows {start}..{start + length} of dim {dim}: {kept}")
    numel = math.prod(shape)
    _check_size(encoding, count, payload, numel, base.element_size())
    out = _from_base(base, payload, out)
    inner, size = math.prod(shape[dim + 1 :]), shape[dim]
    if encoding == "full":  # the rows straight from the whole tensor's bytes
        rows = payload.view(-1, size, inner * base.element_size())[:, start : start + length]
        out.view(-1).view(torch.uint8).view(rows.shape).copy_(rows)
        return out
    for index, values in _changes(encoding, count, payload, numel, base.dtype):
        along = torch.div(index, inner, rounding_mode="floor").remainder_(size)
        inside = (along >= start).logical_and_(along < start + length)
        index, along = index[inside], along[inside]
        # in place where it can be: a chunk's index arithmetic is most of what a decode allocates
        local = torch.div(index, inner * size, rounding_mode="floor").mul_(length * inner)
        local.add_(along.sub_(start).mul_(inner)).add_(index.remainder_(inner))
        _bits(out.view(-1)).index_copy_(0, local, _bits(values[inside]))
    return out


def _check_size(encoding: str, count: int, payload: torch.Tensor, numel: int, itemsize: int) -> None:
    want = payload_nbytes(encoding, numel, itemsize, count)
    if payload.numel() != want:
        raise ValueError(f"{encoding} payload of {payload.numel()} bytes, expected {want} for {count} changed elements")


def _from_base(base: torch.Tensor, payload: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return base.detach().to(payload.device, copy=True).contiguous()  # a GPU serve holds its base in host memory
    return out.copy_(base.detach())


def _changes(
    encoding: str, count: int, payload: torch.Tensor, numel: int, dtype: torch.dtype
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The changed elements a sparse payload carries, as (flat int64 indices, new values), `CHUNK` at a time."""
    itemsize = dtype.itemsize
    split = payload.numel() - count * itemsize

    def values(first: int, n: int) -> torch.Tensor:  # clone: the values need not be aligned for their dtype
        return payload[split + first * itemsize : split + (first + n) * itemsize].clone().view(dtype)

    if encoding == "indices":
        for first in range(0, count, CHUNK):
            n = min(CHUNK, count - first)
            index = payload[first * 4 : (first + n) * 4].clone().view(_INDEX).to(torch.int64)
            if int(index.min()) < 0 or int(index.max()) >= numel:
                raise ValueError(f"an index of the delta lies outside the tensor's {numel} elements")
            yield index, values(first, n)
        return
    seen = 0
    for first in range(0, numel, CHUNK):
        n = min(CHUNK, numel - first)
        index = _unpack_bits(payload[first // 8 : (first + n + 7) // 8], n).nonzero().reshape(-1)
        marked = index.numel()
        if seen + marked > count:
            raise ValueError(f"the delta's bitmask marks more elements than its count says, {count}")
        yield index.add_(first), values(seen, marked)
        seen += marked
    if seen != count:
        raise ValueError(f"the delta's bitmask marks {seen} elements, its count says {count}")


def _as_uint8(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous().view(torch.uint8)


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask
    return (padded.view(-1, 8) << _SHIFTS.to(mask.device)).sum(1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return ((packed[:, None] >> _SHIFTS.to(packed.device)) & 1).reshape(-1)[:numel].bool()
