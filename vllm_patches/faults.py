"""Fault injection for tests: make one update fail half-way through a phase, to prove a weight update is all-or-nothing.

Read ONCE when the worker imports this module and absent unless
`INFLIGHT_FAULT_UPDATE="<phase>@<n>[:<rank>][,...]"` is set, e.g. "prepare@1,swap@2:1": every worker's first update
fails half-way through preparing its processed copy, and the second fails half-way through swapping it in on the
tensor-parallel rank 1 alone (the other ranks commit, and must then be rolled back: vllm_patches/update_enginecore.py).
Phases: `prepare` (loading into the shadow, `--update-memory double`), `swap` (installing the prepared layers), `apply`
(the in-place reload, `--update-memory low`), `rollback` (undoing a commit the other ranks could not make: the engine
must then stop), `slice` (a tensor-parallel rank resolves one tensor to another rank's rows: `misplaced`, a layout
resolved wrong, which must fail the update, never load those rows). `n` counts the updates this worker began, from 1.
In production `PLANNED` is empty and each phase pays one dict lookup.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import msgspec

PHASES = ("prepare", "swap", "apply", "rollback", "slice")


class InjectedFault(RuntimeError):
    """The failure `INFLIGHT_FAULT_UPDATE` asked for."""


def _parse(spec: str) -> dict[str, frozenset[tuple[int, int | None]]]:
    """Phase → the (update, rank) pairs that fail there; rank None: every rank."""
    planned: dict[str, set[tuple[int, int | None]]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        phase, _, when = item.partition("@")
        n, colon, rank = when.partition(":")
        if phase not in PHASES or not n.isdigit() or int(n) < 1 or (colon and not rank.isdigit()):
            raise ValueError(
                f"INFLIGHT_FAULT_UPDATE has {item!r}: expected <phase>@<n>[:<rank>] with phase one of {PHASES}, "
                "n >= 1 and rank a tensor-parallel rank, e.g. 'prepare@1,swap@2:1'"
            )
        planned.setdefault(phase, set()).add((int(n), int(rank) if colon else None))
    return {phase: frozenset(pairs) for phase, pairs in planned.items()}


PLANNED = _parse(os.environ.get("INFLIGHT_FAULT_UPDATE", ""))


def fails(phase: str, update: int, rank: int = 0) -> bool:
    """Whether the `update`-th update of the worker at tensor-parallel `rank` must fail in `phase`."""
    planned = PLANNED.get(phase, ())
    return (update, None) in planned or (update, rank) in planned


def half_way(items: list, phase: str, update: int, rank: int = 0) -> Iterator:
    """`items` one by one; raises InjectedFault after half of them when this update must fail in `phase`."""
    stop = len(items) // 2 if fails(phase, update, rank) else len(items)
    yield from items[:stop]
    if stop < len(items):
        raise InjectedFault(
            f"injected fault: update {update} failed half-way through {phase} ({stop}/{len(items)}) on rank {rank}"
        )


def misplaced(placements: dict) -> dict:
    """`placements` (name -> vllm_patches/placement.py:Placement) with the first tensor split over ranks moved onto
    the next rows of its dim (another rank's), its shape unchanged: the `slice` fault."""
    name, p = next((n, p) for n, p in placements.items() if p.kind == "slice" and p.length < p.shape[p.dim])
    start = p.start + p.length if p.start + 2 * p.length <= p.shape[p.dim] else 0
    return {**placements, name: msgspec.structs.replace(p, start=start)}
