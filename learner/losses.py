"""Off-policy policy-gradient losses over a packed batch of completion tokens.

The learner step calls `policy_loss` once per micro-batch with, per token: the learner's logprob logπθ (carries the
gradient), vLLM's behaviour logprob logμ, the sample's advantage A, a mask (False = padding or a token the staleness
gate dropped; such a token is ignored entirely, whatever garbage its other fields hold) and the sample's sequence id.
With ratio = exp(logπθ − logμ), per token:

- `tis`  (truncated importance sampling): −A · min(ratio, tis_cap).detach() · logπθ. REINFORCE with a capped IS
  weight: gradient −A · min(ratio, C) · ∇logπθ.
- `ppo`  (clipped surrogate, asymmetric clip allowed): −min(ratio · A, clip(ratio, 1 − clip_low, 1 + clip_high) · A).
- `mask` (IcePop-style): tokens whose ratio leaves [mask_low, mask_high] get zero loss and zero gradient; the others
  −A · ratio with the gradient flowing through the ratio, i.e. −A · ratio · ∇logπθ — the unclipped IS surrogate, so
  in-band tokens are weighted exactly as PPO weights unclipped ones. Out-of-band tokens still count in the
  aggregation's denominators (like PPO's clipped tokens): dropping tokens does not rescale the others.

Aggregation: `token` sums over unmasked tokens and divides by their number (whole batch); `sequence` averages the
unmasked tokens within each sequence, then averages over the sequences that have at least one unmasked token.

Data-parallel ranks each hold part of the global batch. Passing `normalizer` = the GLOBAL count (unmasked tokens for
`token`, sequences with an unmasked token for `sequence`) replaces the local denominator, so the ranks' losses sum to
the whole-batch loss (a sequence must not be split across ranks). learner/step.py does this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from learner.knobs import AGGREGATIONS, LOSS_KINDS, LossSettings


@dataclass(frozen=True)
class LossConfig(LossSettings):
    """Which policy loss, its trust-region constants, and how token losses are aggregated (the kind, the tis cap and
    the aggregation: the learner's flags, declared in learner/knobs.py)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    mask_low: float = 0.5
    mask_high: float = 2.0

    def __post_init__(self) -> None:
        checks = [
            (self.kind in LOSS_KINDS, f"LossConfig.kind is {self.kind!r}, expected one of {LOSS_KINDS}"),
            (self.tis_cap > 0, f"LossConfig.tis_cap is {self.tis_cap}, expected > 0 (e.g. 2.0)"),
            (0 <= self.clip_low < 1, f"LossConfig.clip_low is {self.clip_low}, expected 0 <= clip_low < 1"),
            (self.clip_high >= 0, f"LossConfig.clip_high is {self.clip_high}, expected >= 0"),
            (
                0 <= self.mask_low <= 1 <= self.mask_high and self.mask_low < self.mask_high,
                f"LossConfig mask band is [{self.mask_low}, {self.mask_high}], expected "
                "0 <= mask_low <= 1 <= mask_high (the band must keep on-policy tokens, ratio 1)",
            ),
            (
                self.aggregation in AGGREGATIONS,
                f"LossConfig.aggregation is {self.aggregation!r}, expected one of {AGGREGATIONS}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class PolicyLoss(NamedTuple):
    """`policy_loss`'s result: the scalar loss (differentiable w.r.t. `logp`) and its float metrics."""

    loss: torch.Tensor
    metrics: dict[str, float]


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    cfg: LossConfig,
    normalizer: float | None = None,
) -> PolicyLoss:
    """Scalar loss (differentiable w.r.t. `logp`) and float metrics, for [T]-shaped per-token inputs.

    `normalizer`: the aggregation's final denominator — None uses the local count (unmasked tokens, or sequences with
    at least one unmasked token); data-parallel callers pass the global count so that per-rank losses sum to the
    whole-batch loss. Metrics stay local to these inputs.

    Metrics: `tokens` (unmasked count); `clip_fraction` (share of unmasked tokens whose weight the trust region
    changed: ratio > tis_cap for tis, clipped term active for ppo, ratio outside the band for mask); `ess`
    ((Σ ratio)² / (n · Σ ratio²) over unmasked tokens, in (0, 1]); `mean_abs_logratio`. With no unmasked token the
    loss is a zero still connected to `logp` and every metric is 0.
    """
    _check_loss_inputs(logp, behaviour_logp, advantages, mask, seq_ids)
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer is {normalizer}, expected > 0 (the global count) or None (the local count)")
    # Masked tokens may hold anything (padding, −inf, a stale version's logprob): keep them away from exp and from
    # products whose backward would turn 0 · inf into NaN.
    log_ratio = torch.where(mask, logp - behaviour_logp.detach(), 0.0)
    ratio = torch.exp(log_ratio)
    adv = torch.where(mask, advantages.detach().to(logp.dtype), 0.0)
    per_token, trust_region_hit = _per_token_loss(logp, ratio, adv, cfg)
    per_token = torch.where(mask, per_token, 0.0)
    if cfg.aggregation == "token":
        loss = per_token.sum() / (mask.sum().clamp(min=1) if normalizer is None else normalizer)
    else:
        loss = _sequence_mean(per_token, mask, seq_ids, normalizer)
    return PolicyLoss(loss, _metrics(log_ratio.detach(), mask, trust_region_hit))


def _per_token_loss(
    logp: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and where the trust region (cap, clip or band) changed the token's weight."""
    if cfg.kind == "tis":
        weight = ratio.detach().clamp(max=cfg.tis_cap)
        return -adv * weight * logp, ratio.detach() > cfg.tis_cap
    if cfg.kind == "ppo":
        unclipped = ratio * adv
        clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv
        return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()
    in_band = (ratio >= cfg.mask_low) & (ratio <= cfg.mask_high)
    return torch.where(in_band, -adv * ratio, 0.0), ~in_band


def _sequence_mean(
    per_token: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, normalizer: float | None
) -> torch.Tensor:
    """Mean over each sequence's unmasked tokens, then mean over sequences with at least one of them."""
    unique_ids, seq_index = torch.unique(seq_ids, return_inverse=True)
    zeros = per_token.new_zeros(unique_ids.shape[0])
    counts = zeros.index_add(0, seq_index, mask.to(per_token.dtype))
    sums = zeros.index_add(0, seq_index, per_token)
    per_sequence = sums / counts.clamp(min=1)  # a fully masked sequence contributes 0 and is not counted below
    if normalizer is None:
        normalizer = (counts > 0).sum().clamp(min=1)
    return per_sequence.sum() / normalizer


def _metrics(log_ratio: torch.Tensor, mask: torch.Tensor, trust_region_hit: torch.Tensor) -> dict[str, float]:
    maskf = mask.to(torch.float64)
    log_ratio = log_ratio.to(torch.float64)
    ratio = torch.exp(log_ratio) * maskf
    hits = (trust_region_hit & mask).to(torch.float64)
    sums = torch.stack([maskf.sum(), hits.sum(), ratio.sum(), (ratio * ratio).sum(), log_ratio.abs() @ maskf])
    n, hits, sum_w, sum_w2, sum_abs = sums.tolist()  # one device sync for all metrics
    if n == 0:
        return {"tokens": 0.0, "clip_fraction": 0.0, "ess": 0.0, "mean_abs_logratio": 0.0}
    return {
        "tokens": n,
        "clip_fraction": hits / n,
        "ess": sum_w * sum_w / (n * sum_w2),
        "mean_abs_logratio": sum_abs / n,
    }


def _check_loss_inputs(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
) -> None:
    if logp.dim() != 1 or not logp.is_floating_point():
        raise ValueError(f"logp has shape {tuple(logp.shape)} and dtype {logp.dtype}, expected a 1-D float tensor")
    named = {"behaviour_logp": behaviour_logp, "advantages": advantages, "mask": mask, "seq_ids": seq_ids}
    for name, tensor in named.items():
        if tensor.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(logp.shape)} like logp")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask has dtype {mask.dtype}, expected torch.bool (True = the token counts)")
    if seq_ids.is_floating_point() or seq_ids.dtype == torch.bool:
        raise ValueError(f"seq_ids has dtype {seq_ids.dtype}, expected an integer dtype (e.g. torch.int64)")
