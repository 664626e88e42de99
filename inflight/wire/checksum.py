"""Per-tensor checksums of a weight update, computed where the bytes are: CRC32 on the host, `sum31` on any device.

A CRC32 needs the bytes in host memory. For a learner on a GPU and a serve receiving into GPU buckets over NCCL that is
a device-to-host copy of every byte on both sides (and one host thread hashing them) on the path of every update,
~1–2 GB/s at best: the slowest step of the transfer. `sum31` is a position-weighted sum of the bytes' 16-bit words
modulo the prime 2^31 - 1, computed by torch integer kernels on whatever device holds the tensor, so a GPU sender and a
GPU receiver never move a byte to the host to check it. Integer arithmetic makes it exact and the same on every
device and in every reduction order: a CPU serve checks a GPU learner's sums bitwise.

What it catches: like CRC32, corruption, not forgery (a secret's keyed tags, inflight/wire/weights.py, do that, and
they are computed on the host). Any change of one 16-bit word changes the sum (a word's weight is invertible modulo a
prime and a word is smaller than it), and so does swapping two words that differ (no two words of a tensor under
4 GiB share a weight); a random corruption goes unseen with probability ~2^-31, as with CRC32.

The sender picks the kind (`checksum_kind_for` its own tensors' device) and names it in the manifest
(`UpdateManifest.checksum_kind`); the receiver checks whatever kind it is told, on its own device.
"""

from __future__ import annotations

import zlib

import torch

CHECKSUM_KINDS = ("crc32", "sum31")
_PRIME = (1 << 31) - 1
_MULTIPLIER = 48271  # a primitive root modulo the prime: word i's weight (i + 1) · 48271 mod p is never 0
_ROW_WORDS = 1 << 16  # a row's products are below 2^47, its sum below 2^63: one reduction per row, not per word
_CHUNK_ROWS = 64  # 8 MiB of bytes per pass: ~64 MiB of int64 temporaries on the device, whatever the tensor
# Device bytes `sum31` takes beyond the tensor, for the staging plan (vllm_patches/device_plan.py): its int64 chunk
# and the chunk's product, plus (`sum31_pad_bytes`) a whole padded copy of a tensor not a multiple of a row.
SUM31_WORKSPACE_BYTES = 2 * _CHUNK_ROWS * _ROW_WORDS * 8


def sum31_pad_bytes(nbytes: int) -> int:
    """The padded copy `sum31` makes of a tensor of `nbytes` (0 when it is whole rows already)."""
    row = 2 * _ROW_WORDS
    return 0 if nbytes % row == 0 else -(-nbytes // row) * row


_ROW_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def checksum_kind_for(device: torch.device | str) -> str:
    """The kind a sender whose tensors live on `device` computes without a host copy: `sum31` on an accelerator,
    CRC32 (zlib, faster on one CPU core than torch's integer kernels) in host memory."""
    return "crc32" if torch.device(device).type == "cpu" else "sum31"


def tensor_checksum(t: torch.Tensor, kind: str) -> int:
    """The `kind` checksum of the tensor's bytes (its storage order, contiguous)."""
    return bytes_checksum(t.detach().contiguous().reshape(-1).view(torch.uint8), kind)


def bytes_checksum(data: torch.Tensor, kind: str) -> int:
    """The `kind` checksum of a flat uint8 tensor: CRC32 from a host copy (none if it is on the host), `sum31` on its
    own device."""
    if kind == "crc32":
        return zlib.crc32(data.cpu().numpy()) & 0xFFFFFFFF
    if kind == "sum31":
        return sum31(data)
    raise ValueError(f"checksum kind is {kind!r}, expected one of {list(CHECKSUM_KINDS)}")


def sum31(data: torch.Tensor) -> int:
    """Σ word_i · ((i + 1) · 48271 mod p) mod p, p = 2^31 - 1, over the little-endian 16-bit words of `data` (a flat
    uint8 tensor, zero-padded to whole rows of 2^16 words: padding adds nothing), on `data`'s device; one host
    synchronisation for the result.

    Computed a row at a time without a reduction per word: word j of row k weighs (base_j + off_k) mod p, with
    base_j = (j + 1) · 48271 mod p and off_k = k · 2^16 · 48271 mod p; as base_j + off_k < 2p, modulo p the row's sum
    is Σ_j word_j · base_j + off_k · Σ_j word_j. Four passes over the words instead of eight."""
    row = 2 * _ROW_WORDS
    rows = -(-data.numel() // row)
    if rows * row != data.numel():
        data = torch.cat([data, data.new_zeros(rows * row - data.numel())])
    return int(_rows_sum(data, 0).remainder_(_PRIME))


def _rows_sum(data: torch.Tensor, first_row: int) -> torch.Tensor:
    """`sum31`'s terms of whole rows `data` (flat uint8, a multiple of a row), rows `first_row` onwards of the tensor:
    a device int64, not yet reduced modulo p."""
    if data.storage_offset() % 2:
        data = data.clone()  # a 16-bit view needs an even start
    words = data.view(torch.int16).view(-1, _ROW_WORDS)
    base = _row_weights(data.device)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for first in range(0, len(words), _CHUNK_ROWS):
        chunk = words[first : first + _CHUNK_ROWS].to(torch.int64).bitwise_and_(0xFFFF)
        plain = chunk.sum(dim=1).remainder_(_PRIME)
        weighted = chunk.mul_(base).sum(dim=1).remainder_(_PRIME)
        k = torch.arange(first_row + first, first_row + first + len(plain), dtype=torch.int64, device=data.device)
        offsets = k.mul_(_ROW_WORDS * _MULTIPLIER % _PRIME).remainder_(_PRIME)
        total += weighted.add_(plain.mul_(offsets)).remainder_(_PRIME).sum()
    return total.remainder_(_PRIME)


class RunningChecksum:
    """The `kind` checksum of bytes fed in order, in pieces of any size (a tensor sent in parts): `update` each piece
    (flat uint8), then `value()` — equal to `bytes_checksum` of them all. A sum31 keeps at most one row (128 KiB)
    back between pieces, on their device, and synchronises once, in `value`."""

    def __init__(self, kind: str):
        if kind not in CHECKSUM_KINDS:
            raise ValueError(f"checksum kind is {kind!r}, expected one of {list(CHECKSUM_KINDS)}")
        self.kind, self.crc, self.rows, self.total, self.carry = kind, 0, 0, None, None

    def update(self, data: torch.Tensor) -> None:
        if self.kind == "crc32":
            self.crc = zlib.crc32(data.cpu().numpy(), self.crc)
            return
        row = 2 * _ROW_WORDS
        if self.carry is not None:  # complete the row held back from the head of `data`, not a copy of all of it
            need = row - self.carry.numel()
            self.carry, data = torch.cat([self.carry, data[:need]]), data[need:]
            if self.carry.numel() < row:
                return
            self._add(self.carry)
            self.carry = None
        whole = data.numel() // row * row
        if whole:
            self._add(data[:whole])
        if whole < data.numel():
            self.carry = data[whole:].clone()

    def _add(self, rows: torch.Tensor) -> None:
        """Whole rows, the next ones of the stream."""
        part = _rows_sum(rows, self.rows)
        self.total = part if self.total is None else self.total.add_(part)
        self.rows += rows.numel() // (2 * _ROW_WORDS)

    def value(self) -> int:
        if self.kind == "crc32":
            return self.crc & 0xFFFFFFFF
        if self.carry is not None:  # the last row, zero-padded as `sum31` pads it
            last, self.carry = self.carry, None
            self.update(torch.cat([last, last.new_zeros(2 * _ROW_WORDS - last.numel())]))
        return 0 if self.total is None else int(self.total.remainder_(_PRIME))


def _row_weights(device: torch.device) -> torch.Tensor:
    """base_j for one row, made once per device."""
    if device not in _ROW_WEIGHTS:
        j = torch.arange(1, _ROW_WORDS + 1, dtype=torch.int64, device=device)
        _ROW_WEIGHTS[device] = j.mul_(_MULTIPLIER).remainder_(_PRIME)
    return _ROW_WEIGHTS[device]
