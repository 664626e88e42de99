"""Forging a CRC32: what anyone who can write to the weights network can do, and why a keyed tag is needed."""

from __future__ import annotations

import zlib


def forge_crc32(prefix: bytes, target: int) -> bytes:
    """Four bytes that, appended to `prefix`, make its CRC32 `target`: what anyone on the weights network can do to a
    tensor they altered. (CRC32 is linear: walk the register back from the target to find the four table rows,
    then choose the bytes that select them.)"""
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table.append(c)
    row_by_top = {t >> 24: i for i, t in enumerate(table)}
    register, rows = target ^ 0xFFFFFFFF, []
    for _ in range(4):
        row = row_by_top[register >> 24]
        rows.append(row)
        register = ((register ^ table[row]) << 8) & 0xFFFFFFFF
    register, out = zlib.crc32(prefix) ^ 0xFFFFFFFF, bytearray()
    for row in reversed(rows):
        out.append((register ^ row) & 0xFF)
        register = (register >> 8) ^ table[row]
    return bytes(out)
