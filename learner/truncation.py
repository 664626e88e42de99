"""Truncated sampling on the learner's side: the same min-p / top-k / top-p rule vLLM's sampler applied.

With `--top-k`, `--top-p` or `--min-p` the serve samples from a renormalised truncation of softmax(logits / T), and its
processed behaviour logprobs are log-probabilities under that truncation. A learner computing a full softmax would bias
every importance ratio (by the log of the kept probability mass, a different amount per token). vLLM 0.32 can return
the sampler's mask only under Model Runner V2, which the CPU worker does not use, so the learner recomputes the mask
from its own logits with vLLM's rule, in vLLM's order (v1/sample/sampler.py: temperature, then the argmax-invariant
min-p processor, then top-k, then top-p):

- min-p: drop tokens whose probability is below `min_p` × the largest probability;
- top-k: drop tokens whose logit is below the k-th largest logit (ties at the k-th value are kept);
- top-p: sort the survivors ascending, drop every token whose cumulative probability (from the smallest up) is at most
  1 − p; the most likely token is always kept.

The mask is a selection, not a function the gradient flows through (peers treat the replayed mask the same way): the
gradient of log p̃(target) is (onehot − p̃) / T over the kept tokens and zero elsewhere. The target itself is always
kept: the serve sampled it, so it was in the serve's set; if rounding between the two sides' logits drops it here, its
logprob stays finite (a near-boundary token, a small difference the importance ratio then carries).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Truncation:
    """The sampler's truncation: `top_k` 0 (or -1) = off, `top_p` 1.0 = off, `min_p` 0.0 = off."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if self.top_k < -1:
            raise ValueError(f"top_k is {self.top_k}, expected >= 1, or 0 / -1 for off")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p is {self.top_p}, expected in (0, 1] (1.0 = off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p is {self.min_p}, expected in [0, 1] (0.0 = off)")

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def mask_(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Set the logits of dropped tokens to −inf, in place; `logits` [T, V] are after temperature (fp32 or
        wider), `targets` [T] are never dropped. Returns `logits`."""
        if not self.active:
            return logits
        drop = torch.zeros_like(logits, dtype=torch.bool)
        if self.min_p > 0.0:
            probs = logits.softmax(dim=-1)
            drop |= probs < probs.amax(dim=-1, keepdim=True) * self.min_p
        if 0 < self.top_k < logits.shape[-1]:
            kth = logits.masked_fill(drop, -torch.inf).topk(self.top_k, dim=-1).values[:, -1:]
            drop |= logits < kth
        if self.top_p < 1.0:
            drop |= _top_p_drop(logits.masked_fill(drop, -torch.inf), self.top_p)
        drop.scatter_(1, targets[:, None], False)
        return logits.masked_fill_(drop, -torch.inf)


def _top_p_drop(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """vLLM's nucleus rule on already-masked logits: ascending sort, cumulative probability ≤ 1 − p is dropped, the
    largest always kept."""
    ordered, index = logits.sort(dim=-1, descending=False)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= 1.0 - top_p
    drop_sorted[:, -1] = False
    return torch.zeros_like(drop_sorted).scatter_(1, index, drop_sorted)
