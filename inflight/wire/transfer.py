"""Moving one update over the weights group: a double-buffered sender (rank 0) and a bucket receiver (other ranks).

Contract (both sides, in lockstep or the group times out): the receiver must have the manifest before the sender's first
bucket times out; buckets go in manifest order, one broadcast each, each exactly `manifest.bucket_sizes[i]` bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from inflight.wire.group import WeightsGroup
from inflight.wire.weights import UpdateManifest, pack_bucket


@dataclass
class TransferStats:
    bytes: int = 0
    seconds: float = 0.0
    buckets: int = 0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def send_update(
    group: WeightsGroup, manifest: UpdateManifest, state: Mapping[str, torch.Tensor], pin: bool = False
) -> TransferStats:
    """Broadcast every bucket of `manifest` from rank 0. Packing bucket k+1 overlaps sending bucket k."""
    if not manifest.bucket_sizes:
        return TransferStats()
    device = next(iter(state.values())).device
    size = max(manifest.bucket_sizes)
    buffers = [torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin) for _ in range(2)]
    stats, start = TransferStats(), time.perf_counter()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-pack") as packer:
        pending = packer.submit(pack_bucket, manifest, 0, state, buffers[0])
        for i in range(len(manifest.bucket_sizes)):
            bucket = pending.result()
            if i + 1 < len(manifest.bucket_sizes):
                pending = packer.submit(pack_bucket, manifest, i + 1, state, buffers[(i + 1) % 2])
            group.broadcast(bucket, what=f"bucket {i}/{len(manifest.bucket_sizes)} of version {manifest.version}")
            stats.bytes += bucket.numel()
            stats.buckets += 1
    stats.seconds = time.perf_counter() - start
    return stats


def receive_update(
    group: WeightsGroup,
    manifest: UpdateManifest,
    device: torch.device | str = "cpu",
    on_bucket: Callable[[int, int], None] | None = None,
) -> list[torch.Tensor]:
    """Receive every bucket of `manifest` into fresh staging buffers; `on_bucket(index, bytes)` reports progress."""
    buckets = []
    for i, size in enumerate(manifest.bucket_sizes):
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        group.broadcast(buf, what=f"bucket {i}/{len(manifest.bucket_sizes)} of version {manifest.version}")
        buckets.append(buf)
        if on_bucket is not None:
            on_bucket(i, size)
    return buckets
