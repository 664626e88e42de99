"""LatestWeights: the latest version rank 0 published and its tensors — what a serve that joins later is sent.

Written by `inflight/learn/publisher.py:WeightPublisher`: a whole-state publish keeps the learner's state by reference;
a streamed publish copies every piece into a host snapshot in the serves' dtypes, allocated once and rewritten in
place by later publishes (`writable`), so rank 0 never holds the model twice. Where CUDA is present the snapshot is
page-locked, so a GPU learner's pieces reach it by asynchronous DMA copies that overlap the broadcast (into pageable
memory every device-to-host copy is synchronous and goes through a driver staging buffer, at a fraction of the
speed). Read by `inflight/learn/publisher.py:WeightPublisher.catch_up`, which sends it to a late joiner.
"""

from __future__ import annotations

import torch

from inflight.learn.admission import TensorLayout
from inflight.wire.weights import DTYPES


class LatestWeights:
    """`version` (None before the first publish) and its `tensors`, name -> tensor."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}

    @property
    def published(self) -> int:
        """The latest published version, 0 before the first (what `Progress.published` says)."""
        return self.version if self.version is not None else 0

    def keep(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """`tensors` become the latest, by reference (a streamed publish's snapshot is written in place next time)."""
        self.version, self.tensors = version, tensors

    def writable(self, layout: TensorLayout) -> dict[str, torch.Tensor]:
        """Host tensors in `layout`'s dtypes and shapes for a streamed publish to write into: the current ones when
        they fit (the snapshot is reused, not reallocated per publish), else new ones."""
        held, pin = self.tensors, torch.cuda.is_available()
        fits = list(held) == list(layout) and all(
            str(held[n].dtype).removeprefix("torch.") == d
            and list(held[n].shape) == s
            and held[n].device.type == "cpu"
            and held[n].is_pinned() == pin
            for n, (d, s) in layout.items()
        )
        if fits:
            return held
        return {
            name: torch.empty(shape, dtype=DTYPES[dtype], pin_memory=pin) for name, (dtype, shape) in layout.items()
        }
