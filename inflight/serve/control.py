"""Serve's end of the control channel: a ZeroMQ DEALER connected to the learner's ROUTER.

Before the engine starts, `ask_learner` sends the run contract alone (`Ask`): a serve the learner refuses stops then,
not after loading its model. Once the engine runs, `ControlClient` sends `Hello` on start (its tensors and its
`RunContract`; again whenever the learner asks with `Introduce`), a `Status` heartbeat every second, and answers
`JoinGroup` / `UpdateWeights` with `Joined` / `UpdateDone`. A malformed or unknown-schema message is logged and counted
and serve keeps running; a failed update is reported and the engine keeps its weights and version; a `Refused` stops the
serve with the learner's reason.
"""

from __future__ import annotations

import asyncio
import logging
import time

from inflight.serve.driver import RolloutDriver
from inflight.wire.contract import RunContract
from inflight.wire.control import (
    Agreed,
    Ask,
    ControlError,
    Hello,
    Introduce,
    Joined,
    JoinGroup,
    Progress,
    Refused,
    Status,
    TensorSpec,
    UpdateDone,
    UpdateWeights,
    connect_control_dealer,
    decode_control,
    encode_control,
)
from inflight.wire.secure import CurveKeys
from vllm_patches.update_frontend import UpdateError

log = logging.getLogger("inflight.serve")


class RefusedError(RuntimeError):
    """The learner refused this serve (its model or its contract differs): the serve stops with a non-zero exit code."""


ASK_WAIT_S = 2.0  # how long a serve waits for the learner's answer to `Ask` before it starts its engine anyway


async def ask_learner(
    address: str, ask: Ask, keys: CurveKeys | None = None, wait_s: float = ASK_WAIT_S
) -> Agreed | None:
    """The learner's answer to this serve's run contract, asked before the engine starts: its `Agreed` (which says
    whether it sends delta updates: the serve's staging plan counts them); None when no learner answered within
    `wait_s` (not up yet, or of another version: the `Hello` after the engine starts is checked in full all the
    same); raises RefusedError, naming the learner's reason, when it `Refused`."""
    ctx, sock = connect_control_dealer(address, keys)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    try:
        await sock.send(encode_control(ask))
        while (left := deadline - loop.time()) > 0 and await sock.poll(int(left * 1000)):
            try:
                message = decode_control(await sock.recv(), to="serve")
            except ControlError as exc:
                log.error("rejected control message while asking the learner: %s", exc)
                continue
            if isinstance(message, Refused):
                raise RefusedError(f"the learner refused this serve: {message.reason}")
            if isinstance(message, Agreed):
                return message
        return None
    finally:
        sock.close(linger=0)
        ctx.term()


class ControlClient:
    def __init__(
        self,
        address: str,
        driver: RolloutDriver,
        tensors: list[TensorSpec],
        heartbeat_s: float = 1.0,
        keys: CurveKeys | None = None,
        contract: RunContract | None = None,
    ):
        self.driver, self.engine, self.cfg = driver, driver.engine, driver.cfg
        self.tensors, self.heartbeat_s, self.contract = tensors, heartbeat_s, contract
        self._ctx, self._sock = connect_control_dealer(address, keys)
        self.rejected = 0
        self._update_task: asyncio.Task | None = None
        self._pending: UpdateWeights | None = None  # arrived while an update was running; starts when that one ends
        self._joining: asyncio.Task | None = None  # the last JoinGroup's join, which an update waits for
        self.on_update = None  # called with each UpdateDone (progress metrics)
        self.address, self.started, self.heard = address, time.monotonic(), False  # heard: any message back

    async def send(self, message) -> None:
        await self._sock.send(encode_control(message))

    def hello(self) -> Hello:
        cfg = self.cfg
        return Hello(
            server_id=self.driver.server_id,
            model=cfg.model,
            workers=cfg.tensor_parallel_size,
            version=self.engine.version,
            mode=cfg.mode,
            tensors=self.tensors,
            contract=self.contract,
        )

    async def heartbeat(self) -> None:
        while True:
            d = self.driver
            status = Status(
                server_id=d.server_id,
                version=self.engine.version,
                inflight=d.stats.requests_inflight,
                outbox=len(d.stream.outbox),
                rollouts_sent=d.stream.sent,
                groups_admitted=d.stats.groups_admitted,
            )
            await self.send(status)
            await asyncio.sleep(self.heartbeat_s)

    async def serve(self) -> None:
        await self.send(self.hello())
        while True:
            data = await self._sock.recv()
            self.heard = True
            try:
                message = decode_control(data, to="serve")
            except ControlError as exc:
                self.rejected += 1
                log.error("rejected control message #%d (%d bytes): %s", self.rejected, len(data), exc)
                continue
            await self._dispatch(message)

    async def _dispatch(self, message) -> None:
        if isinstance(message, Progress):
            self.driver.learner_published(message.published)
            self.driver.stream.ack(message.acked)
            self.driver.set_consumed(message.groups_consumed)
            self.driver.notify()  # acknowledged records free outstanding room
        elif isinstance(message, Refused):
            log.error("the learner refused this serve: %s", message.reason)
            raise RefusedError(f"the learner refused this serve: {message.reason}")
        elif isinstance(message, Introduce):
            await self.send(self.hello())
            resent = self.driver.stream.resend()
            if resent:
                log.warning(
                    "the learner asked for an introduction (restarted?): sending %d unacknowledged rollouts again",
                    resent,
                )
        elif isinstance(message, JoinGroup):
            self._joining = asyncio.create_task(self._join(message))
        elif isinstance(message, UpdateWeights):
            self.driver.set_consumed(message.groups_consumed)
            if self._update_task is not None and not self._update_task.done():
                # The learner sends the next update only after this one is answered, except when it has given up on
                # a broadcast (a cut link, a re-formed group): then the running update is bound to fail on its old
                # group and the new one must start the moment it does, not be refused (the learner's broadcast would
                # wait out its timeout for a receiver that never comes).
                if self._pending is not None:
                    await self.send(
                        UpdateDone(
                            server_id=self.driver.server_id,
                            version=self.engine.version,
                            ok=False,
                            error="superseded by a newer update before it started",
                        )
                    )
                log.warning(
                    "an update arrived while the previous one is still being applied: it starts when that one ends"
                )
                self._pending = message
                return
            self._update_task = asyncio.create_task(self._update(message))

    async def _join(self, m: JoinGroup) -> None:
        try:
            await self.engine.join_weights_group(
                m.host, m.port, m.rank, m.world_size, group_name=m.group_name, backend=m.backend, timeout_s=m.timeout_s
            )
            reply = Joined(server_id=self.driver.server_id, group_name=m.group_name)
            log.info("joined weights group %s as rank %d/%d", m.group_name, m.rank, m.world_size)
        except Exception as exc:
            log.error("could not join weights group %s: %s", m.group_name, exc)
            reply = Joined(server_id=self.driver.server_id, group_name=m.group_name, ok=False, error=str(exc))
        await self.send(reply)

    async def _update(self, m: UpdateWeights) -> None:
        if self._joining is not None:
            # The learner sends an update once its side of the group formed, which can be before every worker's
            # joining thread has taken the group (a loaded machine: "no usable weights group", and the update lost).
            await asyncio.shield(self._joining)  # _join never raises: a failed join fails the update below
        if self.cfg.mode == "blocking":
            await self.driver.wait_idle()
        try:
            r = await self.engine.update(m.manifest, mode=self.cfg.mode, kv=self.cfg.kv)
            done = UpdateDone(
                server_id=self.driver.server_id,
                version=r.version,
                total_s=r.total_s,
                stall_s=r.stall_s,
                commit_s=r.commit_s,
                receive_s=r.receive_s,
                bytes_kept=r.bytes_kept,
                full_tensors=r.full_tensors,
            )
            log.info("weights v%d committed: stall %.3fs, receive %.3fs", r.version, r.stall_s, r.receive_s)
        except (UpdateError, ValueError) as exc:
            log.error("weight update failed, weights and version unchanged: %s", exc)
            done = UpdateDone(server_id=self.driver.server_id, version=self.engine.version, ok=False, error=str(exc))
        if self.on_update is not None:
            self.on_update(done)
        self.driver.notify()
        await self.send(done)
        if self._pending is not None:
            message, self._pending = self._pending, None
            self._update_task = asyncio.create_task(self._update(message))

    def close(self) -> None:
        self._sock.close(linger=500)
        self._ctx.term()
