"""LatestWeights: the latest version rank 0 published and, for a whole-state publish, its tensors.

Written by `inflight/learn/publisher.py:WeightPublisher`: a whole-state publish (a delta, an adapter) keeps the state
it gathered anyway, by reference, and `catch_up` sends it to a serve that joins later. A streamed publish keeps the
version alone: no rank holds a copy of the model for late joiners; every rank streams its weights again instead
(`WeightPublisher.catch_up`, inflight/learn/publisher.py:RankSender.catch_up).
"""

from __future__ import annotations

import torch


class LatestWeights:
    """`version` (None before the first publish) and its `tensors`, name -> tensor ({} after a streamed publish)."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}

    @property
    def published(self) -> int:
        """The latest published version, 0 before the first (what `Progress.published` says)."""
        return self.version if self.version is not None else 0

    def keep(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """`version` is the latest; `tensors` (by reference) what a late joiner is sent, {} when nothing is kept."""
        self.version, self.tensors = version, tensors
