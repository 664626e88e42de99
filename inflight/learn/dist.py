"""The learner's data-parallel world: torchrun env or a single process, and moving a step's samples to every rank.

Rank 0 owns the sockets; each step it broadcasts the step's samples to the other ranks as msgpack bytes in a uint8
tensor over the default group (never pickle), and every rank trains on its slice `samples[rank::world]`. An empty
broadcast means "stop" so all ranks leave the loop at the same step.
"""

from __future__ import annotations

import os

import msgspec
import torch
import torch.distributed as dist

from inflight.learn.samples import GatedSample

_decoder = msgspec.msgpack.Decoder(list[GatedSample])


def init_world(backend: str = "gloo") -> tuple[int, int]:
    """(rank, world size); joins the torchrun world when launched by torchrun, else a world of one."""
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def close_world(clean: bool) -> None:
    """Leave the torchrun world: every rank meets at a barrier (after a clean run) and then tears the group down.

    Without this, a rank that finishes first (rank 1 returns from the HF export while rank 0 still writes files) exits
    with gloo's threads alive and the C++ runtime aborts it ("terminate called without an active exception", SIGABRT).
    """
    if not dist.is_initialized():
        return
    if clean and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def broadcast_samples(samples: list[GatedSample] | None, rank: int, world: int) -> list[GatedSample]:
    """Rank 0's `samples` on every rank ([] = stop). A no-op in a world of one."""
    if world == 1:
        return samples or []
    payload = msgspec.msgpack.encode(samples or []) if rank == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, 0)
    buf = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if rank == 0
        else torch.empty(int(size), dtype=torch.uint8)
    )
    dist.broadcast(buf, 0)
    return (samples or []) if rank == 0 else _decoder.decode(buf.numpy().tobytes())
