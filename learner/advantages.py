"""Group-relative advantages: one scalar per sample, computed from the rewards of the n samples of its prompt.

The learner step calls `group_advantages` on a batch of complete groups (rollouts of one prompt) and broadcasts each
sample's advantage to its completion tokens. No value model: the group itself is the baseline.

Kinds:
- `mean`: r_i − mean(r). The plain group baseline (Dr. GRPO style, no length or scale normalisation).
- `std`: (r_i − mean(r)) / (std(r) + eps), GRPO's normalisation. The std is the population std (unbiased=False):
  then the normalised advantages of a group have root-mean-square exactly 1 (up to eps) whatever n is, and a group
  whose rewards are all equal gets advantage 0, not 0/0.
- `loo`: r_i − mean of the other n−1 rewards (RLOO), an unbiased baseline since it excludes the sample's own reward.
  Equals n/(n−1) · (r_i − mean(r)); needs n ≥ 2.
"""

from __future__ import annotations

import torch

ADVANTAGE_KINDS = ("mean", "std", "loo")


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
