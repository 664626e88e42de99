"""LearnerService: learner rank 0's network side — rollouts in, the control plane, weights out, the metrics file.

The training loop (inflight/learn/app.py:Learner.run) sees a few calls: `next_groups` (block until a step's groups are
here), `publish` / `publish_stream` (send a version to every serve), `write_step` (one metrics line),
`consumed_state` and `rotate_journal` (for a checkpoint); `close` at the end. Everything else happens inside
`next_groups`, the one loop rank 0 waits in (docs/ARCHITECTURE.md "Learner control plane"): rollouts are received,
journaled and acknowledged (`RolloutIntake`, below), control messages are served
(inflight/learn/control.py:ControlPlane.pump), late joiners are caught up, `Progress` goes out. With `--replay` the
rollouts come from a recorded journal; the control socket and the publisher work as in a live run.

`RolloutIntake` is the rollouts' way in. Live: `receive` takes what arrived on the rollout socket
(inflight/wire/rollouts.py:RolloutReceiver), adds it to the buffer (inflight/learn/store.py:RolloutBuffer, which
refuses duplicates and strangers), writes the accepted records to the journal with fsync
(inflight/learn/store.py:RolloutJournal) and only then queues the acknowledgements that `Progress` carries. With
`--replay` the records come from a recorded journal (inflight/learn/replay.py:JournalReplay): no socket, no journal of
its own, nothing to acknowledge.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from inflight.learn.config import LearnConfig
from inflight.learn.publisher import WeightPublisher, open_publisher
from inflight.learn.replay import JournalReplay
from inflight.learn.samples import GatedBatch, build_samples
from inflight.learn.store import RolloutBuffer, RolloutJournal
from inflight.wire.control import ControlServer
from inflight.wire.records import StepMetrics, encode_line, to_record
from inflight.wire.rollouts import Rollout, RolloutError, RolloutReceiver, decode_rollout
from inflight.wire.secure import CurveKeys, derive_keys, weights_key
from inflight.wire.weights import AdapterSpec

log = logging.getLogger("inflight.learn")
PROGRESS_EVERY_S = 1.0  # Progress while waiting, even with nothing to acknowledge: a joining serve waits for it


class RolloutIntake:
    """The rollout socket (or the replayed recording), the buffer of groups not trained yet, the journal of their
    records and the acknowledgements owed. `consumed`/`by_server` come from the checkpoint; `keys` are the CURVE
    keys of --secret-file (inflight/wire/secure.py:derive_keys) or None."""

    def __init__(
        self, cfg: LearnConfig, consumed: Iterable[str] | dict, by_server: dict[str, int], keys: CurveKeys | None = None
    ):
        self.cfg, self.run_dir = cfg, Path(cfg.run_dir)
        self.replay = JournalReplay(cfg.replay) if cfg.replay else None
        self.receiver = None if self.replay else RolloutReceiver(cfg.host, cfg.rollouts_port, keys=keys)
        self.buffer = RolloutBuffer(cfg.model, consumed, cfg.temperature)
        self.buffer.consumed_by_server.update(by_server)
        self.raw: dict[str, bytes] = {}  # rollout id -> record, for records of groups not trained yet
        self.acks: dict[str, set[str]] = collections.defaultdict(set)  # server id -> group ids to acknowledge
        self.journal = None if self.replay else self._open_journal()

    @property
    def source(self) -> str:
        """Where rollouts come from, in words (the ready line)."""
        return f"replaying {self.replay.dir}" if self.replay else f"rollouts {self.receiver.address}"

    def _open_journal(self) -> RolloutJournal:
        """The write-ahead log of accepted rollouts (inflight/learn/store.py): replayed on --resume, else emptied."""
        directory = self.run_dir / "journal"
        if not self.cfg.resume and directory.exists():
            shutil.rmtree(directory)
        journal = RolloutJournal(directory, keep_segments=self.cfg.keep_journal)
        replayed = 0
        for record in journal.replay():
            try:
                rollout = decode_rollout(record)
            except RolloutError as exc:  # our own fsynced file: only a bug or a disk fault gets here
                log.error("journal: skipping an unreadable record: %s", exc)
                continue
            if self.buffer.add(rollout, replay=True):
                self.raw[rollout.rollout_id] = record
                replayed += 1
        if replayed:
            ready = len(self.buffer.ready)
            log.info("journal: replayed %d rollouts of untrained groups (%d groups complete)", replayed, ready)
        return journal

    def receive(self, timeout_s: float) -> None:
        """Take what arrived (blocking up to `timeout_s`), journal the accepted records (fsync), then queue the
        acknowledgements of held groups."""
        received = self.receiver.receive_raw(timeout_s=timeout_s)
        fresh = []
        for rollout, record in received:
            if self.buffer.add(rollout):
                self.raw[rollout.rollout_id] = record
                fresh.append(record)
        self.journal.append(fresh)
        for rollout, _ in received:  # a re-sent group the learner already holds is acknowledged again
            if self.buffer.holds(rollout.group_id):
                self.acks[rollout.server_id].add(rollout.group_id)

    def take(self, groups: int) -> list[list[Rollout]] | None:
        """The `groups` oldest complete groups, marked consumed (their records leave the journal's next rotation);
        None while fewer are here."""
        taken = self.buffer.take(groups)
        for group in taken or []:
            for rollout in group:
                self.raw.pop(rollout.rollout_id, None)
        return taken

    def rejected(self) -> dict[str, int]:
        """Rollouts refused so far by reason: the buffer's, and the receiver's prefixed `wire:`."""
        wire = self.receiver.rejected if self.receiver is not None else {}
        return dict(self.buffer.rejected) | {"wire:" + k: v for k, v in wire.items()}

    def consumed_state(self) -> dict:
        """What a checkpoint must hold so a resumed learner trains no group twice: `consumed` (inflight/learn/
        consumed.py, JSON) and `consumed_by_server` (server id -> groups trained, for the serves' admission gates)."""
        return {"consumed": self.buffer.consumed.to_json(), "consumed_by_server": dict(self.buffer.consumed_by_server)}

    def rotate_journal(self) -> None:
        """After a checkpoint (which holds the trained groups): the journal keeps only the untrained groups' records
        (a replay has no journal of its own: its recording is never touched)."""
        if self.journal is not None:
            self.journal.rotate(self.raw.values())

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self.journal is not None:
            self.journal.close()


def _shape_only(state: dict[str, torch.Tensor]) -> bool:
    """A layout (learner/export.py:hf_layout), not weights: nothing to send a late serve from."""
    return any(t.is_meta for t in state.values())


class LearnerService:
    """Binds the rollout and control sockets and the weights store on `cfg.host` (ready when this returns, which it
    prints as `inflight.learn ready: ...`), and opens the journal: replayed on `--resume`, else emptied. `state` is
    the learner's full weights (what serves must serve, and what a serve joining a resumed learner at `version` > 0
    gets) or, for a learner that streams its updates, their layout alone (meta tensors: such a serve is streamed the
    weights); `consumed`/`by_server` come from the checkpoint; `weights_device` is where published tensors must be for
    the weights group's backend (`learner/world.py:World.weights_device`). Rank 0 only; not thread-safe."""

    def __init__(
        self,
        cfg: LearnConfig,
        state: dict[str, torch.Tensor],
        version: int,
        consumed: Iterable[str] | dict,
        by_server: dict[str, int],
        weights_device: torch.device | str = "cpu",
        adapter: AdapterSpec | None = None,
    ):
        self.cfg, self.run_dir = cfg, Path(cfg.run_dir)
        socket_secret, tag_secret = cfg.secrets()
        keys = derive_keys(socket_secret) if socket_secret is not None else None
        self.intake = RolloutIntake(cfg, consumed, by_server, keys)
        self.control = ControlServer(cfg.host, cfg.control_port, keys=keys)
        self.publisher: WeightPublisher = open_publisher(
            self.control,
            cfg.host,
            cfg.weights_port,
            cfg.backend,
            cfg.timeout_s,
            device=weights_device,
            bucket_bytes=cfg.bucket_mb << 20,
            weights_key=weights_key(tag_secret) if tag_secret is not None else None,
            full_every=cfg.full_every,
            adapter=adapter,
            consumed=self.intake.buffer.consumed_by_server,  # a live view: each update says what each serve had trained
        )
        self.plane = self.publisher.plane
        self.publisher.check.set_model(state, cfg.contract())  # serves that differ are refused at Hello
        if version > 0:  # serves start from the base checkpoint: they get the resumed weights when they join
            self.publisher.latest.keep(version, {} if _shape_only(state) else state)
        self.stepped = False  # whether next_groups returned groups yet (--wait-for-serves holds only the first step)
        self.metrics_file = (self.run_dir / "metrics.jsonl").open("a")
        self._announce()

    def _announce(self) -> None:
        """Log and print the ready line (`inflight.learn ready: ...`) launchers and tests wait for."""
        source, store_port = self.intake.source, self.plane.rendezvous.store_port
        log.info(
            "learner listening: %s, control %s, weights store port %d; sockets: %s",
            source,
            self.control.address,
            store_port,
            sockets_said(self.cfg),
        )
        print(
            f"inflight.learn ready: {source} control {self.control.address} weights {self.cfg.host}:{store_port}",
            file=sys.stderr,
            flush=True,
        )
        if self.intake.replay is not None:
            differences = self.intake.replay.recorded_differences(dataclasses.asdict(self.cfg))
            for difference in differences:  # a replay reaches the recorded weights only under the recorded settings
                log.warning("--replay: %s differs from the recording", difference)

    # -- the wait for a step's groups -----------------------------------------------------------------------------
    def next_groups(self, version: int, stop: Callable[[], bool], catch_up: Callable) -> GatedBatch | None:
        """Block until `groups_per_step` complete groups are here; mark them consumed, acknowledge and return them as
        samples gated at the learner's `version` (inflight/learn/samples.py:build_samples). None once `stop()` is
        true, or once a replayed journal has no step's worth of groups left. Until the first groups are returned, also
        wait for `--wait-for-serves` serves to have said Hello; a serve joining meanwhile is caught up (`catch_up`)."""
        last_progress = 0.0
        while not stop():
            if not self._collect():
                return None  # the replayed recording is used up: the run ends as at --steps
            self.plane.pump(0)
            self.publisher.catch_up(catch_up)
            groups = None if self._waiting_for_serves() else self.intake.take(self.cfg.groups_per_step)
            if groups is not None:
                self.stepped = True
                self._send_progress(version)
                return build_samples(groups, version, self.cfg.max_lag, self.cfg.advantage, self.cfg.max_kv_lag)
            if any(self.intake.acks.values()) or time.monotonic() - last_progress > PROGRESS_EVERY_S:
                self._send_progress(version)
                last_progress = time.monotonic()
        return None

    def _waiting_for_serves(self) -> bool:
        """Before the first step: fewer than `--wait-for-serves` serves have said Hello."""
        return not self.stepped and len(self.plane.serves) < self.cfg.serves_to_wait_for()

    def _collect(self) -> bool:
        """Rollouts in: from the socket (journaled, then acknowledged), or from the replayed recording. False once a
        replay has no step's worth of groups left (and no serve is awaited)."""
        replay, groups = self.intake.replay, self.cfg.groups_per_step
        if replay is None:
            self.intake.receive(timeout_s=0.05)  # blocks up to 50 ms on the socket
            return True
        replay.fill(self.intake.buffer, groups)
        if self._waiting_for_serves():
            self.plane.pump(0.05)  # a replay has no socket to block on: wait on the control socket instead
            return True
        return not replay.done or len(self.intake.buffer.ready) >= groups

    def _send_progress(self, version: int) -> None:
        """Progress to every serve, with the acknowledgements queued since the last one (all journaled by now)."""
        published = self.publisher.latest.published
        self.plane.send_progress(self._consumed_by_server(), version, published, self.intake.acks)

    def _consumed_by_server(self) -> dict[str, int]:
        return dict(self.intake.buffer.consumed_by_server)

    # -- records, checkpoints --------------------------------------------------------------------------------------
    def write_step(self, values: dict) -> StepMetrics:
        """Append one StepMetrics line (inflight/wire/records.py) to `<run_dir>/metrics.jsonl`: `values` plus the
        rollouts refused so far (`rejected`). A value StepMetrics does not know raises RecordError naming it."""
        record = to_record({**values, "rejected": self.intake.rejected()}, StepMetrics)
        self.metrics_file.write(encode_line(record))
        self.metrics_file.flush()
        return record

    def consumed_state(self) -> dict:
        """What a checkpoint must hold so a resumed learner trains no group twice (RolloutIntake.consumed_state)."""
        return self.intake.consumed_state()

    def rotate_journal(self) -> None:
        """After a checkpoint: the journal keeps only the untrained groups' records (RolloutIntake.rotate_journal)."""
        self.intake.rotate_journal()

    def close(self) -> None:
        """Let the serves commit the last update, close the weights group and the sockets, then the files."""
        self.publisher.close()
        self.control.close()
        self.metrics_file.close()
        self.intake.close()


def sockets_said(cfg: LearnConfig) -> str:
    """How the rollout and control sockets are protected, for the listening line."""
    if cfg.secret_file:
        return "CURVE, and keyed tags on every weight update (--secret-file)"
    if cfg.socket_secret_file:
        return "CURVE (--socket-secret-file; weight updates carry checksums, not keyed tags)"
    return "plain TCP, no secret"
