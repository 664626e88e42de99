"""WeightPublisher.publish_stream (inflight/learn/publisher.py): a full update streamed piece by piece, as a sharded
learner gathers it (learner/export.py:iter_full_pieces), arrives bitwise with its checksums in the trailer; the host
snapshot kept for late serves is written in place, not reallocated per publish.

Real ZeroMQ sockets and a real gloo weights group; the serve's end is test_publisher_deltas.py's ServeEnd thread.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_publisher_deltas import ServeEnd, states

from inflight.learn.publisher import StreamedUpdate, open_publisher
from inflight.wire.control import ControlServer
from inflight.wire.group import WeightsGroupError
from learner.export import Piece


def pieces(state: dict[str, torch.Tensor]):
    """`w` in three row blocks (as from two ranks), `b` whole."""
    w = state["w"]
    yield from (Piece("w", w.shape, 0, w[:20]), Piece("w", w.shape, 20, w[20:40]), Piece("w", w.shape, 40, w[40:]))
    yield Piece("b", state["b"].shape, 0, state["b"])


def test_a_streamed_update_arrives_bitwise_and_the_late_serve_snapshot_is_reused():
    by_version = states([1, 2])
    publisher = open_publisher(ControlServer(), timeout_s=20.0, quiet_after_s=0.5, bucket_bytes=4096)
    publisher.check.set_model({"w": by_version[1]["w"], "b": by_version[1]["b"]})
    serve = ServeEnd(publisher.plane.control.address)
    serve.start()
    try:
        publisher.plane.pump(2.0)
        reports = []
        for version in (1, 2):
            reports.append(publisher.publish_stream(pieces(by_version[version]), version))
            start = time.monotonic()
            while serve.answers < version and time.monotonic() - start < 10.0:
                publisher.plane.pump(0.05)
            if version == 1:
                snapshot = publisher.latest.tensors
        publisher.close()
    finally:
        serve.stop.set()
        serve.join(10.0)
    assert [r.serves for r in reports] == [1, 1] and not serve.errors
    for version in (1, 2):
        assert all(torch.equal(serve.received[version][1][n], by_version[version][n]) for n in ("w", "b"))
    assert reports[0].bytes >= 64 * 32 * 4 + 100 * 4  # every byte went through the buckets
    assert publisher.latest.version == 2 and publisher.latest.tensors is snapshot, "the snapshot is written in place"
    assert all(torch.equal(snapshot[n], by_version[2][n]) for n in ("w", "b"))


def test_a_streamed_publish_with_no_serve_still_keeps_the_version_for_the_first_serve_to_join():
    state = states([1])[1]
    publisher = open_publisher(ControlServer(), timeout_s=20.0)
    publisher.check.set_model(state)
    assert publisher.publish_stream(pieces(state), 1).serves == 0
    assert publisher.latest.version == 1 and all(torch.equal(publisher.latest.tensors[n], state[n]) for n in state)
    publisher.close()


class BreaksAfterOneBucket:
    """A StreamSender whose broadcast fails at the second piece (a serve died mid-transfer)."""

    def __init__(self):
        self.puts, self.abandoned, self.finished = 0, False, False

    def put(self, name, tensor, start=0):
        self.puts += 1
        if self.puts == 2:
            raise WeightsGroupError("broadcast of bucket 1 timed out")
        return tensor

    def abandon(self):
        self.abandoned = True

    def finish(self):
        self.finished = True


def test_a_broadcast_failing_part_way_still_takes_every_piece_so_no_rank_is_left_in_a_gather():
    """The per-rank contract of a streamed publish (inflight/learn/publisher.py): `put` never raises a broadcast
    error, so rank 0 walks the pieces to the end with the other ranks; the snapshot is complete and the error comes
    out of `finish`."""
    state = states([1])[1]
    snapshot = {n: torch.zeros_like(t) for n, t in state.items()}
    sender = BreaksAfterOneBucket()
    update = StreamedUpdate(1, 1, sender, snapshot)
    for piece in pieces(state):
        update.put(piece)
    outcome = update.finish()
    assert isinstance(outcome.error, WeightsGroupError) and outcome.stats is None
    assert sender.puts == 2 and sender.abandoned and not sender.finished, "nothing sent after the failure"
    assert all(torch.equal(snapshot[n], state[n]) for n in state), "every piece reached the snapshot"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_a_gpu_learner_streams_with_device_checksums_a_cpu_serve_verifies_and_the_snapshot_is_pinned():
    by_version = {v: {n: t.cuda() for n, t in s.items()} for v, s in states([1]).items()}
    publisher = open_publisher(ControlServer(), timeout_s=20.0, quiet_after_s=0.5, bucket_bytes=4096, device="cuda")
    publisher.check.set_model(by_version[1])
    serve = ServeEnd(publisher.plane.control.address)  # receives into host memory and checks every tensor there
    serve.start()
    try:
        publisher.plane.pump(2.0)
        report = publisher.publish_stream(pieces(by_version[1]), 1)
        start = time.monotonic()
        while serve.answers < 1 and time.monotonic() - start < 10.0:
            publisher.plane.pump(0.05)
        publisher.close()
    finally:
        serve.stop.set()
        serve.join(10.0)
    assert publisher.sums == "sum31" and report.serves == 1 and not serve.errors
    assert all(torch.equal(serve.received[1][1][n], by_version[1][n].cpu()) for n in ("w", "b"))
    snapshot = publisher.latest.tensors
    assert all(t.is_pinned() and torch.equal(t, by_version[1][n].cpu()) for n, t in snapshot.items())
