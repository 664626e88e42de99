"""JournalReplay: `--replay DIR` — the learner trains on a recorded rollout journal instead of on serves.

Why it reaches the live run's weights: the live learner journals every accepted record in arrival order
(inflight/learn/store.py), and a group becomes trainable when its last sample arrives, so the order in which groups
complete is a function of that order alone; each step takes the `groups_per_step` oldest complete groups
(inflight/learn/store.py:RolloutBuffer.take). Fed the same records in the same order, the buffer hands each step
the same groups, the gate sees the same learner version, and with the same flags and seed the same optimizer steps
follow — whatever the live run's timing was. The recording must keep every segment (`--keep-journal`): by default a
checkpoint deletes the segments of trained groups.

Called by learner rank 0's service (inflight/learn/service.py:LearnerService) in place of the rollout socket; the
service journals nothing while replaying (the recording is the journal, and `--resume` re-reads it, skipping the
groups its checkpoint says were trained).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from inflight.learn.store import RolloutBuffer, read_segments, segment_paths
from inflight.wire.rollouts import RolloutError, decode_rollout

log = logging.getLogger("inflight.learn")

# LearnConfig fields that do not change what is trained: where things are, how they are reported and published
_NOT_TRAINING = frozenset(
    {
        "host",
        "rollouts_port",
        "control_port",
        "weights_port",
        "backend",
        "device",
        "run_dir",
        "resume",
        "replay",
        "keep_journal",
        "wait_for_serves",
        "report_to",
        "log_samples_every",
        "secret_file",
        "socket_secret_file",
        "timeout_s",
        "bucket_mb",
        "full_every",
        "publish_every",
        "checkpoint_every",
        "keep_checkpoints",
        "model",
    }
)


def journal_dir(replay: str | Path) -> Path:
    """The journal a `--replay` value names: `DIR/journal` of a run directory, or DIR itself when it holds the
    segments. ValueError naming the value and the fix when neither has a segment."""
    path = Path(replay)
    for candidate in (path / "journal", path):
        if segment_paths(candidate):
            return candidate
    raise ValueError(
        f"--replay is {str(replay)!r}: no journal segment (segment-*.log) in it or in its journal/; "
        "pass the --run-dir of a run recorded with --keep-journal"
    )


def check_replay(replay: str, run_dir: str) -> None:
    """Refuse a `--replay` that names no journal, or the learner's own `--run-dir` (its checkpoints and metrics would
    mix with the recording's, and the learner would train on its own journal)."""
    journal = journal_dir(replay).resolve()
    own = Path(run_dir).resolve()
    if journal in (own, own / "journal"):
        raise ValueError(
            f"--replay is {replay!r}, the journal of --run-dir {run_dir!r} itself: give the replay its own --run-dir"
        )


class JournalReplay:
    """The records of a recorded journal, fed to a RolloutBuffer oldest first as the training loop needs them, so
    memory holds about one step's groups, not the whole recording. Rank 0 only."""

    def __init__(self, replay: str | Path):
        self.dir = journal_dir(replay)
        self._records = read_segments(self.dir)
        self.done = False  # every record has been read
        self.read = 0
        first = segment_paths(self.dir)[0]
        if first.name != "segment-000000.log":
            log.warning(
                "--replay %s starts at %s: the segments before it were deleted at checkpoints (recorded "
                "without --keep-journal), so the groups trained before them are not replayed",
                self.dir,
                first.name,
            )

    def fill(self, buffer: RolloutBuffer, groups: int) -> None:
        """Add records to `buffer` until `groups` complete groups are ready or the journal is exhausted (`done`).
        Repeats of a record (copied into a new segment at a checkpoint) and records of groups a resumed checkpoint
        trained are skipped quietly (`RolloutBuffer.add(replay=True)`)."""
        while len(buffer.ready) < groups and not self.done:
            record = next(self._records, None)
            if record is None:
                self.done = True
                log.info("--replay %s: all %d records read", self.dir, self.read)
                return
            self.read += 1
            try:
                rollout = decode_rollout(record)
            except RolloutError as exc:  # a journal is our own fsynced file: only a bug or a disk fault gets here
                log.error("--replay %s: skipping an unreadable record: %s", self.dir, exc)
                continue
            buffer.add(rollout, replay=True)

    def recorded_differences(self, settings: dict) -> list[str]:
        """The training settings in which `settings` (this learner's resolved config) differs from the recording's
        `learn-config.json`, as 'name recorded -> now'; [] when there is none or nothing to compare with."""
        path = self.dir.parent / "learn-config.json"
        if not path.exists():
            return []
        recorded = json.loads(path.read_text())
        return [
            f"{name} {recorded[name]!r} -> {value!r}"
            for name, value in settings.items()
            if name not in _NOT_TRAINING and name in recorded and recorded[name] != value
        ]
