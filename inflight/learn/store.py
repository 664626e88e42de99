"""The learner's rollout store: accepted rollouts held in memory until their group trains (RolloutBuffer) and
written to disk before they are acknowledged (RolloutJournal). Rank 0's intake (RolloutIntake in
inflight/learn/service.py) puts every received record in both, in that order; a step takes whole groups out of the
buffer; the journal is what a restarted learner and `--replay` read back.

## RolloutBuffer: streamed rollouts → whole groups, in arrival order, each trained at most once.

Called by the learner's rank 0. Records arrive one per sample from any number of serves; a group becomes trainable
when all `group_size` samples are in. Anything inconsistent (a duplicate rollout id, a sample whose group disagrees on
its size or prompt, a record for another model, a group id already trained, a record with no policy token) is
rejected, counted by reason and logged — never silently dropped, never trained twice, never raised into a step.
`consumed` (the groups already trained, inflight/learn/consumed.py) goes into every checkpoint so a resumed learner
refuses replays; a group leaves `completed` when it is trained.

## RolloutJournal: the write-ahead log of accepted rollouts; a killed learner loses nothing it acknowledged.

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

import collections
import logging
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

from inflight.learn.consumed import ConsumedGroups
from inflight.wire.rollouts import Rollout

log = logging.getLogger("inflight.learn")
_LEN = struct.Struct("<I")
# A serve drops such an episode's group itself (inflight/serve/driver.py); one from an older serve stops here, before a
# step, whose learner/step.py:make_batch would refuse a sample with no completion token.
NO_POLICY_TOKEN = "it has no policy token (its episode ended before the model's first turn): nothing to train"


class RolloutBuffer:
    def __init__(self, model: str | None = None, consumed: Iterable[str] | dict = (), temperature: float | None = None):
        self.temperature = temperature
        self.model = _model_name(model) if model else None
        self.pending: dict[str, dict[int, Rollout]] = {}
        self.ready: collections.deque[list[Rollout]] = collections.deque()
        self.consumed = ConsumedGroups(consumed)
        self.completed: set[str] = set()  # complete groups waiting to be trained
        self.consumed_by_server: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        self.accepted = 0

    def reject(self, reason: str, rollout: Rollout) -> None:
        self.rejected[reason] += 1
        log.error("rejected rollout %s from %s: %s", rollout.rollout_id, rollout.server_id, reason)

    def holds(self, group_id: str) -> bool:
        """True once the whole group is here (waiting or trained) or was trained before a restart."""
        return group_id in self.completed or group_id in self.consumed

    def add(self, rollout: Rollout, replay: bool = False) -> bool:
        """True if the rollout was taken; otherwise it was rejected (counted and logged), or, with `replay` (the
        learner's own journal after a restart), skipped quietly because its group was already trained or it is
        already here."""
        if replay and (self.holds(rollout.group_id) or rollout.index in self.pending.get(rollout.group_id, {})):
            return False
        if not rollout.policy_mask.any():  # an episode that ended before its first model call: nothing to train
            self.reject(NO_POLICY_TOKEN, rollout)
            return False
        if self.model is not None and _model_name(rollout.model) != self.model:
            self.reject(f"model is {rollout.model!r}, this learner trains {self.model!r}", rollout)
            return False
        if self.temperature is not None and abs(rollout.sampling.temperature - self.temperature) > 1e-6:
            why = (
                f"sampled at temperature {rollout.sampling.temperature}, this learner computes logprobs at "
                f"{self.temperature}: pass --temperature to match serve"
            )
            self.reject(why, rollout)
            return False
        if rollout.group_id in self.consumed:
            self.reject("its group was already trained (replayed after a restart?)", rollout)
            return False
        if rollout.group_id in self.completed:
            self.reject(f"duplicate sample {rollout.index} of the already complete group {rollout.group_id}", rollout)
            return False
        group = self.pending.setdefault(rollout.group_id, {})
        if rollout.index in group:
            self.reject(f"duplicate sample {rollout.index} of group {rollout.group_id}", rollout)
            return False
        if group:
            first = next(iter(group.values()))
            if (first.group_size, first.prompt_ids) != (rollout.group_size, rollout.prompt_ids):
                self.reject(f"group_size or prompt differs from the rest of group {rollout.group_id}", rollout)
                return False
        group[rollout.index] = rollout
        self.accepted += 1
        if len(group) == rollout.group_size:
            del self.pending[rollout.group_id]
            self.completed.add(rollout.group_id)
            self.ready.append([group[i] for i in range(rollout.group_size)])
        return True

    def take(self, n_groups: int) -> list[list[Rollout]] | None:
        """The `n_groups` oldest complete groups, marked consumed; None if fewer are ready."""
        if len(self.ready) < n_groups:
            return None
        groups = [self.ready.popleft() for _ in range(n_groups)]
        for group in groups:
            self.consumed.add(group[0].group_id)
            self.completed.discard(group[0].group_id)
            self.consumed_by_server[group[0].server_id] += 1
        return groups

    @property
    def pending_samples(self) -> int:
        return sum(len(g) for g in self.pending.values())


def _model_name(name_or_path: str) -> str:
    """`smollm2` and `/any/where/smollm2` name the same model (serve and learn hosts differ in paths)."""
    return name_or_path.rstrip("/").rsplit("/", 1)[-1]


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
