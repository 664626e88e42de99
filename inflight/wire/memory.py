"""Handing freed heap memory back to the operating system after each weight update (glibc; a no-op elsewhere).

Every update frees and allocates hundreds of MB in blocks of many sizes on both sides: the learner's snapshot and
buckets, the serve's staging buckets and the weights vLLM repacks on reload. glibc keeps such freed memory mapped
inside its arenas (its mmap threshold rises to the size of the blocks freed, so later ones come from the heap), and
resident memory creeps up with the number of updates although nothing leaks. `malloc_trim(0)` returns every free page
of every arena; measured here at a few milliseconds per call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only where a CUDA device is measured
    import torch

_malloc_trim = None
_looked_up = False


def trim_heap() -> float:
    """Return free heap pages to the OS; the seconds it took (0.0 where the C library has no malloc_trim)."""
    global _malloc_trim, _looked_up
    if not _looked_up:
        _looked_up = True
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
            _malloc_trim = None
    if _malloc_trim is None:
        return 0.0
    start = time.perf_counter()
    _malloc_trim(0)
    return time.perf_counter() - start


TRIM_EVERY_ENV = "INFLIGHT_TRIM_EVERY_S"
DEFAULT_TRIM_EVERY_S = 30.0
_trimming = threading.Lock()
_last_trim_start = float("-inf")


def trim_every_s(default: float = DEFAULT_TRIM_EVERY_S) -> float | None:
    """The trim interval after weight updates: `INFLIGHT_TRIM_EVERY_S` (seconds; 0 = after every update, `never` = no
    trim), else `default`. None means never."""
    raw = os.environ.get(TRIM_EVERY_ENV, "").strip().lower()
    if not raw:
        return default
    if raw in ("never", "off", "none"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"{TRIM_EVERY_ENV}={raw!r}: expected seconds >= 0 (0 = after every update) or 'never'")
    return value


@functools.cache
def _process_trim_every_s() -> float | None:
    """`trim_every_s()` read once per process (it is called on every commit)."""
    try:
        return trim_every_s()
    except ValueError:  # inflight.serve and inflight.learn refuse a bad value at start-up; a library user: the default
        return DEFAULT_TRIM_EVERY_S


def trim_after_update() -> bool:
    """After a weight update (the engine's commit, the learner's publish): a background trim per `trim_every_s()`."""
    every = _process_trim_every_s()
    return False if every is None else trim_heap_in_background(min_interval_s=every)


def trim_heap_in_background(min_interval_s: float = 0.0) -> bool:
    """`trim_heap` on a daemon thread, at most one at a time and at most once per `min_interval_s`; True if one started.

    For callers inside a latency-critical section (the engine's commit). Trimming is not free even off the critical
    path: the pages it returns are faulted in again (zeroed) by the next update's allocations. Measured in 4-minute
    soaks on the tiny model (median commit stall): no trim 46 ms, a trim after every commit 65 ms inline and 70 ms on a
    thread. Memory freed between two trims is not lost, only held until the next one, so a trim every 30 s keeps RSS
    bounded at a negligible cost per commit.
    """
    global _last_trim_start
    now = time.monotonic()
    if now - _last_trim_start < min_interval_s or not _trimming.acquire(blocking=False):
        return False
    _last_trim_start = now

    def run() -> None:
        try:
            trim_heap()
        finally:
            _trimming.release()

    threading.Thread(target=run, name="inflight-trim-heap", daemon=True).start()
    return True


class PeakMeter:
    """How much memory a block of code added at its peak, on `device`: for CUDA the caching allocator's peak over what
    was allocated when it started; elsewhere the process's resident high-water mark over its resident size then (Linux:
    `/proc/self/clear_refs` resets the mark). `extra_bytes` is 0 and `measured` False where neither can be done (the
    mark could not be reset: it would measure the process's whole life). Not thread-aware: memory another thread of
    the process allocates meanwhile counts too.

        with PeakMeter(device) as meter:
            publish()
        meter.extra_bytes
    """

    def __init__(self, device: torch.device | str | None) -> None:
        self.cuda = str(device).startswith("cuda")
        self.device, self.extra_bytes, self._base, self.measured = device, 0, 0, self.cuda

    def __enter__(self) -> PeakMeter:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            trim_heap()  # freed pages from before the block would otherwise hide part of its peak
            self._base = _status_kib("VmRSS")
            self.measured = bool(self._base) and _reset_high_water_mark()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch

            self.extra_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
        elif self.measured:
            self.extra_bytes = max(0, _status_kib("VmHWM") - self._base) * 1024


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
