"""When WeightPublisher sends a delta and when a full update (inflight/learn/publisher.py, --full-every).

Real ZeroMQ sockets and a real gloo weights group; the serve's end is a thread speaking the control protocol that
applies each update to the tensors it holds, as the engine's worker does (the engine itself: test_delta_updates.py).
"""

from __future__ import annotations

import threading
import time

import torch
import zmq

from inflight.learn.publisher import open_publisher
from inflight.wire.control import (
    ControlServer,
    Hello,
    Joined,
    JoinGroup,
    TensorSpec,
    UpdateDone,
    UpdateWeights,
    decode_control,
)
from inflight.wire.control import encode_control as encode
from inflight.wire.group import GroupAddress, WeightsGroup
from inflight.wire.transfer import receive_update
from inflight.wire.weights import ManifestError, UpdateManifest, unpack_buckets

SERVER = "serve@00c0ffee"


def states(versions: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """One state per version, each changing a few elements of the previous one."""
    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(100, generator=gen)}
    out = {}
    for v in versions:
        state = {n: t.clone() for n, t in state.items()}
        state["w"].view(-1)[torch.randperm(2048, generator=gen)[:20]] += 1.0
        out[v] = state
    return out


class ServeEnd(threading.Thread):
    """A serve's control + weights side: joins the group, applies every update to what it holds, answers UpdateDone
    (ok=False for the versions in `fail`: a failed commit, after which it keeps its previous version and, as the real
    serve does, reports that version)."""

    def __init__(self, address: str, fail: frozenset[int] = frozenset(), server_id: str = SERVER):
        super().__init__(daemon=True)
        self.server_id = server_id
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.fail, self.held, self.received, self.errors, self.stop = fail, None, {}, [], threading.Event()
        self.answers = 0
        specs = [TensorSpec("w", "float32", [64, 32]), TensorSpec("b", "float32", [100])]
        self.sock.send(encode(Hello(server_id=server_id, model="m", workers=1, version=0, tensors=specs)))

    def run(self) -> None:
        group = None
        while not self.stop.is_set():
            if not self.sock.poll(100):
                continue
            message = decode_control(self.sock.recv(), to="serve")
            if isinstance(message, JoinGroup):
                address = GroupAddress(message.host, message.port, message.world_size, message.group_name,
                                       message.backend, message.timeout_s)  # fmt: skip
                group = WeightsGroup(address, message.rank)
                self.sock.send(encode(Joined(server_id=self.server_id, group_name=message.group_name)))
            elif isinstance(message, UpdateWeights):
                self._update(UpdateManifest.decode(message.manifest), group)
        if group is not None:
            group.close()

    def _update(self, manifest: UpdateManifest, group: WeightsGroup) -> None:
        buckets = receive_update(group, manifest)
        try:
            tensors = {n: t.clone() for n, t in unpack_buckets(manifest, buckets, base=self.held).items()}
        except ManifestError as exc:
            self.errors.append(str(exc))
            tensors = None
        self.received[manifest.version] = (manifest.is_delta, tensors)
        if tensors is not None and manifest.version not in self.fail:
            self.held = (manifest.version, tensors)
            self.sock.send(encode(UpdateDone(server_id=self.server_id, version=manifest.version)))
        else:
            held = self.held[0] if self.held is not None else 0
            self.sock.send(encode(UpdateDone(server_id=self.server_id, version=held, ok=False, error="failed")))
        self.answers += 1


def run_publishes(full_every: int, versions: list[int], fail: frozenset[int] = frozenset()):
    publisher = open_publisher(ControlServer(), timeout_s=20.0, quiet_after_s=0.5, full_every=full_every)
    by_version = states(versions)
    publisher.check.set_model(by_version[versions[0]])
    serve = ServeEnd(publisher.plane.control.address, fail)
    serve.start()
    publisher.plane.pump(2.0)
    reports, seconds = [], []
    try:
        for v in versions:
            record = next(iter(publisher.plane.serves.values()))
            before, start = record.last_update, time.monotonic()
            reports.append(publisher.publish(by_version[v], v))
            seconds.append(time.monotonic() - start)
            # Until the publisher itself holds the answer (the serve having sent it is not enough: ZeroMQ may still be
            # carrying it, and the next publish would decide on the previous answer); a learner's step is longer.
            while record.last_update is before and time.monotonic() - start < 10.0:
                publisher.plane.pump(0.05)
        publisher.close()  # waits for the last commit
    finally:
        serve.stop.set()
        serve.join(10.0)
    return reports, seconds, serve, by_version


def test_deltas_between_full_updates_every_full_every_versions_even_when_versions_skip():
    """--publish-every 2: versions 2, 4, 6, ... A full update every 3 versions: v2 full, v4 delta on v2, v6 full
    (6 - 2 >= 3), v8 delta. The serve ends with every version bitwise, and no publish waited for a version that was
    never sent (the publisher waited for `version - 1` before: a timeout per publish with --publish-every > 1)."""
    reports, seconds, serve, sent = run_publishes(3, [2, 4, 6, 8])
    assert [r.delta for r in reports] == [False, True, False, True]
    assert [serve.received[v][0] for v in (2, 4, 6, 8)] == [False, True, False, True]
    assert all(torch.equal(serve.received[v][1][n], sent[v][n]) for v in sent for n in ("w", "b"))
    assert reports[1].bytes < 0.2 * reports[0].bytes, [r.bytes for r in reports]
    assert max(seconds) < 10.0, f"a publish waited for a commit that could not come: {seconds}"
    assert not serve.errors


def test_after_a_serve_reports_a_failed_commit_the_next_update_is_full():
    reports, _, serve, sent = run_publishes(100, [1, 2, 3, 4], fail=frozenset({2}))
    assert [r.delta for r in reports] == [False, True, False, True]  # v3 full: the serve still holds v1, not v2
    assert torch.equal(serve.held[1]["w"], sent[4]["w"]) and serve.held[0] == 4
    assert not serve.errors


def test_full_every_one_sends_every_update_in_full_and_asks_the_serve_to_keep_nothing():
    reports, _, serve, _ = run_publishes(1, [1, 2, 3])
    assert [r.delta for r in reports] == [False, False, False]
    assert not serve.errors
