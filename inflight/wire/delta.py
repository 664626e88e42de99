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

import torch

ENCODINGS = ("full", "indices", "bitmask")
_INDEX = torch.int32
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width, flat (a view: no copy for a contiguous tensor)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat if t.dtype == torch.bool else flat.view(_INT_OF_WIDTH[t.element_size()])


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
    """`new` against `base` (same dtype and shape): (encoding, changed count, payload as flat uint8), the smallest."""
    if new.dtype != base.dtype or new.shape != base.shape:
        raise ValueError(f"delta base is {base.dtype}{list(base.shape)}, the tensor {new.dtype}{list(new.shape)}")
    changed = _bits(new) != _bits(base)
    count, numel, itemsize = int(changed.sum()), new.numel(), new.element_size()
    sizes = {e: payload_nbytes(e, numel, itemsize, count) for e in ENCODINGS}
    if numel >= 2**31:
        del sizes["indices"]  # an int32 index cannot address it
    encoding = min(sizes, key=lambda e: (sizes[e], ENCODINGS.index(e)))  # ties go to the simpler encoding
    flat = new.detach().contiguous().reshape(-1)
    if encoding == "full":
        return encoding, count, flat.view(torch.uint8) if new.dtype != torch.bool else flat.to(torch.uint8)
    values = _as_uint8(flat[changed])
    indices = encoding == "indices"
    where = _as_uint8(changed.nonzero().reshape(-1).to(_INDEX)) if indices else _pack_bits(changed)
    return encoding, count, torch.cat([where, values])


def decode(
    encoding: str, count: int, payload: torch.Tensor, base: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A new tensor (or `out`, contiguous, of `base`'s shape and dtype on the payload's device: a worker's arena):
    `base` with the changed elements of `payload` (flat uint8, `payload_nbytes` long) applied.
    Raises ValueError when the payload contradicts itself (an index out of range, a bitmask whose set bits are not
    `count`)."""
    numel, itemsize = base.numel(), base.element_size()
    want = payload_nbytes(encoding, numel, itemsize, count)
    if payload.numel() != want:
        raise ValueError(f"{encoding} payload of {payload.numel()} bytes, expected {want} for {count} changed elements")
    if out is None:
        out = base.detach().to(payload.device, copy=True).contiguous()  # a GPU serve holds its base in host memory
    else:
        out.copy_(base.detach())
    flat = out.view(-1)
    if encoding == "full":
        flat.view(torch.uint8)[:] = payload  # (bool: the same single bytes)
        return out
    split = payload.numel() - count * itemsize
    values = payload[split:].clone().view(base.dtype)  # clone: the values need not be aligned for their dtype
    if encoding == "indices":
        index = payload[:split].clone().view(_INDEX).to(torch.int64)
        if count and (int(index.min()) < 0 or int(index.max()) >= numel):
            raise ValueError(f"an index of the delta lies outside the tensor's {numel} elements")
    else:
        index = _unpack_bits(payload[:split], numel).nonzero().reshape(-1)
        if index.numel() != count:
            raise ValueError(f"the delta's bitmask marks {index.numel()} elements, its count says {count}")
    # index_copy_ on the integer view: ~7x faster on CPU than a boolean-mask index_put, and bit-exact for any dtype
    _bits(flat).index_copy_(0, index, _bits(values))
    return out


def _as_uint8(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous().view(torch.uint8)


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask
    return (padded.view(-1, 8) << _SHIFTS.to(mask.device)).sum(1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return ((packed[:, None] >> _SHIFTS.to(packed.device)) & 1).reshape(-1)[:numel].bool()
