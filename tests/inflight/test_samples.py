"""From groups to samples: the per-token staleness gate and the on-policy probe mask."""

from __future__ import annotations

from inflight.learn.samples import build_samples
from inflight.wire.rollouts import Sampling, Times, make_rollout


def rollout(index: int, versions: list[int], reward: float):
    n = len(versions)
    return make_rollout(prompt_ids=[1, 2], completion_ids=list(range(3, 3 + n)), logprobs=[-1.0] * n,
                        versions=versions, rollout_id=f"g-{index}", group_id="g", group_size=2, index=index,
                        server_id="s@1", model="tiny-llama", reward=reward, finish_reason="length",
                        sampling=Sampling(1.0), times=Times(0.0, 0.0, 0.0))  # fmt: skip


def test_the_gate_masks_stale_and_foreign_versions_and_counts_them():
    # learner at v5, max lag 1: v5 and v4 train; v3 is too stale; v6 came from a dead learner's later life.
    samples, stats = build_samples([[rollout(0, [3, 4, 5, 6], 1.0), rollout(1, [5, 5, 5, 5], 0.0)]], 5, max_lag=1)
    assert samples[0].token_mask == [False, True, True, False]
    assert samples[0].lags == [2, 1, 0, -1]
    assert stats.tokens == 8 and stats.gated == 2
    assert stats.lag_histogram == {2: 1, 1: 1, 0: 5, -1: 1}
    assert samples[0].advantage > 0 > samples[1].advantage


def test_the_mismatch_probe_takes_lag0_tokens_only_after_an_all_lag0_prefix():
    # A sequence begun under v4 and continued under v5 (kv="keep"): its v5 tokens attend to KV computed by v4, so they
    # are not a clean train/inference comparison; a sequence wholly from v5 is, up to its first older token.
    samples, _ = build_samples([[rollout(0, [4, 4, 5, 5], 1.0), rollout(1, [5, 5, 4, 5], 0.0)]], 5, max_lag=2)
    assert samples[0].on_policy_prefix == [False, False, False, False]
    assert samples[1].on_policy_prefix == [True, True, False, False]
