"""The serve's rollout stream at stop (`RolloutStream.flush` and `close`) on real ZeroMQ sockets: a connected learner
gets the outbox; a learner that is gone does not hold the stop for the flush's timeout and the socket's linger."""

from __future__ import annotations

import asyncio
import time

from inflight.wire.rollouts import RolloutReceiver, RolloutStream, Sampling, Times, encode_rollout, make_rollout

TIMEOUT_S = 10.0  # the serve's flush timeout (inflight/serve/app.py)
RECORDS = 12  # three times the stream's high-water mark: the flush has to pump, not only hand records over


def record(i: int) -> bytes:
    return encode_rollout(make_rollout(
        prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.5], versions=[0], rollout_id=f"r{i}", group_id=f"g{i}",
        group_size=1, index=0, server_id="s", model="m", reward=1.0, finish_reason="stop", sampling=Sampling(1.0),
        times=Times(0.0, 0.0, 0.0)))  # fmt: skip


async def until_connected(stream: RolloutStream) -> None:
    watch = asyncio.create_task(stream.watch())
    try:
        while not stream.connected:
            await asyncio.sleep(0.01)
    finally:
        watch.cancel()


async def stop(stream: RolloutStream) -> float:
    """The serve's stop with RECORDS in the outbox and no pump running (as its outbox holds them when it is told to
    stop): flush, then close; the seconds that took."""
    for i in range(RECORDS):
        stream.offer(record(i), f"g{i}")
    start = time.monotonic()
    await stream.flush(TIMEOUT_S)
    stream.close()
    return time.monotonic() - start


def test_a_stopping_serve_sends_its_whole_outbox_to_a_connected_learner():
    rx = RolloutReceiver(hwm=1)

    async def run() -> float:
        stream = RolloutStream(rx.address)
        await until_connected(stream)
        return await stop(stream)

    try:
        took = asyncio.run(run())
        got, deadline = [], time.monotonic() + 10
        while len(got) < RECORDS and time.monotonic() < deadline:
            got += rx.receive(timeout_s=0.2)
        assert sorted(r.rollout_id for r in got) == sorted(f"r{i}" for i in range(RECORDS))
        assert took < TIMEOUT_S
    finally:
        rx.close()


def test_a_stopping_serve_whose_learner_is_gone_stops_at_once_instead_of_waiting_out_flush_and_linger():
    rx = RolloutReceiver(hwm=1)

    async def run() -> tuple[float, bool]:
        stream = RolloutStream(rx.address)
        await until_connected(stream)
        rx.close()  # the learner exits or is killed: its end of the TCP connection closes
        return await stop(stream), stream.connected

    took, connected = asyncio.run(run())
    assert not connected
    assert took < 3, f"the stop waited {took:.1f}s for a learner that is gone (flush {TIMEOUT_S:.0f}s + linger 5s)"


def test_a_serve_that_never_reached_its_learner_stops_at_once():
    rx = RolloutReceiver()
    address = rx.address
    rx.close()  # nothing listens there

    async def run() -> tuple[float, bool]:
        stream = RolloutStream(address)
        return await stop(stream), stream.connected

    took, connected = asyncio.run(run())
    assert took < 3 and not connected
