"""WeightPublisher.publish_stream (inflight/learn/publisher.py): a full update streamed piece by piece, as a sharded
learner gathers it (learner/export.py:iter_full_pieces), arrives bitwise with its checksums in the trailer; nothing of
it is kept on rank 0 (no copy of the model for late serves): a serve that joins later is due a stream of the weights
again (`catch_up` calls on every learner rank to stream), which reaches it bitwise. With deltas on, the same pieces
are assembled in host memory in the serves' dtype (`assemble_state`), and the deltas planned from there arrive bitwise.

Real ZeroMQ sockets and a real gloo weights group; the serve's end is test_publisher_deltas.py's ServeEnd thread.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_publisher_deltas import ServeEnd, states

from inflight.learn.publisher import StreamedUpdate, assemble_state, open_publisher
from inflight.wire.control import ControlServer
from inflight.wire.group import WeightsGroupError
from learner.export import Piece

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


def pieces(state: dict[str, torch.Tensor]):
    """`w` in three row blocks (as from two ranks), `b` whole."""
    w = state["w"]
    yield from (Piece("w", w.shape, 0, w[:20]), Piece("w", w.shape, 20, w[20:40]), Piece("w", w.shape, 40, w[40:]))
    yield Piece("b", state["b"].shape, 0, state["b"])


def wait_for(publisher, until, timeout_s: float = 10.0) -> None:
    start = time.monotonic()
    while not until() and time.monotonic() - start < timeout_s:
        publisher.plane.pump(0.05)


def test_a_streamed_update_arrives_bitwise_keeps_no_copy_and_a_serve_joining_later_is_streamed_the_weights():
    by_version = states([1, 2])
    publisher = open_publisher(ControlServer(), timeout_s=20.0, quiet_after_s=0.5, bucket_bytes=4096)
    publisher.check.set_model({n: torch.empty_like(t, device="meta") for n, t in by_version[1].items()})  # a layout
    first = ServeEnd(publisher.plane.control.address)
    first.start()
    late = None
    try:
        publisher.plane.pump(2.0)
        reports = []
        for version in (1, 2):
            reports.append(publisher.publish_stream(pieces(by_version[version]), version))
            wait_for(publisher, lambda v=version: first.answers >= v)
        assert publisher.latest.version == 2 and publisher.latest.tensors == {}, "rank 0 kept no copy of the model"

        def stream():  # what every learner rank does when asked: stream its current weights (RankSender.catch_up)
            reports.append(publisher.publish_stream(pieces(by_version[2]), 2))

        publisher.catch_up(stream)
        assert len(reports) == 2, "every serve is in the group: nothing to catch up"
        late = ServeEnd(publisher.plane.control.address, server_id="serve@late")
        late.start()
        wait_for(publisher, lambda: len(publisher.plane.serves) == 2)
        publisher.catch_up(stream)
        wait_for(publisher, lambda: late.answers >= 1)
        publisher.catch_up(stream)
        publisher.close()
    finally:
        for serve in (first, late):
            if serve is not None:
                serve.stop.set()
                serve.join(10.0)
    assert [r.serves for r in reports] == [1, 1, 2] and not first.errors and not late.errors
    for version in (1, 2):
        assert all(torch.equal(first.received[version][1][n], by_version[version][n]) for n in ("w", "b"))
    assert all(torch.equal(late.received[2][1][n], by_version[2][n]) for n in ("w", "b"))
    assert reports[0].bytes >= 64 * 32 * 4 + 100 * 4  # every byte went through the buckets


def test_a_streamed_publish_with_no_serve_keeps_only_the_version_and_the_first_serve_to_join_is_due_a_stream():
    state = states([1])[1]
    publisher = open_publisher(ControlServer(), timeout_s=20.0, quiet_after_s=0.5)
    publisher.check.set_model(state)
    assert publisher.publish_stream(pieces(state), 1).serves == 0
    assert publisher.latest.version == 1 and publisher.latest.tensors == {}
    streams = []
    publisher.catch_up(lambda: streams.append(1))
    serve = ServeEnd(publisher.plane.control.address)
    serve.start()
    try:
        wait_for(publisher, lambda: len(publisher.plane.serves) == 1)
        publisher.catch_up(lambda: streams.append(2))
        assert streams == [2], "the first serve to join is due a stream of version 1"
    finally:
        serve.stop.set()
        serve.join(10.0)
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
    error, so rank 0 walks the pieces to the end with the other ranks; the error comes out of `finish`."""
    state = states([1])[1]
    sender = BreaksAfterOneBucket()
    update = StreamedUpdate(1, 1, sender)
    taken = [piece.name for piece in pieces(state) if update.put(piece) is None]
    outcome = update.finish()
    assert taken == ["w", "w", "w", "b"], "every piece was taken"
    assert isinstance(outcome.error, WeightsGroupError) and outcome.stats is None
    assert sender.puts == 2 and sender.abandoned and not sender.finished, "nothing sent after the failure"


@CUDA
def test_a_gpu_learner_streams_with_device_checksums_and_a_cpu_serve_verifies_them():
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


def test_assembled_pieces_land_at_their_rows_in_the_serves_dtype_or_their_own():
    gen = torch.Generator().manual_seed(3)
    w, b, step = (
        torch.randn(64, 32, generator=gen, dtype=torch.float64),
        torch.randn(100, generator=gen),
        torch.tensor(7),
    )
    rows = [Piece("w", w.shape, 0, w[:20]), Piece("w", w.shape, 20, w[20:40]), Piece("w", w.shape, 40, w[40:])]
    state = assemble_state([*rows, Piece("b", b.shape, 0, b), Piece("step", step.shape, 0, step)], {"w": torch.float32})
    assert state["w"].dtype == torch.float32 and torch.equal(state["w"], w.float())
    assert state["b"].dtype == torch.float32 and torch.equal(state["b"], b)  # no dtype given: the piece's own
    assert state["step"].shape == () and int(state["step"]) == 7
    assert all(t.device.type == "cpu" for t in state.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_deltas_planned_from_a_state_assembled_in_host_memory_arrive_bitwise_and_the_base_stays_there(device):
    """RankSender.publish with --full-every 2: rank 0 assembles each version from a learner's float64 pieces (on the
    learner's `device`) in the serves' float32, in host memory; the publisher (its weights device `device`) encodes and
    sums one tensor at a time there and keeps the base in host memory."""
    by_version = states([1, 2, 3])
    publisher = open_publisher(ControlServer(), timeout_s=20.0, quiet_after_s=0.5, bucket_bytes=4096, full_every=2,
                               device=device)  # fmt: skip
    publisher.check.set_model(by_version[1])
    serve = ServeEnd(publisher.plane.control.address)
    serve.start()
    try:
        publisher.plane.pump(2.0)
        reports = []
        for version in (1, 2, 3):
            learner = {n: t.to(device, torch.float64) for n, t in by_version[version].items()}
            state = assemble_state(pieces(learner), publisher.served_dtypes())
            assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in state.values())
            reports.append(publisher.publish(state, version))
            wait_for(publisher, lambda v=version: serve.answers >= v)
        assert all(t.device.type == "cpu" for t in publisher.deltas.tensors.values()), "the base stays in host memory"
        publisher.close()
    finally:
        serve.stop.set()
        serve.join(10.0)
    assert [r.delta for r in reports] == [False, True, False] and not serve.errors
    assert reports[1].bytes < reports[0].bytes / 4
    for version in (1, 2, 3):
        assert all(torch.equal(serve.received[version][1][n], by_version[version][n]) for n in ("w", "b"))
