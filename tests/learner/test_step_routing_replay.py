"""train_step with MoE routing replay (learner/step.py + learner/routing_replay.py) on the prepared tiny-moe."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from learner.model import PolicyModel, load_policy
from learner.routing_replay import NO_ROUTE, RoutingReplay
from learner.step import Sample, TrainConfig, make_batch, make_optimizer, train_step

PROMPTS = ([11, 12, 13, 14], [15, 16])
COMPLETIONS = ([21, 22, 23], [24, 25, 26, 27])


@pytest.fixture(scope="module")
def tiny_moe(model_dirs: dict[str, Path]) -> PolicyModel:
    return load_policy(model_dirs["tiny-moe"])


def own_routes(model: PolicyModel, replay: RoutingReplay, tokens: list[int]) -> np.ndarray:
    """[len(tokens) − 1, layers, top_k]: what the model routes each input position to (a serve's record of it)."""
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, out: seen.append(out[2])) for r in replay.routers]
    with torch.no_grad():
        model.hf(input_ids=torch.tensor([tokens[:-1]]))
    for h in handles:
        h.remove()
    return torch.stack(seen, dim=1).numpy()


def samples(model: PolicyModel, replay: RoutingReplay, shift: int = 0) -> list[Sample]:
    out = []
    for prompt, completion in zip(PROMPTS, COMPLETIONS, strict=True):
        with torch.no_grad():
            logp = model(torch.tensor([prompt + completion[:-1]]), torch.tensor([prompt[1:] + completion]), 1.0).logp
        behaviour = logp[0, len(prompt) - 1 :].tolist()  # the model's own logprobs: a lag-0 sample of it
        routes = (own_routes(model, replay, prompt + completion) + shift) % replay.num_experts
        out.append(Sample(prompt, completion, behaviour, 1.0, [True] * len(completion), routes))
    return out


def test_make_batch_puts_each_samples_routes_at_its_input_positions_and_no_route_elsewhere(tiny_moe):
    replay = RoutingReplay(tiny_moe.hf)
    try:
        batch = make_batch(samples(tiny_moe, replay), pad_id=0)
        assert batch.routes.shape == (*batch.input_ids.shape, replay.layers, replay.top_k)
        short = len(PROMPTS[1]) + len(COMPLETIONS[1]) - 1
        assert (batch.routes[1, short:] == NO_ROUTE).all() and (batch.routes[1, :short] >= 0).all()
        no_routes = [s._replace(routes=None) for s in samples(tiny_moe, replay)]
        assert make_batch(no_routes, pad_id=0).routes is None
    finally:
        replay.remove()


def test_train_step_with_the_samplers_own_routes_reports_full_agreement_and_equal_mismatch(tiny_moe):
    model = copy.deepcopy(tiny_moe)
    replay = RoutingReplay(model.hf)
    batch = make_batch(samples(model, replay), pad_id=0)
    metrics = train_step(model, make_optimizer(model, TrainConfig()), batch, TrainConfig(), probe_mask=batch.mask,
                         replay=replay)  # fmt: skip
    recorded = sum(len(p) + len(c) - 1 for p, c in zip(PROMPTS, COMPLETIONS, strict=True))  # not the padding
    assert metrics["route_total"] == recorded * replay.layers
    assert metrics["route_matches"] == metrics["route_total"]
    assert metrics["probe_abs_logratio_sum"] == pytest.approx(metrics["probe_abs_logratio_sum_unreplayed"], abs=1e-6)


def test_train_step_with_other_routes_lowers_agreement_and_trains_the_router(tiny_moe):
    model = copy.deepcopy(tiny_moe)
    replay = RoutingReplay(model.hf)
    batch = make_batch(samples(model, replay, shift=1), pad_id=0)
    before = [r.weight.detach().clone() for r in replay.routers]
    metrics = train_step(model, make_optimizer(model, TrainConfig(lr=1e-2)), batch, TrainConfig(lr=1e-2),
                         probe_mask=batch.mask, replay=replay)  # fmt: skip
    assert metrics["route_matches"] < metrics["route_total"]
    # the replayed forward is another model: its logprobs are off the behaviour ones, the unreplayed ones are not
    assert metrics["probe_abs_logratio_sum"] > metrics["probe_abs_logratio_sum_unreplayed"] + 1e-3
    assert all(not torch.equal(b, r.weight.detach()) for b, r in zip(before, replay.routers, strict=True))


def test_a_step_without_probe_tokens_runs_no_unreplayed_forward(tiny_moe):
    model = copy.deepcopy(tiny_moe)
    replay = RoutingReplay(model.hf)
    batch = make_batch(samples(model, replay), pad_id=0)
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    metrics = train_step(model, make_optimizer(model, TrainConfig()), batch, TrainConfig(),
                         probe_mask=torch.zeros_like(batch.mask), replay=replay)  # fmt: skip
    assert "probe_abs_logratio_sum_unreplayed" not in metrics and len(calls) == 1
    assert metrics["route_total"] > 0


def test_routes_read_only_as_a_received_record_holds_them_batch_without_a_warning(tiny_moe):
    replay = RoutingReplay(tiny_moe.hf)
    try:
        given = samples(tiny_moe, replay)
    finally:
        replay.remove()
    for s in given:  # a decoded record's routes: a view of the message's bytes (inflight/wire/rollouts.py)
        s.routes.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "The given NumPy array is not writable" reached every learner's log
        batch = make_batch(given, pad_id=0)
    assert int(batch.routes[0, 0, 0, 0]) == int(given[0].routes[0, 0, 0])
