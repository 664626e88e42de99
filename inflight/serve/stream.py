"""The rollout stream: finished rollouts leave serve through one ZeroMQ PUSH socket connected to the learner's PULL.

No finished rollout is ever dropped: ZeroMQ PUSH never drops on a live connection, it blocks when the peer's queue is
full (high-water mark). Rather than block the event loop, finished records wait in `outbox`, which the driver counts as
outstanding work and stops admitting prompts when it is full — so a learner that stops reading stops generation after
at most `max_outstanding` rollouts, and every one of them is delivered, once, when it reads again.
"""

from __future__ import annotations

import asyncio
import collections


class RolloutStream:
    def __init__(self, address: str, hwm: int = 4):
        import zmq
        import zmq.asyncio

        self.address = address
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 10_000)
        self._sock.connect(address)
        self.outbox: collections.deque[bytes] = collections.deque()
        self.sent = 0
        self.bytes_sent = 0
        self._wake = asyncio.Event()
        self.drained = asyncio.Event()  # set whenever the outbox becomes empty
        self.drained.set()

    def offer(self, record: bytes) -> None:
        self.outbox.append(record)
        self.drained.clear()
        self._wake.set()

    async def pump(self, on_sent=None) -> None:
        """Send outbox records in order, forever; a full peer queue suspends this coroutine, nothing else."""
        while True:
            if not self.outbox:
                self.drained.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            record = self.outbox[0]
            await self._sock.send(record, copy=False)
            self.outbox.popleft()
            self.sent += 1
            self.bytes_sent += len(record)
            if on_sent is not None:
                on_sent()

    def close(self, linger_s: float = 5.0) -> None:
        self._sock.close(linger=int(linger_s * 1000))
        self._ctx.term()
