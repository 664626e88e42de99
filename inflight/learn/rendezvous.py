"""GroupRendezvous: rank 0's side of forming one weights group — the `JoinGroup` each serve gets and the rendezvous.

Called by `inflight/learn/control.py:ControlPlane.ensure_group` with a `Formation` planned by
`inflight/learn/membership.py:Membership.plan`. The rendezvous blocks until every rank has joined (or the timeout),
and the serves' `Joined` come in over the control socket meanwhile, so it runs on a thread and the control plane keeps
serving its socket until `Rendezvous.finished`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch.distributed as dist

from inflight.learn.membership import Formation, Send
from inflight.wire.control import JoinGroup
from inflight.wire.group import GroupAddress, WeightsGroup, WeightsGroupError, open_store


@dataclass
class Rendezvous:
    """One group being formed: `joins` to send to the serves, then `finished()`; `group` or `error` after."""

    address: GroupAddress
    joins: list[Send]
    store: dist.TCPStore  # rank 0 hosts it
    thread: threading.Thread | None = None
    group: WeightsGroup | None = None
    error: str | None = None

    def start(self) -> None:
        """Join as rank 0 on a thread (after the joins went out: the serves need them to join at all)."""
        self.thread = threading.Thread(target=self._join, daemon=True, name="inflight-rendezvous")
        self.thread.start()

    def finished(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def _join(self) -> None:
        try:
            self.group = WeightsGroup(self.address, 0, self.store)
        except (WeightsGroupError, RuntimeError) as exc:
            self.error = str(exc)


class GroupRendezvous:
    """The weights store (a TCPStore bound to `host`, opened once) and every group formed on it, each under its own
    name. `backend`: gloo (host memory) or NCCL (the learner's GPU); `timeout_s` bounds the rendezvous and every
    broadcast."""

    def __init__(self, host: str = "127.0.0.1", store_port: int = 0, backend: str = "gloo", timeout_s: float = 60.0):
        self.host, self.backend, self.timeout_s = host, backend, timeout_s
        self.store = open_store(GroupAddress(host, store_port, 1, timeout_s=timeout_s), is_host=True)

    @property
    def store_port(self) -> int:
        return self.store.port

    def prepare(self, formation: Formation) -> Rendezvous:
        """The rendezvous of `formation`, with the `JoinGroup` of every planned serve (its first rank): the caller
        sends the joins, calls `start` and serves the control socket until `finished()`."""
        address = GroupAddress(
            self.host, self.store_port, formation.world_size, formation.group_name, self.backend, self.timeout_s
        )
        joins = [
            Send(serve.identity, _join_message(address, rank))
            for serve, rank in zip(formation.serves, formation.ranks, strict=True)
        ]
        return Rendezvous(address, joins, self.store)


def _join_message(address: GroupAddress, rank: int) -> JoinGroup:
    return JoinGroup(
        host=address.host,
        port=address.port,
        rank=rank,
        group_name=address.group_name,
        world_size=address.world_size,
        backend=address.backend,
        timeout_s=address.timeout_s,
    )
