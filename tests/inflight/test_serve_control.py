"""The serve's control client queues an update that arrives while another is applied, and one that arrives while its
workers are still joining the weights group (inflight/serve/control.py).

A narrow unit test: a real ROUTER socket plays the learner and a stand-in engine takes 0.3 s per update, so the order
of the replies is the client's alone. The real path (a cut link, a re-formed group, the rejoined serve's next update)
runs in test_two_hosts.py.
"""

from __future__ import annotations

import asyncio
import types

import zmq

from inflight.serve.control import ControlClient
from inflight.wire.control import (
    Hello,
    Joined,
    JoinGroup,
    UpdateDone,
    UpdateWeights,
    decode_control,
    encode_control,
)


class SlowEngine:
    def __init__(self, join_s: float = 0.0) -> None:
        self.version, self.applied, self.join_s, self.events = 0, [], join_s, []

    async def join_weights_group(self, *args, **kw):
        self.events.append("join begins")
        await asyncio.sleep(self.join_s)  # every worker's joining thread takes the group
        self.events.append("joined")

    async def update(self, manifest: bytes, mode: str, kv: str):
        self.events.append("update begins")
        await asyncio.sleep(0.3)
        self.applied.append(manifest)
        self.version += 1
        return types.SimpleNamespace(
            version=self.version, total_s=0.3, stall_s=0.0, commit_s=0.0, receive_s=0.3, bytes_kept=0, full_tensors=()
        )


def fake_driver(engine: SlowEngine):
    cfg = types.SimpleNamespace(model="m", mode="never-stop", kv="keep", tensor_parallel_size=2)
    return types.SimpleNamespace(engine=engine, cfg=cfg, server_id="serve@00c0ffee", set_consumed=lambda n: None,
                                 notify=lambda: None)  # fmt: skip


def test_an_update_that_arrives_during_another_starts_when_it_ends_and_a_newer_one_supersedes_it():
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    engine = SlowEngine()
    replies: list = []

    async def main() -> None:
        client = ControlClient(f"tcp://127.0.0.1:{port}", fake_driver(engine), tensors=[])
        task = asyncio.create_task(client.serve())
        try:
            await exchange(into=replies)
        finally:  # a failed assertion must not leave the client's context to the garbage collector (its term() hangs)
            task.cancel()
            client.close()

    async def exchange(into: list) -> None:
        loop = asyncio.get_running_loop()

        def recv():
            assert router.poll(10_000), "nothing from the client within 10 s"
            return router.recv_multipart()

        identity, data = await loop.run_in_executor(None, recv)
        hello = decode_control(data, to="learner")
        assert isinstance(hello, Hello) and hello.workers == 2  # one weights-group rank per engine worker
        for manifest in (b"v1", b"v2", b"v3"):  # v2 and v3 arrive while v1 is applied; v3 is the newest
            router.send_multipart([identity, encode_control(UpdateWeights(manifest=manifest))])
        while len(into) < 3:
            _, data = await loop.run_in_executor(None, recv)
            into.append(decode_control(data, to="learner"))

    asyncio.run(main())
    router.close()
    assert all(isinstance(r, UpdateDone) for r in replies)
    superseded, first, last = replies
    assert not superseded.ok and "superseded" in superseded.error
    assert first.ok and first.version == 1 and last.ok and last.version == 2
    assert engine.applied == [b"v1", b"v3"]


def test_an_update_that_arrives_while_the_workers_still_join_the_group_waits_for_the_join():
    """The learner sends an update once its own side of the group formed; a worker's joining thread may not have
    taken the group yet (a loaded machine), and an update begun then failed with "no usable weights group"."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    engine = SlowEngine(join_s=0.5)
    replies: list = []

    async def main() -> None:
        client = ControlClient(f"tcp://127.0.0.1:{port}", fake_driver(engine), tensors=[])
        task = asyncio.create_task(client.serve())
        loop = asyncio.get_running_loop()

        def recv():
            assert router.poll(10_000), "nothing from the client within 10 s"
            return router.recv_multipart()

        try:
            identity, _ = await loop.run_in_executor(None, recv)  # Hello
            router.send_multipart([identity, encode_control(JoinGroup(group_name="g"))])
            router.send_multipart([identity, encode_control(UpdateWeights(manifest=b"v1"))])
            while len(replies) < 2:
                _, data = await loop.run_in_executor(None, recv)
                replies.append(decode_control(data, to="learner"))
        finally:
            task.cancel()
            client.close()

    asyncio.run(main())
    router.close()
    assert engine.events == ["join begins", "joined", "update begins"]
    joined, done = replies
    assert isinstance(joined, Joined) and joined.ok and isinstance(done, UpdateDone) and done.ok and done.version == 1
