"""The weights group: a process group of its own between learner rank 0 (rank 0, the TCPStore host) and every serve
worker, built straight from a TCPStore so it never touches either side's default torch.distributed world.

gloo on CPU, NCCL on GPU. Every collective waits at most `timeout_s`; a peer that dies or stops sending turns into a
`WeightsGroupError` within that time instead of a hang. After any error the group is broken (gloo and NCCL leave a
communicator in an undefined state): close it and form a new one with a fresh `group_name`.

NCCL's failure path is torch's watchdog, not ours, unless it is told otherwise: by default
(`TORCH_NCCL_ASYNC_ERROR_HANDLING=3`) a timed-out or failed collective tears the whole process down, so a learner
killed mid-broadcast would take the serve's EngineCore with it and no rejoin would ever run. The weights group is
built under `NCCL_SURVIVE_PEERS` (read by ProcessGroupNCCL's constructor, so it applies to this group alone): the
watchdog only aborts the communicator, the waiting call raises, and the heartbeat monitor that kills a process whose
watchdog looks stuck is off. `close()` aborts an NCCL group (shutdown waits for in-flight work, which a dead peer
never finishes) on a thread of its own, lets a gloo group go, and returns at once: a serve worker closes on the
engine's thread (a rejoin), where even a bounded wait stops decoding.

Two NCCL communicators share a serve's GPU: vLLM's tensor-parallel all-reduce (in the engine's CUDA graphs) and this
group's broadcast (on the staging thread). A broadcast waiting for a slow learner keeps its CTAs resident on the SMs
while it spins, which the engine's kernels then queue behind; the group is built with `max_ctas` (NCCL's
`ncclConfig_t`, through the process group's `Options.config`) so it can never hold more than `WEIGHTS_MAX_CTAS` SMs.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
# torch's ProcessGroupNCCL reads these when a group is constructed. 2 = CleanUpOnly: abort the communicator and let
# the collective's wait() raise, without tearing the process down (3, the default, tears it down).
NCCL_SURVIVE_PEERS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}
# The most CTAs (thread blocks, one SM each at most) the weights group's NCCL kernels may occupy: 4 of an H100's 132
# SMs; NCCL's default for a broadcast is up to 32 channels. Updates are bound by the learner's send and the network
# beyond one host, not by the channels within one GPU.
WEIGHTS_MAX_CTAS = 4


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
    max_ctas: int = WEIGHTS_MAX_CTAS  # NCCL only: see the module's docstring


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
        pg = self._pg  # held by this frame: a `close` meanwhile must not run the group's destructor (which waits for
        # this broadcast) on the closing thread; the last reference then goes here, when the wait ends
        try:
            pg.broadcast([tensor], opts).wait(self.timeout)
        except RuntimeError as exc:
            self.broken = True
            raise WeightsGroupError(
                f"broadcast of {what} ({tensor.numel() * tensor.element_size()} bytes) failed as rank {self.rank} "
                f"within {self.address.timeout_s:.0f}s: {str(exc).splitlines()[0]}"
            ) from exc

    def close(self) -> None:
        """Break the group for good, without waiting: NCCL is aborted on a thread of its own; a gloo group is only let
        go (its `shutdown`, and its destructor, wait for an in-flight collective: 4.7 s of a 5 s timeout measured on
        the closing thread); a broadcast still waiting in it holds the last reference, and fails by its timeout."""
        self.broken = True
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and self.address.backend == "nccl":
            abort_off_thread(pg)


def abort_off_thread(pg) -> threading.Thread:
    """Abort `pg` (NCCL) on a daemon thread and return at once: ncclCommAbort can block while a kernel of a dead
    peer's collective is still queued, and the caller (the engine's thread, the learner's loop) must go on."""

    def abort() -> None:
        with contextlib.suppress(RuntimeError):
            pg.abort()

    thread = threading.Thread(target=abort, name="inflight-nccl-abort", daemon=True)
    thread.start()
    _TEARDOWNS.append(thread)
    return thread


_TEARDOWNS: list[threading.Thread] = []


@atexit.register
def _finish_teardowns(wait_s: float = 5.0) -> None:
    """At exit, give each abort still running `wait_s` to end: a process group destroyed by the interpreter while
    another thread tears it down aborts the process ("terminate called without an active exception")."""
    for thread in _TEARDOWNS:
        thread.join(wait_s)


@contextlib.contextmanager
def environment(overrides: Mapping[str, str]) -> Iterator[None]:
    """`overrides` set in os.environ for the block, the previous values (or their absence) restored after it."""
    before = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def member_rank(first_rank: int, worker: int, workers: int, world_size: int) -> int:
    """The weights-group rank of a serve's `worker`-th engine worker (its tensor-parallel rank): a serve of `workers`
    workers holds the consecutive ranks from `first_rank` (the learner's membership plans them from `Hello.workers`),
    so every worker receives every bucket and loads its own shard through vLLM's loaders."""
    if first_rank < 1:
        raise ValueError(f"first_rank is {first_rank}: rank 0 is the learner's, a serve's ranks start at 1")
    if not 0 <= worker < workers:
        raise ValueError(f"worker {worker} outside this serve's {workers} workers (--tensor-parallel-size)")
    rank = first_rank + worker
    if rank >= world_size:
        raise ValueError(
            f"worker {worker} of a {workers}-worker serve from rank {first_rank} is rank {rank}, outside the weights "
            f"group of size {world_size}: the learner planned fewer ranks than this serve has workers (Hello.workers)"
        )
    return rank


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


# The environment is process-wide: two groups formed at once on two threads must not restore each other's values.
_CONSTRUCTING = threading.Lock()


def _make_process_group(store, rank: int, address: GroupAddress, timeout: datetime.timedelta):
    if address.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        limit_ctas(opts, address.max_ctas)
        with _CONSTRUCTING, environment(NCCL_SURVIVE_PEERS):
            return dist.ProcessGroupNCCL(store, rank, address.world_size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Rank 0 (the learner) listens on the address it was given; every other rank uses its own address on the route
    # to rank 0 — on another host `address.host` is not a local address at all.
    local = address.host if rank == 0 else local_address_towards(address.host, address.port)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
    return dist.ProcessGroupGloo(store, rank, address.world_size, opts)


def limit_ctas(opts, max_ctas: int) -> None:
    """Cap the CTAs of the group's NCCL kernels (`ncclConfig_t.max_ctas`, NCCL 2.17+); 0 leaves NCCL's default."""
    config = getattr(opts, "config", None)
    if max_ctas > 0 and config is not None and hasattr(config, "max_ctas"):
        config.max_ctas = max_ctas


def local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP connect only picks the route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port or 9))
        except OSError as exc:
            raise WeightsGroupError(f"no route from this host to the learner at {host}: {exc}") from exc
        return probe.getsockname()[0]
