"""What the two-rank learner tests share (test_distributed.py, test_lora_distributed.py, test_moe_state_names.py):
a gloo group over a file:// rendezvous that its ranks leave together, as the learner's own ranks do."""

from __future__ import annotations

import contextlib
import datetime
import gc
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist


@contextlib.contextmanager
def process_group(store: Path | str, rank: int, world: int, timeout_s: float) -> Iterator[None]:
    """The default gloo group for one spawned rank. After a clean run every rank meets at a barrier before the group
    goes (learner/world.py:World.close): a rank that tore its group down first left the slower one's gloo threads to
    a closed peer, and the C++ runtime aborted that rank (SIGABRT, seen on CI). FSDP state holds reference cycles, so
    the models and meshes are freed before the group goes too."""
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    try:
        yield
        if world > 1:
            dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
