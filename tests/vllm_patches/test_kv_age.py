"""KvAgeTracker's bookkeeping (vllm_patches/kv_age.py) on stand-ins for vLLM's scheduler objects: the prefix-cache and
id cases the real-engine tests (test_inflight.py) do not reach. The engine-level behaviour is asserted there."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_patches.kv_age import KvAgeTracker, external_id, kv_ages


def request(rid: str, first_block: str | None, outputs: int = 0, salt: str = "inflight-v0"):
    return SimpleNamespace(request_id=f"{rid}-abcd1234", block_hashes=[first_block] if first_block else [],
                           num_output_tokens=outputs, cache_salt=salt)  # fmt: skip


def step(tracker: KvAgeTracker, requests: dict, new: list[tuple[str, int]] = (), resumed: list[tuple[str, int]] = ()):
    """One schedule() output: `new` / `resumed` as (internal id, tokens found in the prefix cache)."""
    cached = SimpleNamespace(req_ids=[r for r, _ in resumed], resumed_req_ids={r for r, _ in resumed},
                             num_computed_tokens=[n for _, n in resumed])  # fmt: skip
    output = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=n) for r, n in new],
                             scheduled_cached_reqs=cached)  # fmt: skip
    tracker.observe(SimpleNamespace(requests=requests), output)


def test_a_prefix_hit_inherits_the_version_that_computed_the_cached_first_block():
    tracker = KvAgeTracker(version=3)
    a, b = request("a", "blk0"), request("b", "blk0")  # same prompt, same salt: b hits a's blocks
    step(tracker, {a.request_id: a}, new=[(a.request_id, 0)])
    tracker.version = 4  # a commit with kv="keep"; b was queued before it, salted v3, scheduled after it
    step(tracker, {b.request_id: b}, new=[(b.request_id, 16)])
    assert tracker.spans("a") == [(0, 3)] and tracker.spans("b") == [(0, 3)]
    c = request("c", "blk0")
    tracker.prefix_cache_reset()  # kv="recompute" clears the cache: c computes block 0 afresh at v4
    step(tracker, {c.request_id: c}, new=[(c.request_id, 0)])
    assert tracker.spans("c") == [(0, 4)]


def test_a_resumed_request_starts_a_new_span_at_its_next_output_token():
    tracker = KvAgeTracker(version=0)
    a = request("a", "blk0")
    step(tracker, {a.request_id: a}, new=[(a.request_id, 0)])
    a.num_output_tokens, tracker.version = 5, 1
    tracker.prefix_cache_reset()
    step(tracker, {a.request_id: a}, resumed=[(a.request_id, 0)])  # preempted, recomputed under v1
    assert tracker.spans("a") == [(0, 0), (5, 1)]
    assert tracker.spans("a") == []  # handed over once


def test_spans_expand_to_one_kv_age_per_token_and_unrecorded_tokens_are_minus_one():
    assert kv_ages([(0, 2), (3, 5)], 6) == [2, 2, 2, 5, 5, 5]
    assert kv_ages([], 3) == [-1, -1, -1]
    assert kv_ages([(2, 7)], 4) == [-1, -1, 7, 7]


def test_vllms_internal_request_ids_map_back_to_the_clients():
    assert external_id("group-7:3-1a2b3c4d") == "group-7:3"
    assert external_id("short") == "short"
