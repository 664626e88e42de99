"""The weights group: a process group of its own between learner rank 0 (rank 0, the TCPStore host) and every serve
worker, built straight from a TCPStore so it never touches either side's default torch.distributed world.

gloo on CPU, NCCL on GPU. Every collective waits at most `timeout_s`; a peer that dies or stops sending turns into a
`WeightsGroupError` within that time instead of a hang. After any error the group is broken (gloo and NCCL leave a
communicator in an undefined state): close it and form a new one with a fresh `group_name`.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class WeightsGroupError(RuntimeError):
    """A weights-group collective failed or timed out; the group is no longer usable."""


@dataclass(frozen=True)
class GroupAddress:
    """Everything a serve worker needs to join: where the store is, its rank, the world size."""

    host: str
    port: int
    world_size: int
    group_name: str = "inflight-weights-0"
    backend: str = "gloo"
    timeout_s: float = 60.0


class WeightsGroup:
    """One member of the weights group. Rank 0 sends, every other rank receives."""

    def __init__(self, address: GroupAddress, rank: int, store: dist.Store | None = None):
        if address.backend not in BACKENDS:
            raise ValueError(f"backend is {address.backend!r}, expected one of {BACKENDS}")
        if not 0 <= rank < address.world_size:
            raise ValueError(f"rank {rank} outside the weights group of size {address.world_size}")
        self.address, self.rank = address, rank
        self.timeout = datetime.timedelta(seconds=address.timeout_s)
        self._store = store or open_store(address, is_host=rank == 0)
        prefixed = dist.PrefixStore(address.group_name, self._store)
        try:
            self._pg = _make_process_group(prefixed, rank, address, self.timeout)
        except RuntimeError as exc:
            raise WeightsGroupError(
                f"weights group {address.group_name} on {address.host}:{address.port} did not form within "
                f"{address.timeout_s:.0f}s as rank {rank}/{address.world_size}: {exc}"
            ) from exc
        self.broken = False

    def broadcast(self, tensor: torch.Tensor, what: str = "bucket") -> None:
        """Broadcast `tensor` from rank 0 in place; raise `WeightsGroupError` on failure or after the timeout."""
        if self.broken:
            raise WeightsGroupError(f"weights group {self.address.group_name} is broken; form a new one")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = self.timeout
        try:
            self._pg.broadcast([tensor], opts).wait(self.timeout)
        except RuntimeError as exc:
            self.broken = True
            raise WeightsGroupError(
                f"broadcast of {what} ({tensor.numel() * tensor.element_size()} bytes) failed as rank {self.rank} "
                f"within {self.address.timeout_s:.0f}s: {str(exc).splitlines()[0]}"
            ) from exc

    def close(self) -> None:
        self.broken = True
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            with contextlib.suppress(RuntimeError):
                pg.shutdown()


def open_store(address: GroupAddress, is_host: bool) -> dist.TCPStore:
    """The rendezvous store; the host binds `address.host:address.port` (port 0 picks a free port, see `.port`).

    The host binds the listening socket itself and hands it over: left to itself, TCPStore listens on every interface
    whatever `host` says, and the weights store must not be reachable beyond the address it was given.
    """
    listen_fd, port = None, address.port
    if is_host:
        listener = socket.socket(socket.AF_INET6 if ":" in address.host else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address.host, address.port))
        listener.listen(512)
        port = listener.getsockname()[1]
        listen_fd = listener.detach()  # the store owns the descriptor from now on
    return dist.TCPStore(
        address.host,
        port,
        world_size=None,
        is_master=is_host,
        timeout=datetime.timedelta(seconds=address.timeout_s),
        wait_for_workers=False,
        use_libuv=True,
        master_listen_fd=listen_fd,
    )


def _make_process_group(store, rank: int, address: GroupAddress, timeout: datetime.timedelta):
    if address.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, address.world_size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Rank 0 (the learner) listens on the address it was given; every other rank uses its own address on the route
    # to rank 0 — on another host `address.host` is not a local address at all.
    local = address.host if rank == 0 else local_address_towards(address.host, address.port)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
    return dist.ProcessGroupGloo(store, rank, address.world_size, opts)


def local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP connect only picks the route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port or 9))
        except OSError as exc:
            raise WeightsGroupError(f"no route from this host to the learner at {host}: {exc}") from exc
        return probe.getsockname()[0]
