"""Learner logprobs vs the behaviour logprobs vLLM streamed with the rollouts (SmolLM2, version 0, real serve).

If these disagree, every importance ratio is off before any staleness: the mismatch floor of the whole system. Here
the serve runs bf16 (cheaper, and what many deployments do) against a float32 learner; the float32 serve (the default)
is checked by the real learner's own probe in tests/inflight/test_learn.py (5e-3).
"""

from __future__ import annotations

import time

import pytest
import torch
from serve_support import ServeProcess
from test_serve import LearnerSide
from tolerances import check_within, lm_head_logprob_bounds, unit_roundoff

pytestmark = pytest.mark.engine


def collect(model_dir, dtype: str, n: int = 16, extra: list[str] | None = None) -> list:
    """`n` rollouts from a real serve of `model_dir` at version 0 (`extra`: more serve flags, e.g. sampling)."""
    side = LearnerSide()
    args = ["--model", str(model_dir), "--rollouts", side.rx.address, "--control", side.ctl.address]
    serve = ServeProcess([*args, "--group-size", "4", "--admit-lag", "-1", "--max-groups", str(n // 4),
                          "--dtype", dtype, *(extra or [])])  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while len(side.rollouts) < n and time.monotonic() < deadline:
            side.pump(0.5)
    finally:
        serve.stop()
    assert len(side.rollouts) >= n, serve.tail()
    return side.rollouts[:n]


def learner_logprobs(model_dir, rollouts, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The learner's logprobs of the rollouts' tokens, the serve's, and a bound on their gap per token (see below)."""
    from learner.model import load_policy
    from learner.step import Sample, make_batch

    model = load_policy(model_dir, dtype=dtype)
    samples = [Sample(r.prompt.tolist(), r.completion.tolist(), r.logprobs.tolist(), 0.0, [True] * len(r.completion))
               for r in rollouts]  # fmt: skip
    batch = make_batch(samples, pad_id=0)
    temperature = rollouts[0].sampling.temperature
    with torch.no_grad():
        logp = model(batch.input_ids, batch.targets, temperature=temperature).logp
        lm_head, bounds = model.hf.lm_head.weight.double(), []
        for row in range(batch.input_ids.shape[0]):  # one row at a time: [tokens, vocab] float64 logits
            mask = batch.mask[row]
            hidden = model.hf.model(input_ids=batch.input_ids[row : row + 1]).last_hidden_state[0][mask].double()
            logits = hidden @ lm_head.t()
            z_target = logits.gather(1, batch.targets[row][mask][:, None])[:, 0].abs()
            serve = unit_roundoff(torch.bfloat16) * (z_target + logits.abs().amax(1)) / temperature
            bounds.append(serve + lm_head_logprob_bounds(torch.float32, hidden, lm_head, temperature))
    return logp[batch.mask].float(), batch.behaviour_logp[batch.mask].float(), torch.cat(bounds)


def test_float32_learner_logprobs_match_a_bf16_serves_behaviour_logprobs_on_smollm2(model_dirs):
    serve_dtype = "bfloat16"
    rollouts = collect(model_dirs["smollm2"], serve_dtype)
    mine, theirs, bounds = learner_logprobs(model_dirs["smollm2"], rollouts)
    diff = (mine - theirs).abs()
    print(f"\nserve {serve_dtype} vs learner float32: {diff.numel()} tokens, mean |d logprob| {diff.mean():.2e}, "
          f"p99 {diff.quantile(0.99):.2e}, max {diff.max():.2e}, mean bound {bounds.mean():.2e}")  # fmt: skip
    # The serve's logits are bf16 tensors, each rounded by up to u·|z| (u = 2^-8): a logprob z_t − LSE(z) moves by up
    # to u·(|z_t| + max|z|)/T (LSE is 1-Lipschitz); the fp32 learner adds its own lm_head_logprob_bounds. A model of
    # one bf16 rounding, not a theorem for a 30-layer bf16 stack, so it bounds the mean over tokens, not each token.
    # With SmolLM2's logits (|z| ~ 30) it is ~0.2: a wrong position or temperature moves logprobs by O(1).
    check_within(float(diff.mean()), float(bounds.mean()), "mean |logprob serve - learner|")
