"""Where a serve worker's background work runs: off the cores the worker computes on, on the ones its parent (vLLM's
EngineCore) may use and the worker does not.

Used by the staging thread (vllm_patches/staging.py), the preparation of a prepared update (vllm_patches/prepared.py)
and the weights group's formation (vllm_patches/joining.py), so that receiving, verifying and preparing an
update take as few cycles from the decode as the machine allows.
"""

from __future__ import annotations

import contextlib
import os
import threading


def spare_cores() -> set[int]:
    """The cores this process may run on but its compute threads do not, or an empty set where there are none.

    vLLM's CPU worker pins itself (and its OpenMP team) to the cores it computes on; its parent, the EngineCore, may
    use the rest (vLLM keeps one for scheduling). The EngineCore only busy-waits on the worker's answer while a step
    runs (a `sched_yield` loop), so on such a core background work gets nearly all of it, where on the worker's own
    core every cycle it takes is one the decode does not get. An unpinned worker (GPU) has none: its parent's cores
    are its own."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or the parent is gone
        return os.sched_getaffinity(os.getppid()) - os.sched_getaffinity(0)
    return set()


def leave_the_engines_core() -> None:
    """Move the calling (background) thread off the worker's compute cores where there are spare ones, and lower its
    priority to nice 10, so where it must share a core the engine's threads get ~90% of it. (Nice 19 starved the
    preparation for tens of seconds under load; a niced thread holding the GIL cannot starve the engine: the engine
    blocks on the GIL, not runnable, so the holder runs until Python's switch interval hands the GIL over.)

    Measured on 2 cores (SmolLM2, 16 requests decoding): on the EngineCore's core instead of on both, a prepared update
    was built in 0.5-0.7 s instead of 1.6-2.9 s, and the tokens an update cost the decode fell from ~155 to ~95 (8
    updates each, against the quiet seconds after each). Settings of this thread only; threads it starts inherit
    them."""
    spare = spare_cores()
    with contextlib.suppress(AttributeError, OSError):
        if spare:
            os.sched_setaffinity(0, spare)
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


@contextlib.contextmanager
def on_spare_cores():
    """Run the calling thread on `spare_cores()` for the block (unchanged where there are none), then put its own
    cores back. Threads created inside keep the spare cores: used to start the weights group, whose transport thread
    (gloo's TCP loop) then receives each update's bytes beside the decode instead of on its core."""
    spare, own = spare_cores(), None
    with contextlib.suppress(AttributeError, OSError):
        if spare:
            own = os.sched_getaffinity(0)
            os.sched_setaffinity(0, spare)
    try:
        yield
    finally:
        if own is not None:
            os.sched_setaffinity(0, own)
