"""Group advantages (inflight/learn/samples.py:group_advantages) against plain Python loops over each group."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import check_within, float64_bound, sum_bound

from inflight.learn.samples import group_advantages


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
    got = group_advantages(rewards, kind)
    # float64 against a float64 loop: an advantage is a chain of two n-term sums (the mean, the std) and a few
    # elementwise roundings, on terms of size max|r| + mean|r| in units of the result (÷ std, × n/(n−1) for loo).
    n = rewards.shape[1]
    std = rewards.std(dim=1, unbiased=False) + 1e-6 if kind == "std" else torch.ones(5, dtype=torch.float64)
    scale = float(((rewards.abs().amax(1) + rewards.abs().mean(1)) / std).max()) * n / (n - 1)
    check_within((got - expected).abs().max(), float64_bound(2 * n + 5, scale), f"{kind} advantages vs loop")


@pytest.mark.parametrize("kind", ("mean", "std", "loo"))
def test_group_with_equal_rewards_gets_zero_advantage(kind: str) -> None:
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]])
    adv = group_advantages(rewards, kind)
    assert torch.equal(adv[0], torch.zeros(4))
    assert torch.isfinite(adv).all()


def test_std_advantages_have_unit_root_mean_square_per_group() -> None:
    rewards = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    adv = group_advantages(rewards, "std", eps=0.0)
    # Exactly 1 in real arithmetic. Each float64 advantage errs by at most γ_{2n+5}·(max|r| + mean|r|)/std (see
    # above), its square twice that relative, and the mean of n squares adds γ_{n+1}.
    n = rewards.shape[1]
    scale = float(((rewards.abs().amax(1) + rewards.abs().mean(1)) / rewards.std(dim=1, unbiased=False)).max())
    adv_error = sum_bound(torch.float64, 2 * n + 5, scale)
    bound = 2 * float(adv.abs().max()) * adv_error + sum_bound(torch.float64, n + 1, 1.0)
    check_within((adv.pow(2).mean(dim=1) - 1).abs().max(), bound, "root-mean-square - 1")


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
