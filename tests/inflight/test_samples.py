"""From groups to samples: the per-token staleness gate, the KV staleness gate and the on-policy probe mask."""

from __future__ import annotations

import msgspec
import pytest

from inflight.learn.samples import build_samples
from inflight.wire.rollouts import RolloutError, Sampling, Times, decode_rollout, encode_rollout, make_rollout


def rollout(index: int, versions: list[int], reward: float, kv_versions: list[int] = ()):
    n = len(versions)
    return make_rollout(prompt_ids=[1, 2], completion_ids=list(range(3, 3 + n)), logprobs=[-1.0] * n,
                        versions=versions, kv_versions=kv_versions, rollout_id=f"g-{index}", group_id="g",
                        group_size=2, index=index,
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


def test_the_kv_gate_masks_tokens_that_attended_to_kv_older_than_max_kv_lag():
    # A sequence prefilled under v3 and kept across two commits (kv="keep"): its v5 tokens attend to v3's KV.
    kept = rollout(0, [3, 4, 5, 5], 1.0, kv_versions=[3, 3, 3, 3])
    fresh = rollout(1, [5, 5, 5, 5], 0.0, kv_versions=[5, 5, 5, 5])
    samples, stats = build_samples([[kept, fresh]], 5, max_lag=4)
    assert samples[0].kv_lags == [2, 2, 2, 2] and samples[0].token_mask == [True] * 4  # off by default
    assert stats.kv_lag_histogram == {2: 4, 0: 4} and stats.lag_histogram == {2: 1, 1: 1, 0: 6}
    samples, stats = build_samples([[kept, fresh]], 5, max_lag=4, max_kv_lag=1)
    assert samples[0].token_mask == [False] * 4 and samples[1].token_mask == [True] * 4 and stats.gated == 4


def test_a_rollout_without_kv_versions_reads_its_token_versions_as_kv_ages():
    samples, stats = build_samples([[rollout(0, [4, 5], 1.0), rollout(1, [5, 5], 0.0)]], 5, max_lag=1)
    assert samples[0].kv_lags == samples[0].lags == [1, 0] and stats.kv_lag_histogram == {1: 1, 0: 3}
    marked = rollout(0, [4, 5], 1.0, kv_versions=[-1, 4])  # -1: the serve recorded none for that token
    assert marked.kv_ages.tolist() == [4, 4]


@pytest.mark.parametrize(("kv", "message"), [([4, 6], "newer than its token's"), ([4], "kv_versions has 1 entries")])
def test_kv_versions_newer_than_the_token_or_of_another_length_are_refused(kv: list[int], message: str):
    with pytest.raises(RolloutError, match=message):
        decode_rollout(encode_rollout(rollout(0, [4, 5], 1.0, kv_versions=kv)))


def episode(index: int, versions: list[int], reward: float, env: list[bool]):
    """A multi-turn rollout: environment tokens carry version -1 and logprob 0.0, as the serve sends them."""
    n = len(versions)
    return make_rollout(prompt_ids=[1, 2], completion_ids=list(range(3, 3 + n)),
                        logprobs=[0.0 if e else -1.0 for e in env], versions=versions, roles=env,
                        rollout_id=f"g-{index}", group_id="g", group_size=2, index=index, server_id="s@1",
                        model="tiny-llama", reward=reward, finish_reason="stop", sampling=Sampling(1.0),
                        times=Times(0.0, 0.0, 0.0), turns=2)  # fmt: skip


def test_environment_tokens_are_never_trained_nor_gated_nor_in_the_lag_histograms():
    env = [False, False, True, True, False]
    samples, stats = build_samples([[episode(0, [4, 4, -1, -1, 5], 1.0, env), rollout(1, [5, 5], 0.0)]], 5,
                                   max_lag=0)  # fmt: skip
    assert samples[0].token_mask == [False, False, False, False, True]  # v4 gated (lag 1 > 0); env never trains
    assert samples[0].policy == [True, True, False, False, True] and samples[1].policy == []
    assert stats.tokens == 5 and stats.gated == 2 and stats.env_tokens == 2
    assert stats.lag_histogram == {1: 2, 0: 3} and stats.kv_lag_histogram == {1: 2, 0: 3}
    assert stats.turns == [2, 1]


def test_environment_tokens_do_not_end_the_on_policy_prefix():
    samples, _ = build_samples([[episode(0, [5, -1, 5, 4], 1.0, [False, True, False, False]),
                                 rollout(1, [5], 0.0)]], 5, max_lag=1)  # fmt: skip
    assert samples[0].on_policy_prefix == [True, True, True, False]


@pytest.mark.parametrize(("versions", "logprobs", "roles", "message"), [
    ([4, 3], [-1.0, 0.0], [False, True], "version other than -1"),
    ([4, -1], [-1.0, -0.5], [False, True], "logprob other than 0.0"),
    ([4, -1], [-1.0, 0.0], [False, False], "negative versions on policy tokens"),
])  # fmt: skip
def test_environment_tokens_that_claim_a_version_or_a_logprob_are_refused(versions, logprobs, roles, message):
    bad = make_rollout(prompt_ids=[1], completion_ids=[7, 8], logprobs=logprobs, versions=versions, roles=roles,
                       rollout_id="g-0", group_id="g", group_size=1, index=0, server_id="s@1", model="m", reward=0.0,
                       finish_reason="stop", sampling=Sampling(1.0), times=Times(0.0, 0.0, 0.0))  # fmt: skip
    with pytest.raises(RolloutError, match=message):
        decode_rollout(encode_rollout(bad))


def test_token_roles_of_another_length_or_value_are_refused():
    good = episode(0, [4, -1], 0.0, [False, True])
    for roles, message in ((b"\x00", "token_roles has 1 entries"), (b"\x00\x02", "values other than")):
        data = encode_rollout(msgspec.structs.replace(good, token_roles=roles))
        with pytest.raises(RolloutError, match=message):
            decode_rollout(data)
