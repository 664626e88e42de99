"""From complete groups to training samples: group advantages and the per-token staleness gate.

Group-relative advantages (`group_advantages`): one scalar per sample from the rewards of the n samples of its
prompt, broadcast to its completion tokens. No value model: the group itself is the baseline. `--advantage`:
- `mean`: r_i − mean(r). The plain group baseline (Dr. GRPO style, no length or scale normalisation).
- `std`: (r_i − mean(r)) / (std(r) + eps), GRPO's normalisation. The std is the population std (unbiased=False):
  then the normalised advantages of a group have root-mean-square exactly 1 (up to eps) whatever n is, and a group
  whose rewards are all equal gets advantage 0, not 0/0.
- `loo`: r_i − mean of the other n−1 rewards (RLOO), an unbiased baseline since it excludes the sample's own reward.
  Equals n/(n−1) · (r_i − mean(r)); needs n ≥ 2.

Called by the learner's rank 0 once per step. lag = learner version − token version, per token; a token whose lag
exceeds `max_lag` is masked out of the loss (and counted), so a long rollout that straddled several updates still
trains on its fresh tail. kv lag = learner version − the version of the oldest KV the token attended to (≥ its lag;
larger after a commit with kv="keep"); with `max_kv_lag` ≥ 0 a token whose kv lag exceeds it is gated too. A sample
whose every token is gated contributes nothing but is still consumed.

Environment tokens of a multi-turn episode (the rollout's `token_roles`) are context only: never a loss term, not
counted as gated, left out of the lag histograms (they have no version), counted in `GateStats.env_tokens`.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
import numpy as np
import torch

from inflight.learn.config import ADVANTAGE_KINDS
from inflight.wire.rollouts import Rollout, Routes, routes_of

_encoder = msgspec.msgpack.Encoder()


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
    policy: list[bool] = field(default_factory=list)  # per token, False for an environment token; empty = all policy
    routes: Routes | None = None  # the MoE routes its tokens were sampled under (--routing-replay on)

    @property
    def on_policy_prefix(self) -> list[bool]:
        """Tokens sampled by the learner's current version after a completion prefix that was too (lag 0 all along).

        The probe for train/inference mismatch. With kv="keep", a lag-0 token late in a sequence begun under older
        weights attends to KV those weights computed, while the learner recomputes that prefix with its own: the gap
        there measures staleness, not mismatch. (Token i's KV context comes from the steps that sampled tokens 0..i.)
        """
        # an environment token is the same context for both sides: it does not end the prefix (nor is it a probe token:
        # the probe is taken under token_mask, which excludes it)
        policy = self.policy or [True] * len(self.lags)
        fresh = (lag == 0 or not p for lag, p in zip(self.lags, policy, strict=True))
        return list(itertools.accumulate(fresh, operator.and_))


@dataclass
class GateStats:
    """What the gate did to one step's batch: policy tokens and how many were gated, the lag histograms, and per
    sample its reward, turns and environment tokens (the StepMetrics fields of inflight/learn/app.py:step_values)."""

    tokens: int = 0
    gated: int = 0
    lag_histogram: Counter = field(default_factory=Counter)
    kv_lag_histogram: Counter = field(default_factory=Counter)
    rewards: list[float] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)
    env_tokens: int = 0  # environment tokens of the batch (context, never trained; not in `tokens`)
    turns: list[int] = field(default_factory=list)  # policy turns of each sample
    env_lengths: list[int] = field(default_factory=list)  # environment tokens of each sample
    # --routing-replay on: what the routes added to the batch's records (their encoded bytes) and the prompt and
    # completion tokens of the records that carry them
    route_bytes: int = 0
    routed_tokens: int = 0


class GatedBatch(NamedTuple):
    """One step's samples (broadcast to every rank) and the gate's statistics of them (rank 0's metrics line)."""

    samples: list[GatedSample]
    stats: GateStats


def build_samples(
    groups: list[list[Rollout]], version: int, max_lag: int, advantage_kind: str = "mean", max_kv_lag: int = -1
) -> GatedBatch:
    """Every rollout of `groups` as a sample gated at the learner's `version`, with its group's advantage."""
    stats = GateStats()
    samples = []
    for group in groups:
        stats.group_ids.append(group[0].group_id)
        rewards = torch.tensor([[r.reward for r in group]], dtype=torch.float64)
        advantages = group_advantages(rewards, kind=advantage_kind)[0].tolist()
        for rollout, adv in zip(group, advantages, strict=True):
            samples.append(_gate(rollout, float(adv), version, max_lag, max_kv_lag, stats))
    return GatedBatch(samples, stats)


def group_advantages(rewards: torch.Tensor, kind: str = "mean", eps: float = 1e-6) -> torch.Tensor:
    """Advantages for `rewards` of shape [G groups, n samples per group]; returns the same shape.

    Integer or bool rewards are promoted to float32; floating rewards keep their dtype.
    """
    if kind not in ADVANTAGE_KINDS:
        raise ValueError(f"advantage kind is {kind!r}, expected one of {ADVANTAGE_KINDS}")
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)}, expected [groups, samples_per_group]: "
            "reshape the batch to one row per prompt group"
        )
    if eps < 0:
        raise ValueError(f"eps is {eps}, expected >= 0")
    n = rewards.shape[1]
    if kind == "loo" and n < 2:
        raise ValueError(f"samples_per_group is {n}, expected >= 2 for kind='loo': use kind='mean' or larger groups")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)

    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if kind == "mean":
        return centred
    if kind == "std":
        return centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred * (n / (n - 1))


def _gate(
    rollout: Rollout, advantage: float, version: int, max_lag: int, max_kv_lag: int, stats: GateStats
) -> GatedSample:
    """One rollout's staleness gate; its policy tokens counted into `stats`."""
    policy = rollout.policy_mask
    # A negative lag is a token from a version this learner never made: one published by a previous life of a learner
    # that was killed and resumed from an older checkpoint. That policy is gone: gate it too.
    lags = np.where(policy, version - rollout.versions.astype(np.int64), 0)
    kv_lags = np.where(policy, version - rollout.kv_ages.astype(np.int64), 0)
    keep = policy & (lags >= 0) & (lags <= max_lag) & ((max_kv_lag < 0) | (kv_lags <= max_kv_lag))
    stats.tokens += int(policy.sum())
    stats.gated += int((policy & ~keep).sum())
    stats.env_tokens += int((~policy).sum())
    stats.lag_histogram.update(lags[policy].tolist())
    stats.kv_lag_histogram.update(kv_lags[policy].tolist())
    stats.rewards.append(rollout.reward)
    stats.turns.append(rollout.turns)
    stats.env_lengths.append(int((~policy).sum()))
    routes = routes_of(rollout)
    if routes is not None:
        stats.route_bytes += len(_encoder.encode({"routes": routes})) - 1  # the record's extra key and value
        stats.routed_tokens += len(rollout.prompt) + len(policy)
    return GatedSample(
        rollout.prompt.tolist(),
        rollout.completion.tolist(),
        rollout.logprobs.tolist(),
        advantage,
        keep.tolist(),
        lags.tolist(),
        kv_lags.tolist(),
        [] if policy.all() else policy.tolist(),
        routes,
    )
