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

pytestmark = pytest.mark.engine


def collect(model_dir, dtype: str, n: int = 16) -> list:
    side = LearnerSide()
    args = ["--model", str(model_dir), "--rollouts", side.rx.address, "--control", side.ctl.address]
    serve = ServeProcess([*args, "--group-size", "4", "--max-lag", "-1", "--max-groups", str(n // 4), "--dtype", dtype])
    try:
        deadline = time.monotonic() + 300
        while len(side.rollouts) < n and time.monotonic() < deadline:
            side.pump(0.5)
    finally:
        serve.stop()
    assert len(side.rollouts) >= n, serve.tail()
    return side.rollouts[:n]


def learner_logprobs(model_dir, rollouts, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    from learner.model import load_policy
    from learner.step import Sample, make_batch

    model = load_policy(model_dir, dtype=dtype)
    samples = [Sample(r.prompt.tolist(), r.completion.tolist(), r.logprobs.tolist(), 0.0, [True] * len(r.completion))
               for r in rollouts]  # fmt: skip
    batch = make_batch(samples, pad_id=0)
    with torch.no_grad():
        logp = model(batch.input_ids, batch.targets, temperature=rollouts[0].sampling.temperature)
    return logp[batch.mask].float(), batch.behaviour_logp[batch.mask].float()


def test_float32_learner_logprobs_match_a_bf16_serves_behaviour_logprobs_on_smollm2(model_dirs):
    serve_dtype = "bfloat16"
    rollouts = collect(model_dirs["smollm2"], serve_dtype)
    mine, theirs = learner_logprobs(model_dirs["smollm2"], rollouts)
    diff = (mine - theirs).abs()
    print(f"\nserve {serve_dtype} vs learner float32: {diff.numel()} tokens, mean |d logprob| {diff.mean():.2e}, "
          f"p99 {diff.quantile(0.99):.2e}, max {diff.max():.2e}")  # fmt: skip
    assert diff.mean() <= 5e-2
