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

The rule's values are the sampling knobs themselves (inflight/wire/contract.py:SamplingKnobs, declared once for the
serve's flags, the learner's and the train step's `TrainConfig.sampling`). Runs in the learner process, inside the
train step's LM head (learner/model.py).
"""

from __future__ import annotations

import torch

from inflight.wire.contract import SamplingKnobs


def active_rule(sampling: SamplingKnobs | None) -> SamplingKnobs | None:
    """`sampling` when it truncates (checked: a bad value is refused naming its flag and the range), else None: a full
    softmax, no mask to compute."""
    if sampling is None:
        return None
    sampling.validate_sampling()
    return sampling if sampling.truncated else None


def truncate_(logits: torch.Tensor, targets: torch.Tensor, rule: SamplingKnobs) -> torch.Tensor:
    """Set the logits of the tokens `rule`'s top-k / top-p / min-p drop to −inf, in place; `logits` [T, V] are after
    temperature (fp32 or wider), `targets` [T] are never dropped. Returns `logits`."""
    if not rule.truncated:
        return logits
    drop = torch.zeros_like(logits, dtype=torch.bool)
    if rule.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        drop |= probs < probs.amax(dim=-1, keepdim=True) * rule.min_p
    if 0 < rule.top_k < logits.shape[-1]:
        kth = logits.masked_fill(drop, -torch.inf).topk(rule.top_k, dim=-1).values[:, -1:]
        drop |= logits < kth
    if rule.top_p < 1.0:
        drop |= _top_p_drop(logits.masked_fill(drop, -torch.inf), rule.top_p)
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
