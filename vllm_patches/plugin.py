"""vLLM general plugin (entry point `vllm.general_plugins: inflight`): adds the `inflight_commit`, `inflight_park`,
`inflight_track_kv`, `inflight_kv_spans` and `inflight_routes` utilities to EngineCore, and the KV-age hook to the
scheduler (vllm_patches/kv_age.py).

vLLM loads general plugins in every process; `register` is idempotent and only adds a method. EngineCore runs utility
calls in `_process_input_queue`, strictly between two `step()` calls, and on the synchronous step path (the CPU
default, `--no-async-scheduling` on GPU) each step's outputs are stamped with `_weight_version` as the step finishes.
Applying the staged weights and setting the version in this one call is therefore what makes per-token versions
exact: every token sampled after the commit carries the new version, every token before it the old one.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time

from vllm_patches.kv_age import KvAgeTracker, install
from vllm_patches.rpc import CommitResult

KV_MODES = ("keep", "recompute")


def inflight_commit(self, version: int, kv: str = "keep") -> CommitResult:
    """EngineCore utility: commit the staged update on every worker and set the weight version, in one engine step gap.

    kv="keep" leaves running requests' KV (computed by the old weights) in place; kv="recompute" preempts every running
    request so its KV is recomputed by the new weights. A worker failure leaves the version unchanged and re-raises.
    """
    if kv not in KV_MODES:
        raise ValueError(f"kv is {kv!r}, expected one of {KV_MODES}")
    start = time.perf_counter()
    workers = self.collective_rpc("inflight_commit_staged", args=(int(version),))
    self._weight_version = str(int(version))
    tracker = getattr(self.scheduler, "_inflight_kv", None)
    if tracker is not None:
        tracker.version = int(version)  # requests (re)started from the next step on compute KV at the new version
    if kv == "recompute":
        self.reset_prefix_cache(reset_running_requests=True)
        if tracker is not None:
            tracker.prefix_cache_reset()
    return CommitResult(int(version), time.perf_counter() - start, workers)  # workers: CommitApplied each


def inflight_park(self, timeout_s: float) -> bool:
    """EngineCore utility for a paused update only: every worker waits in a blocking call until its update is staged
    (or `timeout_s`); returns True once they all returned.

    Between two RPCs a worker's main thread reads vLLM's shared-memory queue, and for 1 s after each message it reads
    by busy-looping on `sched_yield` (vllm/distributed/device_communicators/shm_broadcast.py, `busy_loop_s`): each turn
    takes the GIL back from the staging thread, which lives in the same process. While decoding, the main thread is in
    `execute_model` and barely reads; paused, nothing comes for the whole transfer, and a keep-pause update (under 1 s
    for SmolLM2 on 2 cores) is staged entirely inside that window. Parked in `inflight_wait_staged`, the main thread
    sleeps on the stage's event instead (BENCHMARKS.md "Weight swap" has what it is worth). The staged signal still
    tells the engine (vllm_patches/updates.py); this only keeps the workers' main threads out of the way."""
    self.collective_rpc("inflight_wait_staged", args=(float(timeout_s),))
    return True


def inflight_track_kv(self, version: int) -> int:
    """EngineCore utility: set the weight version and record every token's KV age from now on (InflightEngine.start)."""
    self._weight_version = str(int(version))
    self.scheduler._inflight_kv = KvAgeTracker(int(version))
    return int(version)


def inflight_kv_spans(self, request_id: str) -> list[tuple[int, int]]:
    """EngineCore utility: a finished request's `(first output index, KV age)` spans, handed over once."""
    tracker = getattr(self.scheduler, "_inflight_kv", None)
    return [] if tracker is None else tracker.spans(request_id)


def inflight_routes(self, request_id: str):
    """EngineCore utility: a finished request's routed experts (vllm_patches/routes.py:RoutedExperts), handed over
    once; None unless the workers record routes. Every tensor-parallel rank routes the same tokens alike: rank 0's."""
    return self.collective_rpc("inflight_take_routes", args=(request_id,))[0]


def register() -> None:
    # Imported here: vLLM loads its general plugins while it is itself being imported and set up in every process.
    from vllm.v1.engine.core import EngineCore

    for method in (inflight_commit, inflight_park, inflight_track_kv, inflight_kv_spans, inflight_routes):
        if getattr(EngineCore, method.__name__, None) is not method:
            setattr(EngineCore, method.__name__, method)
    install()
    _exit_with_parent()


def _exit_with_parent(poll_s: float = 1.0, grace_s: float = 10.0) -> None:
    """In vLLM's child processes (EngineCore, workers): exit when the process that started this one is gone.

    A serve killed with -9 cannot stop its engine; vLLM's EngineCore does not notice and would keep its weights and KV
    cache (GBs) for ever, and a supervisor that restarts the serve would pile them up. A daemon thread watches the
    parent pid; when it changes (re-parented), SIGTERM runs vLLM's own shutdown, and after `grace_s` the process exits
    regardless.
    """
    watching = any(t.name == "inflight-parent-watch" for t in threading.enumerate())
    if multiprocessing.parent_process() is None or watching:
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(
            f"inflight: parent process {parent} is gone; stopping {multiprocessing.current_process().name} "
            f"(pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="inflight-parent-watch", daemon=True).start()
