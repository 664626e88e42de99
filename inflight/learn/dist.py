"""Moving a step's samples from rank 0 to every learner rank.

Rank 0 owns the sockets; each step it broadcasts the step's samples to the other ranks as msgpack bytes in a uint8
tensor over the default group (never pickle), on that group's device (`learner/world.py:World.device`: NCCL moves
GPU memory only), and every rank trains on its slice `samples[rank::world]`. An empty broadcast means "stop" so all
ranks leave the loop at the same step. Joining and leaving the world is `learner/world.py`.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from inflight.learn.samples import GatedSample
from learner.world import World

_decoder = msgspec.msgpack.Decoder(list[GatedSample])


def broadcast_samples(samples: list[GatedSample] | None, world: World) -> list[GatedSample]:
    """Rank 0's `samples` on every rank ([] = stop). A no-op in a world of one. Collective: every rank calls it."""
    if world.size == 1:
        return samples or []
    payload = msgspec.msgpack.encode(samples or []) if world.rank == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=world.device)
    dist.broadcast(size, 0)
    if world.rank == 0:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(world.device)
    else:
        buf = torch.empty(int(size), dtype=torch.uint8, device=world.device)
    dist.broadcast(buf, 0)
    return (samples or []) if world.rank == 0 else _decoder.decode(buf.cpu().numpy().tobytes())
