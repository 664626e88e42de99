"""Both ends of the two ZeroMQ protocols: the learner's sockets (synchronous; the training loop is not asyncio) and
the serve's (asyncio; `connect_rollout_push`, `connect_control_dealer`).

- `RolloutStream`: the serve's PUSH, with its outbox and the records it keeps until the learner acknowledges them.
- `RolloutReceiver`: binds PULL; every serve's PUSH connects. `receive()` returns decoded, validated `Rollout`s; a bad
  message is counted in `rejected` (by reason) and logged, never raised into the training loop.
- `ControlServer`: binds ROUTER; every serve's DEALER connects. Messages are addressed by the serve's ZeroMQ identity,
  learned from its `Hello`.

Both bind 127.0.0.1 unless told otherwise; port 0 picks a free port (read it back from `.address`). The serve's ends
connect out (nothing needs to reach a serve); with `keys` (inflight.wire.secure.CurveKeys from --secret-file) every
socket on both sides speaks CURVE.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import zmq
import zmq.asyncio

from inflight.wire.control import ControlError, decode_control, encode_control
from inflight.wire.rollouts import Rollout, RolloutError, decode_rollout
from inflight.wire.secure import CurveKeys, secure_client, secure_server

log = logging.getLogger("inflight.wire")


def _bind(sock, host: str, port: int) -> str:

    sock.bind(f"tcp://{host}:{port or '*'}")
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


class RolloutReceiver:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        hwm: int = 64,
        ctx: zmq.Context | None = None,
        keys: CurveKeys | None = None,
    ):

        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        if keys is not None:  # inflight.wire.secure.CurveKeys: only serves with the same secret get through
            secure_server(self._sock, keys)
        self._sock.setsockopt(zmq.RCVHWM, hwm)  # bounds what piles up here when training is slow
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address = _bind(self._sock, host, port)
        self.received = 0
        self.rejected: collections.Counter[str] = collections.Counter()

    def receive(self, timeout_s: float | None = None, max_items: int = 1 << 30) -> list[Rollout]:
        """Everything that arrives within `timeout_s` (at least one record unless it times out), up to `max_items`."""
        return [rollout for rollout, _ in self.receive_raw(timeout_s, max_items)]

    def receive_raw(self, timeout_s: float | None = None, max_items: int = 1 << 30) -> list[tuple[Rollout, bytes]]:
        """Like `receive`, each valid rollout with the exact bytes it arrived as (what the learner journals)."""

        out: list[tuple[Rollout, bytes]] = []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(out) < max_items:
            wait_ms = 0 if out else (-1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000)))
            if not self._sock.poll(wait_ms, zmq.POLLIN):
                break
            data = self._sock.recv(copy=True)
            try:
                out.append((decode_rollout(data), data))
                self.received += 1
            except RolloutError as exc:
                reason = str(exc).split(":")[0][:80]
                self.rejected[reason] += 1
                log.error("rejected rollout #%d (%d bytes): %s", sum(self.rejected.values()), len(data), exc)
        return out

    def close(self) -> None:
        self._sock.close(linger=0)


class RolloutStream:
    """The serve's end of the rollouts: finished rollouts leave through one PUSH socket connected to the learner's PULL
    (`RolloutReceiver`).

    No finished rollout is ever dropped: ZeroMQ PUSH never drops on a live connection, it blocks when the peer's queue
    is full (high-water mark). Rather than block the event loop, finished records wait in `outbox`, which the driver
    counts as outstanding work and stops admitting prompts when it is full — so a learner that stops reading stops
    generation after at most `max_outstanding` rollouts, and every one of them is delivered, once, when it reads again.

    A sent record is not forgotten either: it stays in `retained` (by group) until the learner acknowledges its group
    (`Progress.acked`: the learner has fsynced it to its journal). A learner killed with records in its socket queue or
    in memory loses nothing it acknowledged, and when the restarted learner asks this serve to introduce itself,
    `resend()` puts every unacknowledged record back into the outbox. Retained records count as outstanding work too, so
    memory stays bounded while the learner is away.
    """

    def __init__(self, address: str, hwm: int = 4, keys: CurveKeys | None = None):
        self.address = address
        self._ctx, self._sock = connect_rollout_push(address, hwm, keys)
        self.outbox: collections.deque[tuple[bytes, str]] = collections.deque()  # (record, group id)
        self.retained: dict[str, list[bytes]] = {}  # group id -> sent records not yet acknowledged
        self.retained_records = 0
        self.resent = 0
        self.sent = 0
        self.bytes_sent = 0
        self._wake = asyncio.Event()
        self.drained = asyncio.Event()  # set whenever the outbox becomes empty
        self.drained.set()

    def offer(self, record: bytes, group_id: str) -> None:
        self.outbox.append((record, group_id))
        self.drained.clear()
        self._wake.set()

    def ack(self, group_ids) -> None:
        """The learner holds these groups durably: forget their records."""
        for group_id in group_ids:
            self.retained_records -= len(self.retained.pop(group_id, ()))

    def resend(self) -> int:
        """Queue every unacknowledged record again (a restarted learner lost what it had not acknowledged)."""
        records = [(r, g) for g, rs in self.retained.items() for r in rs]
        self.retained.clear()
        self.retained_records = 0
        self.outbox.extendleft(reversed(records))
        self.resent += len(records)
        if records:
            self.drained.clear()
            self._wake.set()
        return len(records)

    async def pump(self, on_sent=None) -> None:
        """Send outbox records in order, forever; a full peer queue suspends this coroutine, nothing else."""
        while True:
            if not self.outbox:
                self.drained.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            record, group_id = self.outbox[0]
            await self._sock.send(record, copy=False)
            self.outbox.popleft()
            self.retained.setdefault(group_id, []).append(record)
            self.retained_records += 1
            self.sent += 1
            self.bytes_sent += len(record)
            if on_sent is not None:
                on_sent()

    def close(self, linger_s: float = 5.0) -> None:
        self._sock.close(linger=int(linger_s * 1000))
        self._ctx.term()


class ControlServer:
    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, ctx: zmq.Context | None = None, keys: CurveKeys | None = None
    ):

        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        if keys is not None:
            secure_server(self._sock, keys)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished serve raises instead of vanishing
        self.address = _bind(self._sock, host, port)
        self.rejected = 0

    def poll(self, timeout_s: float = 0.0) -> list[tuple[bytes, object]]:
        """(identity, message) for every valid message waiting (waits up to `timeout_s` for the first)."""

        out = []
        wait_ms = int(timeout_s * 1000)
        while self._sock.poll(wait_ms if not out else 0, zmq.POLLIN):
            identity, data = self._sock.recv_multipart()
            try:
                out.append((identity, decode_control(data, to="learner")))
            except ControlError as exc:
                self.rejected += 1
                log.error("rejected control message from %r: %s", identity, exc)
        return out

    def send(self, identity: bytes, message) -> bool:
        """Send to one serve; False if that serve is not connected (it died or has not said Hello)."""

        try:
            self._sock.send_multipart([identity, encode_control(message)])
            return True
        except zmq.ZMQError as exc:
            log.error("control message %s to %r not delivered: %s", type(message).__name__, identity, exc)
            return False

    def send_raw(self, identity: bytes, data: bytes) -> None:
        """Bytes as they are (fault-injection tests send malformed messages with this)."""
        self._sock.send_multipart([identity, data])

    def close(self) -> None:
        self._sock.close(linger=0)


def _connect_async(address: str, kind: int, keys, options: dict[int, int]):
    """(asyncio context, socket of `kind` connected to `address`) with `options` set before connecting."""

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(kind)
    for option, value in options.items():
        sock.setsockopt(option, value)
    if keys is not None:
        secure_client(sock, keys)
    sock.connect(address)
    return ctx, sock


def connect_rollout_push(address: str, hwm: int = 4, keys=None):
    """The serve's end of the rollout channel: (context, asyncio PUSH) to the learner's `RolloutReceiver`.

    A small send high-water mark keeps records in the serve's own outbox (counted, retained until acknowledged)
    rather than in ZeroMQ's queue; a 10-s linger lets a stopping serve deliver what it already handed over."""

    return _connect_async(address, zmq.PUSH, keys, {zmq.SNDHWM: hwm, zmq.LINGER: 10_000})


def connect_control_dealer(address: str, keys=None):
    """The serve's end of the control channel: (context, asyncio DEALER) to the learner's `ControlServer` ROUTER,
    which addresses replies by this socket's identity (learned from the serve's `Hello`)."""

    return _connect_async(address, zmq.DEALER, keys, {zmq.LINGER: 1000})
