"""RolloutJournal: the learner's write-ahead log of accepted rollouts; a killed learner loses nothing it acknowledged.

Rank 0 appends every accepted rollout record (the raw msgpack bytes, exactly as they arrived) to the current segment
and fsyncs before it acknowledges the record's group to the serve (`Progress.acked`); the serve keeps every group it
sent until then and sends the unacknowledged ones again when a restarted learner asks it to introduce itself.

At each checkpoint the journal is rotated: a new segment gets the records of groups not yet trained (the checkpoint
holds the trained ones as `consumed`), then older segments are deleted. `--resume` loads the checkpoint and replays
the journal, skipping trained groups; groups trained after the last checkpoint are replayed and trained again (their
updates were lost with the process), so every group counts exactly once in the resumed model.

With `--keep-journal` rotation deletes nothing: the segments then hold every accepted rollout in arrival order (the
records copied into a new segment at a checkpoint repeat earlier ones and are skipped on replay), which is what
`--replay` trains from (inflight/learn/replay.py); `read_segments` reads them without opening the journal.

Format: segments `segment-NNNNNN.log`, each a sequence of (4-byte little-endian length, record). A torn tail (a
record cut by a kill) is ignored: it was never acknowledged.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger("inflight.learn")
_LEN = struct.Struct("<I")


class RolloutJournal:
    """The write-ahead log in `directory` (created; a new segment is opened for appends). `keep_segments`: rotation
    deletes no segment (`--keep-journal`)."""

    def __init__(self, directory: Path, keep_segments: bool = False):
        self.dir, self.keep_segments = Path(directory), keep_segments
        self.dir.mkdir(parents=True, exist_ok=True)
        existing = self.segments()
        self.index = (int(existing[-1].stem.split("-")[1]) + 1) if existing else 0
        self._file = self._open(self.index)
        self.records = 0

    def segments(self) -> list[Path]:
        return segment_paths(self.dir)

    def _open(self, index: int):
        return (self.dir / f"segment-{index:06d}.log").open("ab", buffering=0)

    def append(self, records: Iterable[bytes]) -> None:
        """Append and fsync: when this returns, the records survive a kill -9 (and a power cut, if the disk honours
        fsync)."""
        payload = b"".join(_LEN.pack(len(r)) + r for r in records)
        if payload:
            self._file.write(payload)
            os.fsync(self._file.fileno())
            self.records += 1

    def replay(self) -> Iterator[bytes]:
        """Every complete record of every segment, oldest first (the open segment included)."""
        return read_segments(self.dir)

    def rotate(self, keep: Iterable[bytes]) -> None:
        """Start a new segment holding only `keep` (fsynced), then delete every older segment (none with
        `keep_segments`)."""
        old = self.segments()
        self._file.close()
        self.index += 1
        self._file = self._open(self.index)
        self.append(keep)
        for path in [] if self.keep_segments else old:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        self._file.close()


def segment_paths(directory: Path) -> list[Path]:
    """The journal segments in `directory`, oldest first."""
    return sorted(Path(directory).glob("segment-*.log"))


def read_segments(directory: Path) -> Iterator[bytes]:
    """Every complete record of every segment in `directory`, oldest first, reading one segment at a time; creates
    and writes nothing (a recorded journal may be read-only)."""
    for path in segment_paths(directory):
        data = path.read_bytes()
        at = 0
        while at + _LEN.size <= len(data):
            (n,) = _LEN.unpack_from(data, at)
            if at + _LEN.size + n > len(data):
                log.warning("journal %s: ignoring a torn record at byte %d (cut by a kill)", path.name, at)
                break
            yield data[at + _LEN.size : at + _LEN.size + n]
            at += _LEN.size + n
