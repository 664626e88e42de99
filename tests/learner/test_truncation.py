"""The learner's top-k / top-p / min-p rule (learner/truncation.py) against vLLM's own sampler code, and the truncated
chunked logprobs (learner/model.py) against a float64 autograd reference."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_within, lm_head_logprob_bound, sum_bound

from inflight.wire.contract import SamplingKnobs
from learner.model import naive_token_logprobs, token_logprobs
from learner.step import TrainConfig
from learner.truncation import active_rule, truncate_

T, H, V = 29, 16, 97
RULES = [SamplingKnobs(top_k=20), SamplingKnobs(top_p=0.9), SamplingKnobs(top_k=20, top_p=0.9),
         SamplingKnobs(min_p=0.05), SamplingKnobs(top_k=12, top_p=0.8, min_p=0.02)]  # fmt: skip


def logits_batch(seed: int, temperature: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, V, generator=gen) * 2.5 / temperature


def vllm_kept(logits: torch.Tensor, rule: SamplingKnobs) -> torch.Tensor:
    """The kept set vLLM's sampler computes: its min-p processor's rule, then its own top-k/top-p function."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    z = logits.clone()
    if rule.min_p > 0:  # MinPLogitsProcessor.apply (v1/sample/logits_processor/builtin.py), a per-request threshold
        probs = z.softmax(-1)
        z.masked_fill_(probs < probs.amax(-1, keepdim=True) * rule.min_p, -torch.inf)
    k = torch.full((T,), rule.top_k) if rule.top_k > 0 else None
    p = torch.full((T,), rule.top_p) if rule.top_p < 1 else None
    return torch.isfinite(apply_top_k_top_p_pytorch(z, k, p, allow_cpu_sync=True))


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_the_kept_set_is_the_one_vllms_sampler_keeps(rule: SamplingKnobs) -> None:
    for seed in range(5):
        logits = logits_batch(seed)
        want = vllm_kept(logits, rule)
        targets = want.float().argmax(-1)  # a kept token: forcing the target in changes nothing here
        got = torch.isfinite(truncate_(logits.clone(), targets, rule))
        assert torch.equal(got, want), f"{rule}: {int((got != want).sum())} tokens differ (seed {seed})"
        assert int(got.sum(-1).min()) > 0 and (rule.top_k <= 0 or int(got.sum(-1).max()) <= rule.top_k)


def test_a_target_the_rule_drops_keeps_a_finite_logprob() -> None:
    """The serve sampled it, so it was in the serve's set; a rounding flip on the learner side must not give −inf."""
    logits = logits_batch(0)
    rule = SamplingKnobs(top_k=3)
    targets = logits.argmin(-1)  # certainly outside every row's top 3
    masked = truncate_(logits.clone(), targets, rule)
    assert torch.isfinite(masked.gather(1, targets[:, None])).all()
    assert int(torch.isfinite(masked).sum(-1).max()) == 4


def reference(hidden, weight, bias, targets, temperature, rule) -> tuple[torch.Tensor, ...]:
    """float64 autograd through an explicit mask computed once from float64 logits: the kept-set softmax."""
    h, w, b = (x.double().detach().requires_grad_(True) for x in (hidden, weight, bias))
    z = (h @ w.t() + b) / temperature
    kept = torch.isfinite(truncate_(z.detach().clone(), targets, rule))
    logp = z.masked_fill(~kept, -torch.inf).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    return logp, h, w, b


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("chunk_tokens", (1, 8, 1024))
def test_truncated_chunked_values_and_grads_match_a_float64_masked_softmax(rule: SamplingKnobs, chunk_tokens: int):
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(T, H, generator=gen) * 0.8, torch.randn(V, H, generator=gen) * 0.5
    bias, upstream = torch.randn(V, generator=gen), torch.randn(T, generator=gen)
    temperature = 0.8
    with torch.no_grad():
        kept = torch.isfinite(truncate_((hidden.double() @ weight.double().t() + bias.double()) / temperature,
                                        torch.zeros(T, dtype=torch.long), rule))  # fmt: skip
    targets = torch.multinomial(kept.double(), 1, generator=gen).squeeze(1)  # sampled from the kept set
    want, h64, w64, b64 = reference(hidden, weight, bias, targets, temperature, rule)
    (want * upstream.double()).sum().backward()

    h, w, b = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    got = token_logprobs(h, w, targets, temperature, chunk_tokens, b, truncation=rule)
    (got * upstream).sum().backward()
    naive = naive_token_logprobs(hidden, weight, targets, temperature, bias, truncation=rule)

    # A logprob over the kept set errs no more than over the whole vocabulary (fewer terms in the normaliser); a
    # gradient entry sums up to V (hidden) or T (weight, bias) products of a logprob-accurate softmax and O(1) values.
    lp = lm_head_logprob_bound(torch.float32, hidden, weight, temperature, bias) + lm_head_logprob_bound(
        torch.float64, hidden.double(), weight.double(), temperature, bias.double()
    )
    assert_within(got.double(), want.detach(), lp, f"{rule} values")
    assert_within(naive.double(), want.detach(), lp, f"{rule} naive values")
    scale = float(upstream.abs().max()) / temperature
    for name, g, ref, n, rows in (("hidden", h.grad, h64.grad, V, weight), ("weight", w.grad, w64.grad, T, hidden),
                                  ("bias", b.grad, b64.grad, T, None)):  # fmt: skip
        magnitude = 2.0 * n * scale * (1.0 if rows is None else float(rows.abs().max()))
        assert_within(g.double(), ref, (lp + sum_bound(torch.float32, n + 3, 1.0)) * magnitude, f"{rule} d/d{name}")


def test_truncated_logprobs_are_a_distribution_over_the_kept_tokens() -> None:
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(1, H, generator=gen), torch.randn(V, H, generator=gen)
    rule = SamplingKnobs(top_k=20, top_p=0.9)
    every = torch.arange(V)
    logp = naive_token_logprobs(hidden.expand(V, H), weight, every, 1.0, truncation=rule)  # each token as target
    kept = torch.isfinite(truncate_(hidden @ weight.t(), torch.zeros(1, dtype=torch.long), rule))[0]
    # a dropped token is forced in when it is the target, so only the kept ones form the distribution
    total = logp[kept].exp().sum()
    assert abs(float(total) - 1.0) < 1e-5, f"kept-set probabilities sum to {float(total)}"
    full = naive_token_logprobs(hidden.expand(V, H), weight, every, 1.0)
    assert (logp[kept] > full[kept]).all(), "renormalising over fewer tokens raises every kept token's logprob"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": -2}, "--top-k is -2, expected >= 1, or 0 = off"),
        ({"top_k": -1}, "--top-k is -1, expected 0 for off"),
        ({"top_p": 0.0}, "--top-p is 0.0, expected in"),
        ({"top_p": 1.5}, "--top-p is 1.5, expected in"),
        ({"min_p": -0.1}, "--min-p is -0.1, expected in"),
    ],  # fmt: skip
)
def test_bad_truncation_values_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        active_rule(SamplingKnobs(**kwargs))
    with pytest.raises(ValueError, match="TrainConfig.sampling: " + message):
        TrainConfig(sampling=SamplingKnobs(**kwargs))


def test_the_fused_loss_is_refused_with_a_truncated_sampler() -> None:
    with pytest.raises(ValueError, match="fused_loss is 'on'.*top-k/top-p/min-p"):
        TrainConfig(fused_loss="on", sampling=SamplingKnobs(top_p=0.9))
    assert TrainConfig(fused_loss="auto", sampling=SamplingKnobs(top_p=0.9)).sampling.truncated
