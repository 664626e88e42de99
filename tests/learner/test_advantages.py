"""Group advantages (learner/advantages.py) against plain Python loops over each group."""

from __future__ import annotations

import math

import pytest
import torch

from learner.advantages import group_advantages


def reference(rows: list[list[float]], kind: str, eps: float) -> list[list[float]]:
    out = []
    for row in rows:
        n = len(row)
        mean = sum(row) / n
        if kind == "mean":
            out.append([r - mean for r in row])
        elif kind == "std":
            std = math.sqrt(sum((r - mean) ** 2 for r in row) / n)
            out.append([(r - mean) / (std + eps) for r in row])
        else:
            out.append([r - (sum(row) - r) / (n - 1) for r in row])
    return out


@pytest.mark.parametrize("seed", (0, 1, 2))
@pytest.mark.parametrize("kind", ("mean", "std", "loo"))
def test_advantages_match_python_loop(kind: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    rewards[1] = (rewards[1] > 0).double()  # a 0/1 reward group, as verifiable tasks give
    expected = torch.tensor(reference(rewards.tolist(), kind, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(group_advantages(rewards, kind), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ("mean", "std", "loo"))
def test_group_with_equal_rewards_gets_zero_advantage(kind: str) -> None:
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]])
    adv = group_advantages(rewards, kind)
    assert torch.equal(adv[0], torch.zeros(4))
    assert torch.isfinite(adv).all()


def test_std_advantages_have_unit_root_mean_square_per_group() -> None:
    rewards = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    adv = group_advantages(rewards, "std", eps=0.0)
    torch.testing.assert_close(adv.pow(2).mean(dim=1), torch.ones(4, dtype=torch.float64))


def test_integer_rewards_are_promoted_to_float32() -> None:
    adv = group_advantages(torch.tensor([[0, 1, 1, 0]]), "mean")
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 0.5, 0.5, -0.5]]))


def test_unknown_kind_raises_naming_the_kind() -> None:
    with pytest.raises(ValueError, match="advantage kind is 'median'"):
        group_advantages(torch.zeros(2, 4), "median")


def test_leave_one_out_with_single_sample_groups_raises() -> None:
    with pytest.raises(ValueError, match="samples_per_group is 1"):
        group_advantages(torch.zeros(3, 1), "loo")


def test_flat_rewards_raise_asking_for_groups() -> None:
    with pytest.raises(ValueError, match="rewards has shape"):
        group_advantages(torch.zeros(8), "mean")


def test_negative_eps_raises() -> None:
    with pytest.raises(ValueError, match="eps is -1"):
        group_advantages(torch.zeros(2, 4), "std", eps=-1.0)
