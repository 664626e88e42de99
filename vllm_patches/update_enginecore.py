"""The EngineCore half of a weight update: the utilities `inflight_commit` and `inflight_park`, run inside EngineCore.

The plugin (vllm_patches/plugin.py) adds them to vLLM's EngineCore; the front end calls them with `call_utility_async`
(vllm_patches/update_frontend.py:WeightUpdates); they reach the workers with `collective_rpc`
(vllm_patches/worker_extension.py). EngineCore runs utility calls in `_process_input_queue`, strictly between two
`step()` calls, and on the synchronous step path (the CPU default, `--no-async-scheduling` on GPU) each step's outputs
are stamped with `_weight_version` as the step finishes. Applying the staged weights and setting the version in the one
call `inflight_commit` is therefore what makes per-token versions exact: every token sampled after the commit carries
the new version, every token before it the old one.

A commit is all-or-nothing across tensor-parallel ranks, in two phases inside that one step gap: every rank applies
the update keeping what undoes it and answers (never raises: vLLM's multiprocess executor raises on the first failed
rank and leaves the others' answers unread), then every rank keeps it when all applied, or rolls it back when any did
not (`commit_verdict`, `settle_verdict`: pure). A rank whose rollback fails serves neither version: the error carries
`RANKS_SPLIT`, and the front end stops the engine rather than serve two versions at once.
"""

from __future__ import annotations

import logging
import time

from vllm_patches.rpc import CommitResult, RankCommit, RankSettled, rpc_result

log = logging.getLogger(__name__)

KV_MODES = ("keep", "recompute")
RANKS_SPLIT = "tensor-parallel ranks no longer hold the same weights"


class CommitFailed(RuntimeError):
    """A commit was refused or failed; the message says whether every rank holds its previous weights again."""


def commit_verdict(applied: list[RankCommit]) -> bool:
    """Whether every rank applied the update (then every rank keeps it; else every rank rolls it back)."""
    return bool(applied) and all(outcome.applied is not None for outcome in applied)


def settle_verdict(version: int, applied: list[RankCommit], settled: list[RankSettled]) -> str | None:
    """None when the commit of `version` stands on every rank; else the error to raise: every rank restored, or, when
    a rank could not restore its weights, one naming `RANKS_SPLIT` (the engine must stop)."""
    if commit_verdict(applied) and all(s.done == "kept" for s in settled):
        return None
    failed = "; ".join(f"rank {o.rank}: {o.error}" for o in applied if o.applied is None)
    broken = [f"rank {o.rank} (its own rollback)" for o in applied if not o.restored]
    broken += [f"rank {s.rank} ({s.error})" for s in settled if s.done == "failed"]
    if broken:
        return f"commit of v{version} failed ({failed}) and could not be undone on {', '.join(broken)}: {RANKS_SPLIT}"
    if not commit_verdict(applied):
        return f"commit of v{version} failed ({failed}); every rank holds its previous weights again"
    kept = [s.rank for s in settled if s.done != "kept"]
    return f"commit of v{version} was applied but not kept on ranks {kept}: {RANKS_SPLIT}"


def inflight_commit(self, version: int, kv: str = "keep") -> CommitResult:
    """EngineCore utility: commit the staged update on every worker and set the weight version, in one engine step gap.

    kv="keep" leaves running requests' KV (computed by the old weights) in place; kv="recompute" preempts every running
    request so its KV is recomputed by the new weights. Any rank's failure rolls every rank back and raises with the
    version unchanged; a rollback that fails raises naming `RANKS_SPLIT`.
    """
    if kv not in KV_MODES:
        raise ValueError(f"kv is {kv!r}, expected one of {KV_MODES}")
    start = time.perf_counter()
    version = int(version)
    answers = self.collective_rpc("inflight_commit_staged", args=(version,))
    applied = [rpc_result(a, RankCommit, "inflight_commit_staged") for a in answers]
    keep = commit_verdict(applied)
    answers = self.collective_rpc("inflight_settle_commit", args=(version, keep))
    settled = [rpc_result(a, RankSettled, "inflight_settle_commit") for a in answers]
    error = settle_verdict(version, applied, settled)
    if error is not None:
        (log.critical if RANKS_SPLIT in error else log.error)("%s", error)
        raise CommitFailed(error)
    self._weight_version = str(version)
    tracker = getattr(self.scheduler, "_inflight_kv", None)
    if tracker is not None:
        tracker.version = version  # requests (re)started from the next step on compute KV at the new version
    if kv == "recompute":
        self.reset_prefix_cache(reset_running_requests=True)
        if tracker is not None:
            tracker.prefix_cache_reset()
    return CommitResult(version, time.perf_counter() - start, [o.applied for o in applied])


def inflight_park(self, timeout_s: float) -> bool:
    """EngineCore utility for a paused update only: every worker waits in a blocking call until its update is staged
    (or `timeout_s`); returns True once they all returned.

    Between two RPCs a worker's main thread reads vLLM's shared-memory queue, and for 1 s after each message it reads
    by busy-looping on `sched_yield` (vllm/distributed/device_communicators/shm_broadcast.py, `busy_loop_s`): each turn
    takes the GIL back from the staging thread, which lives in the same process. While decoding, the main thread is in
    `execute_model` and barely reads; paused, nothing comes for the whole transfer, and a keep-pause update (under 1 s
    for SmolLM2 on 2 cores) is staged entirely inside that window. Parked in `inflight_wait_staged`, the main thread
    sleeps on the stage's event instead (BENCHMARKS.md "Weight swap" has what it is worth). The staged signal still
    tells the engine (vllm_patches/update_frontend.py:StagedSignals); this only keeps the workers' main threads out of
    the way."""
    self.collective_rpc("inflight_wait_staged", args=(float(timeout_s),))
    return True
