"""From complete groups to training samples: group advantages and the per-token staleness gate.

Called by the learner's rank 0 once per step. lag = learner version − token version, per token; a token whose lag
exceeds `max_lag` is masked out of the loss (and counted), so a long rollout that straddled several updates still
trains on its fresh tail. kv lag = learner version − the version of the oldest KV the token attended to (≥ its lag;
larger after a commit with kv="keep"); with `max_kv_lag` ≥ 0 a token whose kv lag exceeds it is gated too. A sample
whose every token is gated contributes nothing but is still consumed.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from inflight.wire.rollouts import Rollout


@dataclass
class GatedSample:
    """One rollout as the learner trains it: its tokens, advantage, the staleness gate's mask and each token's lag.

    Not `learner.step.Sample` (what `train_step` takes): this one also carries the lags, broadcast to every rank."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    token_mask: list[bool]
    lags: list[int]
    kv_lags: list[int] = field(default_factory=list)  # learner version − version of the oldest KV attended to

    @property
    def on_policy_prefix(self) -> list[bool]:
        """Tokens sampled by the learner's current version after a completion prefix that was too (lag 0 all along).

        The probe for train/inference mismatch. With kv="keep", a lag-0 token late in a sequence begun under older
        weights attends to KV those weights computed, while the learner recomputes that prefix with its own: the gap
        there measures staleness, not mismatch. (Token i's KV context comes from the steps that sampled tokens 0..i.)
        """
        return list(itertools.accumulate((lag == 0 for lag in self.lags), operator.and_))


@dataclass
class GateStats:
    tokens: int = 0
    gated: int = 0
    lag_histogram: Counter = field(default_factory=Counter)
    kv_lag_histogram: Counter = field(default_factory=Counter)
    rewards: list[float] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)


def build_samples(groups: list[list[Rollout]], version: int, max_lag: int, advantage_kind: str = "mean",
                  max_kv_lag: int = -1) -> tuple[list[GatedSample], GateStats]:  # fmt: skip
    from learner.advantages import group_advantages

    stats = GateStats()
    samples = []
    for group in groups:
        stats.group_ids.append(group[0].group_id)
        rewards = torch.tensor([[r.reward for r in group]], dtype=torch.float64)
        advantages = group_advantages(rewards, kind=advantage_kind)[0].tolist()
        for rollout, adv in zip(group, advantages, strict=True):
            lags = (version - rollout.versions.astype(np.int64)).tolist()
            # A negative lag is a token from a version this learner never made: one published by a previous life of
            # a learner that was killed and resumed from an older checkpoint. That policy is gone: gate it too.
            kv_lags = (version - rollout.kv_ages.astype(np.int64)).tolist()
            kv_ok = [max_kv_lag < 0 or kv <= max_kv_lag for kv in kv_lags]
            keep = [0 <= lag <= max_lag and ok for lag, ok in zip(lags, kv_ok, strict=True)]
            stats.tokens += len(lags)
            stats.gated += keep.count(False)
            stats.lag_histogram.update(lags)
            stats.kv_lag_histogram.update(kv_lags)
            stats.rewards.append(rollout.reward)
            samples.append(GatedSample(rollout.prompt.tolist(), rollout.completion.tolist(), rollout.logprobs.tolist(),
                                  float(adv), keep, lags, kv_lags))  # fmt: skip
    return samples, stats
