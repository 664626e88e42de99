"""Fault injection for tests: make one update fail half-way through a phase, to prove a weight update is all-or-nothing.

Read ONCE when the worker imports this module and absent unless `INFLIGHT_FAULT_UPDATE="<phase>@<n>[,<phase>@<n>]"`
is set, e.g. "prepare@1,swap@2": the worker's first update fails half-way through preparing its processed copy, the
second half-way through swapping it in. Phases: `prepare` (loading into the shadow, `--update-memory double`), `swap`
(installing the prepared layers), `apply` (the in-place reload, `--update-memory low`). `n` counts the updates this
worker began, from 1. In production `PLANNED` is empty and each phase pays one dict lookup.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

PHASES = ("prepare", "swap", "apply")


class InjectedFault(RuntimeError):
    """The failure `INFLIGHT_FAULT_UPDATE` asked for."""


def _parse(spec: str) -> dict[str, frozenset[int]]:
    planned: dict[str, set[int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        phase, _, n = item.partition("@")
        if phase not in PHASES or not n.isdigit() or int(n) < 1:
            raise ValueError(
                f"INFLIGHT_FAULT_UPDATE has {item!r}: expected <phase>@<n> with phase one of {PHASES} "
                "and n >= 1, e.g. 'prepare@1,swap@2'"
            )
        planned.setdefault(phase, set()).add(int(n))
    return {phase: frozenset(ns) for phase, ns in planned.items()}


PLANNED = _parse(os.environ.get("INFLIGHT_FAULT_UPDATE", ""))


def fails(phase: str, update: int) -> bool:
    """Whether the `update`-th update of this worker must fail in `phase`."""
    return update in PLANNED.get(phase, ())


def half_way(items: list, phase: str, update: int) -> Iterator:
    """`items` one by one; raises InjectedFault after half of them when this update must fail in `phase`."""
    stop = len(items) // 2 if fails(phase, update) else len(items)
    yield from items[:stop]
    if stop < len(items):
        raise InjectedFault(f"injected fault: update {update} failed half-way through {phase} ({stop}/{len(items)})")
