"""KV age: for every generated token, the weight version that computed the oldest KV it attended to.

A token's version says which weights sampled it; with `kv="keep"` the context it attended to may have been computed by
older weights (the prompt was prefilled before the commit). The oldest such KV is position 0's: a sequence's KV is
computed front to back, and it is recomputed (after a preemption, or `kv="recompute"`, which preempts every running
request at the commit) from the front too. So a request's KV age only changes when the scheduler (re)starts it:

- a fresh start computes position 0 now: KV age = the current version;
- a (re)start on prefix-cache hits reuses cached blocks: KV age = the version that computed the cached first block,
  which this tracker recorded when some request computed that block (keyed by vLLM's block hash, which covers the
  tokens and the cache salt). Assumed: a cached chain's first block is its oldest; vLLM frees a request's blocks tail
  first, so a first block is evicted (and recomputed) no earlier than the blocks after it.

`KvAgeTracker.observe` runs after every `Scheduler.schedule()` (the patch `install` adds; a no-op on schedulers without
a tracker), records `(output index, KV age)` spans per request, and `spans(request_id)` hands them over once. Between
two steps, `inflight_commit` sets the tracker's version; a prefix-cache reset clears the recorded first blocks.
"""

from __future__ import annotations

import re

MAX_FIRST_BLOCKS = 1 << 16  # recorded first-block versions kept (oldest dropped); each is a hash and an int
MAX_UNCLAIMED = 1 << 12  # finished requests whose spans nobody asked for (aborted clients) before the oldest go
_SALT = re.compile(r"inflight-v(\d+)$")


class KvAgeTracker:
    """Per-request KV-age spans; lives on the EngineCore's scheduler as `_inflight_kv`."""

    def __init__(self, version: int):
        self.version = version
        self.first_blocks: dict[object, int] = {}  # block hash of a request's first block -> version that computed it
        self.pending: dict[str, list[tuple[int, int]]] = {}  # request id -> [(first output index, KV age)]

    def observe(self, scheduler, output) -> None:
        """Record the KV age of every request this step starts fresh or resumes."""
        for new in output.scheduled_new_reqs:
            self._start(scheduler.requests.get(new.req_id), new.num_computed_tokens)
        cached = output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                self._start(scheduler.requests.get(req_id), cached.num_computed_tokens[index])

    def _start(self, request, cached_tokens: int) -> None:
        if request is None:
            return
        first = request.block_hashes[0] if request.block_hashes else None
        if cached_tokens > 0 and first is not None:
            age = self.first_blocks.get(first, _salt_version(request.cache_salt, self.version))
        else:
            age = self.version
            if first is not None:
                self._remember(first, age)
        self.pending.setdefault(external_id(request.request_id), []).append((request.num_output_tokens, age))
        if len(self.pending) > MAX_UNCLAIMED:
            self.pending.pop(next(iter(self.pending)))

    def _remember(self, block_hash, version: int) -> None:
        self.first_blocks.pop(block_hash, None)  # re-insert: the dict's order is recency
        self.first_blocks[block_hash] = version
        if len(self.first_blocks) > MAX_FIRST_BLOCKS:
            self.first_blocks.pop(next(iter(self.first_blocks)))

    def spans(self, request_id: str) -> list[tuple[int, int]]:
        """The request's `(first output index, KV age)` spans, once (then forgotten); [] if none were recorded."""
        return self.pending.pop(request_id, [])

    def prefix_cache_reset(self) -> None:
        self.first_blocks.clear()


def external_id(internal: str) -> str:
    """The id the client gave: vLLM's input processor appends "-" and 8 random characters (unless
    VLLM_DISABLE_REQUEST_ID_RANDOMIZATION), and the scheduler's Request keeps only that internal id."""
    from vllm import envs

    if envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION or len(internal) < 10 or internal[-9] != "-":
        return internal
    return internal[:-9]


def _salt_version(salt: str | None, default: int) -> int:
    """A cached first block nobody recorded (dropped from the bounded map): the cache salt's version is a lower bound
    on the version that computed it (a request salted v is submitted at v or later)."""
    match = _SALT.match(salt or "")
    return int(match.group(1)) if match else default


def kv_ages(spans: list[tuple[int, int]], n_tokens: int) -> list[int]:
    """Expand spans to one KV age per output token; a token before the first span (none recorded) gets -1."""
    ages = [-1] * n_tokens
    for k, (start, age) in enumerate(spans):
        stop = spans[k + 1][0] if k + 1 < len(spans) else n_tokens
        for i in range(max(start, 0), min(stop, n_tokens)):
            ages[i] = age
    return ages


def install() -> None:
    """Wrap `Scheduler.schedule` so a scheduler carrying a tracker reports every step's starts to it. Idempotent."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.schedule
    if getattr(original, "_inflight_kv_age", False):
        return

    def schedule(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        tracker = getattr(self, "_inflight_kv", None)
        if tracker is not None:
            tracker.observe(self, output)
        return output

    schedule._inflight_kv_age = True
    Scheduler.schedule = schedule
