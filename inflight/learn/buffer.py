"""RolloutBuffer: streamed rollouts → whole groups, in arrival order, each trained at most once.

Called by the learner's rank 0. Records arrive one per sample from any number of serves; a group becomes trainable
when all `group_size` samples are in. Anything inconsistent (a duplicate rollout id, a sample whose group disagrees on
its size or prompt, a record for another model, a group id already trained) is rejected, counted by reason and logged
— never silently dropped, never trained twice. `consumed` (the groups already trained, inflight/learn/consumed.py) goes
into every checkpoint so a resumed learner refuses replays; a group leaves `completed` when it is trained.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable

from inflight.learn.consumed import ConsumedGroups
from inflight.wire.rollouts import Rollout

log = logging.getLogger("inflight.learn")


class RolloutBuffer:
    def __init__(self, model: str | None = None, consumed: Iterable[str] | dict = (), temperature: float | None = None):
        self.temperature = temperature
        self.model = _model_name(model) if model else None
        self.pending: dict[str, dict[int, Rollout]] = {}
        self.ready: collections.deque[list[Rollout]] = collections.deque()
        self.consumed = ConsumedGroups(consumed)
        self.completed: set[str] = set()  # complete groups waiting to be trained
        self.consumed_by_server: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        self.accepted = 0

    def reject(self, reason: str, rollout: Rollout) -> None:
        self.rejected[reason] += 1
        log.error("rejected rollout %s from %s: %s", rollout.rollout_id, rollout.server_id, reason)

    def holds(self, group_id: str) -> bool:
        """True once the whole group is here (waiting or trained) or was trained before a restart."""
        return group_id in self.completed or group_id in self.consumed

    def add(self, rollout: Rollout, replay: bool = False) -> bool:
        """True if the rollout was taken; otherwise it was rejected (counted and logged), or, with `replay` (the
        learner's own journal after a restart), skipped quietly because its group was already trained or it is
        already here."""
        if replay and (self.holds(rollout.group_id) or rollout.index in self.pending.get(rollout.group_id, {})):
            return False
        if self.model is not None and _model_name(rollout.model) != self.model:
            self.reject(f"model is {rollout.model!r}, this learner trains {self.model!r}", rollout)
            return False
        if self.temperature is not None and abs(rollout.sampling.temperature - self.temperature) > 1e-6:
            why = (
                f"sampled at temperature {rollout.sampling.temperature}, this learner computes logprobs at "
                f"{self.temperature}: pass --temperature to match serve"
            )
            self.reject(why, rollout)
            return False
        if rollout.group_id in self.consumed:
            self.reject("its group was already trained (replayed after a restart?)", rollout)
            return False
        if rollout.group_id in self.completed:
            self.reject(f"duplicate sample {rollout.index} of the already complete group {rollout.group_id}", rollout)
            return False
        group = self.pending.setdefault(rollout.group_id, {})
        if rollout.index in group:
            self.reject(f"duplicate sample {rollout.index} of group {rollout.group_id}", rollout)
            return False
        if group:
            first = next(iter(group.values()))
            if (first.group_size, first.prompt_ids) != (rollout.group_size, rollout.prompt_ids):
                self.reject(f"group_size or prompt differs from the rest of group {rollout.group_id}", rollout)
                return False
        group[rollout.index] = rollout
        self.accepted += 1
        if len(group) == rollout.group_size:
            del self.pending[rollout.group_id]
            self.completed.add(rollout.group_id)
            self.ready.append([group[i] for i in range(rollout.group_size)])
        return True

    def take(self, n_groups: int) -> list[list[Rollout]] | None:
        """The `n_groups` oldest complete groups, marked consumed; None if fewer are ready."""
        if len(self.ready) < n_groups:
            return None
        groups = [self.ready.popleft() for _ in range(n_groups)]
        for group in groups:
            self.consumed.add(group[0].group_id)
            self.completed.discard(group[0].group_id)
            self.consumed_by_server[group[0].server_id] += 1
        return groups

    @property
    def pending_samples(self) -> int:
        return sum(len(g) for g in self.pending.values())


def _model_name(name_or_path: str) -> str:
    """`smollm2` and `/any/where/smollm2` name the same model (serve and learn hosts differ in paths)."""
    return name_or_path.rstrip("/").rsplit("/", 1)[-1]
