"""Batch packing and the single-process learner step (learner/step.py) on tiny-llama.

The data-parallel equivalence of `train_step` (2 ranks = 1 process on the whole batch) is in test_distributed.py.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tolerances import (
    abs_products,
    assert_within,
    check_within,
    float64_bound,
    lm_head_logprob_bound,
    logprob_gradient_bound,
    policy_loss_bound,
    sum_bound,
)

from inflight.wire.contract import SamplingKnobs
from learner.fused_loss import FusedLossInputs, aggregation_weights
from learner.losses import LossConfig, policy_loss
from learner.model import PolicyModel, PolicyOutput, load_policy
from learner.step import Batch, Sample, TrainConfig, make_batch, make_optimizer, train_step

PAD = 0
SAMPLES = [
    Sample([11, 12, 13], [21, 22], [-1.5, -2.5], 0.75, [True, True]),
    Sample([14], [23, 24, 25, 26], [-0.5, -1.0, -2.0, -3.0], -1.0, [True, False, True, True]),
]


@pytest.fixture(scope="module")
def tiny_llama(model_dirs: dict[str, Path]) -> PolicyModel:
    return load_policy(model_dirs["tiny-llama"])


def final_hidden(model: PolicyModel, batch: Batch) -> torch.Tensor:
    """The decoder's output at the completion tokens: what the LM head turns into their logprobs."""
    with torch.no_grad():
        return model.hf.model(input_ids=batch.input_ids).last_hidden_state[batch.mask]


def step_metric_bounds(model: PolicyModel, batch: Batch, cfg: TrainConfig) -> dict[str, float]:
    """How far two float64 computations of one train_step's metrics may be apart: each logprob errs by up to
    `lm_head_logprob_bound`, so two of them differ by δ = twice that, which moves the loss by `policy_loss_bound`,
    ess ((Σr)²/Σr²) by 4δ relative and |log ratio| by δ; counts are exact. Each float64 sum adds its own γ_n."""
    lp_error = 2 * lm_head_logprob_bound(torch.float64, final_hidden(model, batch), model.hf.lm_head.weight,
                                         cfg.sampling.temperature)  # fmt: skip
    with torch.no_grad():
        logp = model(batch.input_ids, batch.targets, cfg.sampling.temperature).logp.flatten()
    mask = batch.mask.flatten()
    weights = aggregation_weights(mask, batch.seq_ids.flatten(), cfg.loss.aggregation)
    loss = policy_loss_bound(logp, batch.behaviour_logp.flatten(), batch.advantages.flatten(), weights, lp_error,
                             torch.float64)  # fmt: skip
    n, lp_max = int(mask.sum()), float(logp[mask].abs().max()) + 1
    return {"loss": loss, "normalizer": 0.0, "tokens": 0.0, "clip_fraction": 0.0, "probe_tokens": 0.0,
            "ess": 4 * lp_error + float64_bound(2 * n + 4, 1.0),
            "mean_abs_logratio": lp_error + float64_bound(n + 1, lp_max),
            "probe_abs_logratio_sum": n * lp_error + float64_bound(n, n * lp_max)}  # fmt: skip


def test_make_batch_aligns_each_completion_token_with_the_position_predicting_it() -> None:
    batch = make_batch(SAMPLES, PAD)
    assert batch.input_ids.tolist() == [[11, 12, 13, 21], [14, 23, 24, 25]]
    assert batch.targets.tolist() == [[12, 13, 21, 22], [23, 24, 25, 26]]
    assert batch.mask.tolist() == [[False, False, True, True], [True, False, True, True]]
    assert batch.behaviour_logp.tolist() == [[0.0, 0.0, -1.5, -2.5], [-0.5, -1.0, -2.0, -3.0]]
    assert batch.advantages.tolist() == [[0.0, 0.0, 0.75, 0.75], [-1.0, -1.0, -1.0, -1.0]]
    assert batch.seq_ids.tolist() == [[0] * 4, [1] * 4]


def test_make_batch_right_pads_shorter_rows_with_masked_filler() -> None:
    batch = make_batch([SAMPLES[0], Sample([7], [8], [-0.25], 2.0, [True])], pad_id=PAD)
    assert batch.input_ids.tolist() == [[11, 12, 13, 21], [7, PAD, PAD, PAD]]
    assert batch.targets.tolist() == [[12, 13, 21, 22], [8, PAD, PAD, PAD]]
    assert batch.mask[1].tolist() == [True, False, False, False]
    assert batch.behaviour_logp[1].tolist() == [-0.25, 0.0, 0.0, 0.0]
    assert batch.input_ids.dtype == batch.targets.dtype == batch.seq_ids.dtype == torch.int64
    assert batch.behaviour_logp.dtype == batch.advantages.dtype == torch.float32


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        (SAMPLES[0]._replace(behaviour_logprobs=[-1.0]), r"samples\[1\].behaviour_logprobs has 1 entries"),
        (SAMPLES[0]._replace(token_mask=[True] * 3), r"samples\[1\].token_mask has 3 entries"),
        (SAMPLES[0]._replace(prompt_ids=[]), r"samples\[1\].prompt_ids is empty"),
        (Sample([1], [], [], 0.0, []), r"samples\[1\].completion_ids is empty"),
    ],
)
def test_make_batch_bad_sample_raises_naming_the_sample_and_field(sample: Sample, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_batch([SAMPLES[0], sample], PAD)


def test_make_batch_without_samples_with_negative_pad_or_a_plain_tuple_raises() -> None:
    with pytest.raises(ValueError, match="samples is empty"):
        make_batch([], PAD)
    with pytest.raises(ValueError, match="pad_id is -1"):
        make_batch(SAMPLES, -1)
    with pytest.raises(TypeError, match=r"samples\[1\] is a tuple, expected a learner.step.Sample"):
        make_batch([SAMPLES[0], tuple(SAMPLES[1])], PAD)


def test_train_step_loss_is_policy_loss_of_the_model_logprobs_and_moves_weights(tiny_llama: PolicyModel) -> None:
    # A check of logic (train_step runs the LM head only at the completion tokens, the reference on every position),
    # so in float64, where the two differ only by `step_metric_bounds`.
    model = copy.deepcopy(tiny_llama).double()
    cfg = TrainConfig(sampling=SamplingKnobs(temperature=0.7), loss=LossConfig(kind="ppo"))
    batch = make_batch(SAMPLES, PAD)
    with torch.no_grad():
        logp = model(batch.input_ids, batch.targets, cfg.sampling.temperature).logp
        flat = [t.flatten() for t in (logp, batch.behaviour_logp, batch.advantages, batch.mask, batch.seq_ids)]
        expected_loss, expected_metrics = policy_loss(*flat, cfg.loss)
    before = [p.detach().clone() for p in model.parameters()]
    bounds = step_metric_bounds(model, batch, cfg)

    metrics = train_step(model, make_optimizer(model, cfg), batch, cfg)

    check_within(abs(metrics["loss"] - float(expected_loss)), bounds["loss"], "loss")
    assert metrics["normalizer"] == 5.0  # unmasked completion tokens
    for key, value in expected_metrics.items():
        check_within(abs(metrics[key] - value), bounds[key], key)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("fused", ["off", "on"])
def test_masked_and_padded_tokens_do_not_change_the_step(tiny_llama: PolicyModel, fused: str) -> None:
    cfg = TrainConfig(fused_loss=fused)
    clean = make_batch(SAMPLES, PAD)
    dirty = make_batch(SAMPLES, PAD)
    dirty.behaviour_logp[~dirty.mask] = float("nan")
    dirty.advantages[~dirty.mask] = float("inf")
    models = [copy.deepcopy(tiny_llama) for _ in range(2)]
    for model, batch in zip(models, (clean, dirty), strict=True):
        train_step(model, make_optimizer(model, cfg), batch, cfg)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_global_token_count_is_the_loss_normaliser(tiny_llama: PolicyModel) -> None:
    """A rank holding 5 of 10 global tokens contributes half its local-mean loss."""
    cfg = TrainConfig()
    batch = make_batch(SAMPLES, PAD)
    models = [copy.deepcopy(tiny_llama) for _ in range(2)]
    local = train_step(models[0], make_optimizer(models[0], cfg), batch, cfg)
    shared = train_step(models[1], make_optimizer(models[1], cfg), batch, cfg, global_tokens=10)
    assert shared["normalizer"] == 10.0
    # The same fp32 sum S in one process, as S / 10 and as (S / 5) / 2: 2 roundings apart at most (0 in practice:
    # halving is exact in binary floating point).
    check_within(abs(shared["loss"] - local["loss"] / 2), sum_bound(torch.float32, 2, abs(shared["loss"])), "loss")


def test_world_size_different_from_the_sharding_raises(tiny_llama: PolicyModel) -> None:
    cfg = TrainConfig()
    with pytest.raises(ValueError, match="world_size is 2, but the model is sharded over 1"):
        train_step(tiny_llama, make_optimizer(tiny_llama, cfg), make_batch(SAMPLES, PAD), cfg, world_size=2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", 0.0),
        ("betas", (0.9, 1.0)),
        ("eps", 0.0),
        ("weight_decay", -1.0),
        ("grad_clip", 0.0),
        ("chunk_tokens", 0),
        ("fused_loss", "yes"),
    ],
)
def test_bad_train_config_raises_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"TrainConfig.{field} is"):
        TrainConfig(**{field: value})


def test_bad_sampling_knobs_raise_naming_the_section_and_the_flag() -> None:
    with pytest.raises(ValueError, match="TrainConfig.sampling: --temperature is 0.0, expected > 0"):
        TrainConfig(sampling=SamplingKnobs(temperature=0.0))


def test_lm_head_only_at_positions_gives_the_same_logprobs_and_gradients(tiny_llama: PolicyModel) -> None:
    # A check of logic (two paths to the same values), so in float64: in fp32 the two paths take differently shaped
    # matmuls, and which oneDNN kernel each gets (AMX or AVX2) decides how far apart they round (1.8e-5 on an AMD EPYC).
    model = copy.deepcopy(tiny_llama).double()
    batch = make_batch(SAMPLES, PAD)
    full = model(batch.input_ids, batch.targets, 1.0).logp
    full.masked_fill(~batch.mask, 0.0).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    part = model(batch.input_ids, batch.targets, 1.0, positions=batch.mask).logp
    part.sum().backward()
    assert torch.equal(part[~batch.mask], torch.zeros(int((~batch.mask).sum()), dtype=torch.float64))
    # Both float64 paths err by up to the LM head's bound (its log-sum-exp over the vocabulary is the longest sum).
    hidden, lm_head = final_hidden(model, batch), model.hf.lm_head.weight
    lp_bound = lm_head_logprob_bound(torch.float64, hidden, lm_head, 1.0)
    assert_within(part[batch.mask], full[batch.mask], 2 * lp_bound, "logprobs")
    for name, p in model.named_parameters():
        bound = 2 * logprob_gradient_bound(torch.float64, hidden, lm_head, 1.0, float(grads[name].abs().max()))
        assert_within(p.grad, grads[name], bound, name)
    with pytest.raises(ValueError, match="positions has shape"):
        model(batch.input_ids, batch.targets, 1.0, positions=batch.mask[:, :2])


def test_forward_returns_one_output_type_carrying_a_loss_only_when_fused(tiny_llama: PolicyModel) -> None:
    model = copy.deepcopy(tiny_llama).double()  # a check of logic (two paths to one loss), so in float64
    batch = make_batch(SAMPLES, PAD)
    per_token = (batch.behaviour_logp, batch.advantages, batch.mask, batch.seq_ids)
    plain = model(batch.input_ids, batch.targets, 1.0, positions=batch.mask)
    fused = model(
        batch.input_ids, batch.targets, 1.0, positions=batch.mask, fused=FusedLossInputs(*per_token, LossConfig())
    )
    assert type(plain) is PolicyOutput and type(fused) is PolicyOutput
    assert plain.loss is None and plain.metrics == {} and plain.logp.requires_grad
    assert fused.loss is not None and fused.loss.requires_grad and not fused.logp.requires_grad
    expected = policy_loss(*(t.reshape(-1) for t in (plain.logp, *per_token)), LossConfig())
    bounds = step_metric_bounds(model, batch, TrainConfig(sampling=SamplingKnobs(temperature=1.0)))
    check_within(abs(float(fused.loss.detach()) - float(expected.loss.detach())), bounds["loss"], "loss")
    assert fused.metrics.keys() == expected.metrics.keys()
    for key, value in expected.metrics.items():
        check_within(abs(fused.metrics[key] - value), bounds[key], key)


def test_bf16_autocast_decoder_is_close_to_fp32_and_keeps_fp32_master_weights(tiny_llama: PolicyModel) -> None:
    model = copy.deepcopy(tiny_llama)
    batch = make_batch(SAMPLES, PAD)
    exact = model(batch.input_ids, batch.targets, 1.0).logp[batch.mask]
    fast = model(batch.input_ids, batch.targets, 1.0, autocast=torch.bfloat16).logp[batch.mask]
    gap = (fast - exact).abs().max().item()
    assert fast.dtype == torch.float32
    # bf16 rounding shows, but only at the bf16 level: each decoder layer's bf16 matmuls leave the hidden state off
    # by about u = 2^-8 relative, so a logit by u·Σ|h_i·w_i| per layer and the (fp32) logprob by twice that.
    hidden, lm_head = final_hidden(model, batch), model.hf.lm_head.weight
    per_layer = sum_bound(torch.bfloat16, 1, float(abs_products(hidden, lm_head).max()))
    assert gap > 0, gap
    check_within(gap, 2 * model.hf.config.num_hidden_layers * per_layer, "bf16 autocast gap")
    cfg = TrainConfig(lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = train_step(model, make_optimizer(model, cfg), batch, cfg, autocast=torch.bfloat16)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="autocast is 'fp8', expected one of"):
        train_step(model, make_optimizer(model, cfg), batch, cfg, autocast="fp8")


@pytest.mark.parametrize("loss", [LossConfig("tis"), LossConfig("ppo"), LossConfig("mask", aggregation="sequence")],
                         ids=lambda c: f"{c.kind}-{c.aggregation}")  # fmt: skip
def test_fused_loss_step_equals_the_unfused_step(tiny_llama: PolicyModel, loss: LossConfig) -> None:
    """fused_loss='on' (the LM head and the loss in one pass; here the torch row pass, on CUDA the Triton kernel) takes
    the same step as logprobs then `policy_loss`: same loss, metrics, and weights after AdamW, to rounding."""
    batch = make_batch(SAMPLES, PAD)
    probe = batch.mask.clone()
    base = copy.deepcopy(tiny_llama).double()  # a check of logic (two paths to one step), so in float64
    cfg = TrainConfig(lr=1e-3, sampling=SamplingKnobs(temperature=0.8), loss=loss, chunk_tokens=3)
    results = []
    for fused in ("off", "on"):
        model = copy.deepcopy(base)
        optimizer = make_optimizer(model, cfg)
        metrics = train_step(model, optimizer, batch, replace(cfg, fused_loss=fused), probe_mask=probe)
        # AdamW's first step leaves exp_avg_sq = (1 − β2)·g²: the clipped gradient's size, entry by entry
        grad_size = [(optimizer.state[p]["exp_avg_sq"] / (1 - cfg.betas[1])).sqrt() for p in model.parameters()]
        results.append((metrics, [p.detach().clone() for p in model.parameters()], grad_size))
    (off, off_params, grad_size), (on, on_params, _) = results
    assert on.keys() == off.keys()
    bounds = step_metric_bounds(base, batch, cfg)
    # A gradient entry errs by δ of itself (logprob_gradient_bound), so the norm by δ·‖g‖, plus its own n-term sum.
    params = sum(p.numel() for p in base.parameters())
    grad_error = 2 * logprob_gradient_bound(torch.float64, final_hidden(base, batch), base.hf.lm_head.weight,
                                            cfg.sampling.temperature, off["grad_norm"])  # fmt: skip
    bounds["grad_norm"] = grad_error + float64_bound(params, off["grad_norm"])
    for key, value in off.items():
        check_within(abs(on[key] - value), bounds[key], key)
    # AdamW's first step moves a weight by lr·g/(|g| + eps), whose slope is eps/(|g| + eps)² (1/eps at g = 0: Adam
    # magnifies errors in near-zero gradients), so a gradient error ε (after clipping) moves it by at most
    # lr·ε·eps/(|g| − ε + eps)², plus the update's own few roundings.
    clipped_error = grad_error * min(1.0, cfg.grad_clip / max(off["grad_norm"], cfg.grad_clip))
    for a, b, g in zip(off_params, on_params, grad_size, strict=True):
        slope = cfg.eps / ((g - clipped_error).clamp(min=0) + cfg.eps) ** 2
        bound = cfg.lr * clipped_error * slope + float64_bound(4, float(a.abs().max()) + cfg.lr)
        assert_within(b, a, bound, "weights after AdamW")
    if off["clip_fraction"] < 1:  # (the mask band drops every token of these far-off-policy samples)
        assert any(not torch.equal(a, p) for a, p in zip(off_params, tiny_llama.parameters(), strict=True))
