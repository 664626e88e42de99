"""The rollout stream: finished rollouts leave serve through one ZeroMQ PUSH socket connected to the learner's PULL.

No finished rollout is ever dropped: ZeroMQ PUSH never drops on a live connection, it blocks when the peer's queue is
full (high-water mark). Rather than block the event loop, finished records wait in `outbox`, which the driver counts as
outstanding work and stops admitting prompts when it is full — so a learner that stops reading stops generation after
at most `max_outstanding` rollouts, and every one of them is delivered, once, when it reads again.

A sent record is not forgotten either: it stays in `retained` (by group) until the learner acknowledges its group
(`Progress.acked`: the learner has fsynced it to its journal). A learner killed with records in its socket queue or in
memory loses nothing it acknowledged, and when the restarted learner asks this serve to introduce itself, `resend()`
puts every unacknowledged record back into the outbox. Retained records count as outstanding work too, so memory
stays bounded while the learner is away.
"""

from __future__ import annotations

import asyncio
import collections


class RolloutStream:
    def __init__(self, address: str, hwm: int = 4, keys=None):
        from inflight.wire.endpoints import connect_rollout_push

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
