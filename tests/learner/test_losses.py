"""Policy losses (learner/losses.py) against a float64 reference written token by token with hand-derived gradients."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from tolerances import assert_within, check_within, float64_bound, sum_bound, unit_roundoff

from learner.losses import LossConfig, policy_loss

KINDS = ("tis", "ppo", "mask")
AGGREGATIONS = ("token", "sequence")
SEEDS = (0, 1, 2)


@dataclass
class Batch:
    logp: torch.Tensor
    behaviour_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    seq_ids: torch.Tensor


def make_batch(seed: int, n_seq: int = 6, max_len: int = 12) -> Batch:
    """Sequences of random length with non-contiguous ids, ~25 % masked tokens and one fully masked sequence.

    Log-ratios are uniform in [-1.3, 1.3], so ratios in [0.27, 3.7] fall on both sides of every cap, clip and band.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, max_len + 1, (n_seq,), generator=gen)
    seq_ids = torch.repeat_interleave(torch.arange(n_seq) * 3 + 7, lengths)
    n = seq_ids.numel()
    logp = -3 * torch.rand(n, generator=gen) - 0.05
    log_ratio = (torch.rand(n, generator=gen) * 2 - 1) * 1.3
    per_seq_adv = torch.randn(n_seq, generator=gen)
    advantages = torch.repeat_interleave(per_seq_adv, lengths) + 0.1 * torch.randn(n, generator=gen)
    mask = torch.rand(n, generator=gen) > 0.25
    mask[seq_ids == seq_ids[lengths[0]]] = False  # the second sequence is entirely masked
    return Batch(logp, logp - log_ratio, advantages, mask, seq_ids)


def reference_token(kind: str, cfg: LossConfig, lp: float, blp: float, adv: float) -> tuple[float, float, bool]:
    """(loss value, d loss / d logp, trust region hit) for one unmasked token, in float64 Python arithmetic."""
    r = math.exp(lp - blp)
    if kind == "tis":
        w = min(r, cfg.tis_cap)
        return -adv * w * lp, -adv * w, r > cfg.tis_cap
    if kind == "ppo":
        # d(ratio)/d(logp) = ratio. The clipped branch is chosen only when the ratio lies outside the clip range,
        # where clip() is constant, so its gradient is 0.
        lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
        clipped = min(max(r, lo), hi) * adv
        if clipped < r * adv:
            return -clipped, 0.0, True
        return -r * adv, -adv * r, False
    if cfg.mask_low <= r <= cfg.mask_high:
        return -adv * r, -adv * r, False
    return 0.0, 0.0, True


def reference_loss(batch: Batch, cfg: LossConfig) -> tuple[float, list[float], dict[str, float], float]:
    """Loss, gradient w.r.t. every logp, the metrics, and Σ|term| of the loss's sum (the `scale` of its rounding
    error), by loops over tokens."""
    n = len(batch.logp)
    values, grads, hits = [0.0] * n, [0.0] * n, []
    counts: dict[int, int] = {}
    for t in range(n):
        if not bool(batch.mask[t]):
            continue
        lp, blp, adv = float(batch.logp[t]), float(batch.behaviour_logp[t]), float(batch.advantages[t])
        values[t], grads[t], hit = reference_token(cfg.kind, cfg, lp, blp, adv)
        hits.append(hit)
        sid = int(batch.seq_ids[t])
        counts[sid] = counts.get(sid, 0) + 1
    kept = [t for t in range(n) if bool(batch.mask[t])]
    if cfg.aggregation == "token":
        scale = {t: 1.0 / len(kept) for t in kept}
    else:  # sequences with no unmasked token are absent from `counts`
        scale = {t: 1.0 / (len(counts) * counts[int(batch.seq_ids[t])]) for t in kept}
    loss = sum(values[t] * scale[t] for t in kept)
    loss_scale = sum(abs(values[t]) * scale[t] for t in kept)
    grad = [grads[t] * scale[t] if t in scale else 0.0 for t in range(n)]
    ratios = [math.exp(float(batch.logp[t]) - float(batch.behaviour_logp[t])) for t in kept]
    metrics = {
        "tokens": float(len(kept)),
        "clip_fraction": sum(hits) / len(kept),
        "ess": sum(ratios) ** 2 / (len(kept) * sum(w * w for w in ratios)),
        "mean_abs_logratio": sum(abs(math.log(w)) for w in ratios) / len(kept),
    }
    return loss, grad, metrics, loss_scale


def token_roundings(batch: Batch) -> float:
    """Roundings behind one token's loss term or gradient, relative to its size: fl(logp − behaviour) errs by
    u·|log ratio|, so the ratio by u·(|log ratio| + 1) relative; then up to 5 products, quotients and clamps."""
    return float((batch.logp - batch.behaviour_logp)[batch.mask].abs().max()) + 6


def run_loss(batch: Batch, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    logp = batch.logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, batch.behaviour_logp, batch.advantages, batch.mask, batch.seq_ids, cfg)
    loss.backward()
    return loss.detach(), logp.grad, metrics


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_loss_value_gradient_and_metrics_match_float64_token_loop(kind: str, aggregation: str, seed: int) -> None:
    cfg = LossConfig(kind=kind, aggregation=aggregation)
    batch = make_batch(seed)
    ref_loss, ref_grad, ref_metrics, loss_scale = reference_loss(batch, cfg)
    assert 0 < ref_metrics["clip_fraction"] < 1, "the batch must put ratios on both sides of the trust region"

    loss, grad, metrics = run_loss(batch, cfg)

    # fp32 against float64 loops: the loss sums n terms, each rounded `token_roundings` times relative to itself; a
    # gradient entry is one token's term, no sum (the float64 reference's own error is ~1e-9 of these, left out).
    n, k = len(batch.logp), token_roundings(batch)
    check_within(abs(loss.item() - ref_loss), sum_bound(torch.float32, n + k, loss_scale), "loss")
    ref_grad = torch.tensor(ref_grad, dtype=torch.float64)
    assert_within(grad, ref_grad, sum_bound(torch.float32, k, float(ref_grad.abs().max())), "gradient")
    # The metrics are float64 sums of fp32 log ratios, each rounded once: relative u·|log ratio| on a ratio, so at
    # most 4× that on ess ((Σr)² / Σr²) and u on mean |log ratio|, plus their float64 sums. Counts are exact.
    lr_max = float((batch.logp - batch.behaviour_logp)[batch.mask].abs().max())
    relative = {"tokens": 0.0, "clip_fraction": 0.0, "ess": 4 * unit_roundoff(torch.float32) * lr_max,
                "mean_abs_logratio": unit_roundoff(torch.float32)}  # fmt: skip
    assert metrics.keys() == ref_metrics.keys()
    for key, value in ref_metrics.items():
        bound = (relative[key] + float64_bound(2 * n + 4, 1.0)) * abs(value) if relative[key] else 0.0
        check_within(abs(metrics[key] - value), bound, key)


@pytest.mark.parametrize("kind", KINDS)
def test_on_policy_gradient_is_minus_advantage_for_every_kind(kind: str) -> None:
    batch = make_batch(3)
    batch.behaviour_logp = batch.logp.clone()
    _, grad, metrics = run_loss(batch, LossConfig(kind=kind))
    kept = batch.mask.sum()
    expected = torch.where(batch.mask, -batch.advantages / kept, 0.0)
    # The ratio is exp(0) = 1 exactly: -A·1·(1/N) against -A/N, 2 roundings against 1.
    assert_within(grad, expected, sum_bound(torch.float32, 3, float(expected.abs().max())), "on-policy gradient")
    assert metrics["clip_fraction"] == 0.0
    assert metrics["ess"] == pytest.approx(1.0)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_masked_tokens_with_inf_and_nan_fields_change_nothing(kind: str, aggregation: str) -> None:
    cfg = LossConfig(kind=kind, aggregation=aggregation)
    clean = make_batch(4)
    dirty = make_batch(4)
    masked = ~dirty.mask
    dirty.behaviour_logp[masked] = float("-inf")
    dirty.advantages[masked] = float("nan")
    dirty.logp[masked] = float("-inf")

    clean_loss, clean_grad, clean_metrics = run_loss(clean, cfg)
    dirty_loss, dirty_grad, dirty_metrics = run_loss(dirty, cfg)

    assert torch.isfinite(dirty_loss) and torch.isfinite(dirty_grad).all()
    # Bit for bit: masked fields are replaced before any arithmetic, so both runs do the same operations on the same
    # values in one process.
    torch.testing.assert_close(dirty_loss, clean_loss, rtol=0, atol=0)
    torch.testing.assert_close(dirty_grad, clean_grad, rtol=0, atol=0)
    assert dirty_metrics == clean_metrics


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_all_masked_batch_gives_zero_loss_connected_to_logp(kind: str, aggregation: str) -> None:
    batch = make_batch(5)
    batch.mask[:] = False
    loss, metrics = policy_loss(
        batch.logp.requires_grad_(True),
        batch.behaviour_logp,
        batch.advantages,
        batch.mask,
        batch.seq_ids,
        LossConfig(kind=kind, aggregation=aggregation),
    )
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert torch.equal(batch.logp.grad, torch.zeros_like(batch.logp))
    assert metrics == {"tokens": 0.0, "clip_fraction": 0.0, "ess": 0.0, "mean_abs_logratio": 0.0}


def test_sequence_aggregation_weights_each_sequence_equally() -> None:
    # Two sequences of 1 and 3 on-policy tokens, advantage 1: every sequence mean is −1, whatever its length.
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.7], requires_grad=True)
    args = (logp.detach(), torch.ones(4), torch.ones(4, dtype=torch.bool), torch.tensor([0, 1, 1, 1]))
    loss, _ = policy_loss(logp, *args, LossConfig(kind="mask", aggregation="sequence"))
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    torch.testing.assert_close(logp.grad, torch.tensor([-1 / 2, -1 / 6, -1 / 6, -1 / 6]))


def split_by_sequence(batch: Batch, n_first: int) -> tuple[Batch, Batch]:
    """The first `n_first` sequences and the rest, as two data-parallel ranks would hold them."""
    boundary = int((batch.seq_ids == batch.seq_ids.unique()[n_first]).nonzero()[0])
    fields = ("logp", "behaviour_logp", "advantages", "mask", "seq_ids")
    first = Batch(*(getattr(batch, f)[:boundary] for f in fields))
    second = Batch(*(getattr(batch, f)[boundary:] for f in fields))
    return first, second


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_rank_losses_with_global_normalizer_sum_to_whole_batch_loss(kind: str, aggregation: str) -> None:
    cfg = LossConfig(kind=kind, aggregation=aggregation)
    whole = make_batch(6)
    # A check of logic (two ways to one loss), so in float64.
    for field in ("logp", "behaviour_logp", "advantages"):
        setattr(whole, field, getattr(whole, field).double())
    whole_loss, whole_grad, _ = run_loss(whole, cfg)
    shards = split_by_sequence(whole, n_first=2)  # uneven: 2 sequences (one fully masked) vs 4
    if aggregation == "token":
        global_count = float(whole.mask.sum())
    else:
        global_count = float(whole.seq_ids[whole.mask].unique().numel())

    losses, grads, local_losses = [], [], []
    for shard in shards:
        logp = shard.logp.clone().requires_grad_(True)
        args = (shard.behaviour_logp, shard.advantages, shard.mask, shard.seq_ids, cfg)
        loss, _ = policy_loss(logp, *args, normalizer=global_count)
        loss.backward()
        losses.append(loss.detach())
        grads.append(logp.grad)
        local_losses.append(policy_loss(shard.logp, *args).loss)

    # Both float64 computations err as in test_loss_value_gradient_and_metrics_match_float64_token_loop.
    _, _, _, loss_scale = reference_loss(whole, cfg)
    n, k = len(whole.logp), token_roundings(whole)
    check_within(abs(float(sum(losses) - whole_loss)), float64_bound(n + k + 1, loss_scale), "rank losses")
    assert_within(torch.cat(grads), whole_grad, float64_bound(k, float(whole_grad.abs().max())), "rank gradients")
    # The split is uneven, so averaging local means would be a different (wrong) loss.
    assert abs(float(sum(local_losses) / 2 - whole_loss)) > 1e-3


@pytest.mark.parametrize("normalizer", [0.0, -2.0])
def test_non_positive_normalizer_raises(normalizer: float) -> None:
    with pytest.raises(ValueError, match="normalizer is"):
        policy_loss(
            *(torch.zeros(3),) * 3,
            torch.ones(3, dtype=torch.bool),
            torch.zeros(3, dtype=torch.int64),
            LossConfig(),
            normalizer=normalizer,
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kind", "grpo"),
        ("tis_cap", 0.0),
        ("clip_low", 1.0),
        ("clip_low", -0.1),
        ("clip_high", -0.1),
        ("mask_low", 1.5),
        ("mask_high", 0.9),
        ("aggregation", "batch"),
    ],
)
def test_bad_config_value_raises_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        LossConfig(**{field: value})


def test_default_config_is_valid() -> None:
    assert LossConfig().kind == "tis"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mask": torch.ones(5, dtype=torch.int64)}, "mask has dtype"),
        ({"advantages": torch.ones(4)}, "advantages has shape"),
        ({"seq_ids": torch.zeros(5)}, "seq_ids has dtype"),
        ({"logp": torch.zeros(5, 1)}, "logp has shape"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(change: dict[str, torch.Tensor], message: str) -> None:
    args = {
        "logp": torch.zeros(5),
        "behaviour_logp": torch.zeros(5),
        "advantages": torch.ones(5),
        "mask": torch.ones(5, dtype=torch.bool),
        "seq_ids": torch.zeros(5, dtype=torch.int64),
    } | change
    with pytest.raises(ValueError, match=message):
        policy_loss(**args, cfg=LossConfig())
