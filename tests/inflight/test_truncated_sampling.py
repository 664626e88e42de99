"""Top-k / top-p sampling on a real serve: the learner's logprobs match the behaviour logprobs only when it applies the
sampler's truncation (learner/truncation.py); a full softmax is biased on every token whose kept mass is below 1.

tiny-qwen2, float32 serve and learner, version 0 (lag 0): whatever differs is the learner's view of the sampler. The
tolerance is the one the real learner's lag-0 probe holds a float32 pair to under plain temperature sampling
(tests/inflight/test_learn.py, the control this test once repeated with a second serve).
"""

from __future__ import annotations

import pytest
import torch
from test_logprob_parity import collect
from tolerances import check_within

from inflight.wire.contract import SamplingKnobs

pytestmark = pytest.mark.engine

LAG0_TOLERANCE = 5e-3  # mean |learner − serve| logprob of a float32 pair at lag 0 (test_learn's probe bound)
TRUNCATED = ["--top-p", "0.9", "--top-k", "20"]


def learner_logprobs(model_dir, rollouts, truncation: SamplingKnobs | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(learner's, serve's) logprobs of every completion token, float32 learner at the rollouts' temperature."""
    from learner.model import load_policy
    from learner.step import Sample, make_batch

    model = load_policy(model_dir, dtype=torch.float32)
    samples = [Sample(r.prompt.tolist(), r.completion.tolist(), r.logprobs.tolist(), 0.0, [True] * len(r.completion))
               for r in rollouts]  # fmt: skip
    batch = make_batch(samples, pad_id=0)
    with torch.no_grad():
        logp = model(batch.input_ids, batch.targets, rollouts[0].sampling.temperature, truncation=truncation).logp
    return logp[batch.mask], batch.behaviour_logp[batch.mask]


def test_top_p_and_top_k_rollouts_match_the_learner_only_under_the_same_truncation(model_dirs):
    model_dir = model_dirs["tiny-qwen2"]
    truncated = collect(model_dir, "float32", extra=TRUNCATED)
    assert {(r.sampling.top_p, r.sampling.top_k) for r in truncated} == {(0.9, 20)}

    rule = SamplingKnobs(top_k=20, top_p=0.9)
    mine, theirs = learner_logprobs(model_dir, truncated, rule)
    truncated_gap = (mine - theirs).abs()
    full, _ = learner_logprobs(model_dir, truncated, None)
    biased_gap = (full - theirs).abs()
    print(f"\nmean |learner - serve| logprob over {truncated_gap.numel()} tokens of top-p 0.9 + top-k 20: with the "
          f"truncation {truncated_gap.mean():.2e}, with a full softmax {biased_gap.mean():.2e}")  # fmt: skip

    check_within(float(truncated_gap.mean()), LAG0_TOLERANCE, "top-p/top-k, truncated learner: mean |learner - serve|")
    # Today's full-softmax learner: every kept-mass deficit shows as a bias of the same sign (the full softmax spreads
    # probability over tokens the sampler could not pick), far outside the tolerance.
    assert float(biased_gap.mean()) > 10 * LAG0_TOLERANCE, f"full softmax gap {biased_gap.mean():.2e}"
    assert bool((full <= theirs + LAG0_TOLERANCE).all()), "a full softmax can only lower a kept token's logprob"
