"""learner/routing_replay.py on tiny HF MoE models of each supported family (tests/moe_models.py)."""

from __future__ import annotations

import pytest
import torch
from moe_models import FAMILIES, tiny_moe

from learner.routing_replay import NO_ROUTE, RoutingReplay, RoutingReplayError

B, L = 2, 9


def own_routes(model: torch.nn.Module, replay: RoutingReplay, input_ids: torch.Tensor) -> torch.Tensor:
    """The top-k ids each router picks in a plain forward, as [B, L, M, k] (what a serve would record)."""
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, out: seen.append(out[2])) for r in replay.routers]
    with torch.no_grad():
        model(input_ids=input_ids)
    for h in handles:
        h.remove()
    return torch.stack([s.reshape(B, L, -1) for s in seen], dim=2)


@pytest.fixture(params=FAMILIES)
def moe(request):
    model = tiny_moe(request.param)
    replay = RoutingReplay(model)
    input_ids = torch.randint(0, model.config.vocab_size, (B, L), generator=torch.Generator().manual_seed(1))
    return model, replay, input_ids


def test_replaying_the_models_own_routes_gives_identical_logits_and_full_agreement(moe):
    model, replay, input_ids = moe
    routes = own_routes(model, replay, input_ids)
    with torch.no_grad():
        plain = model(input_ids=input_ids).logits
        with replay.replaying(routes):
            replayed = model(input_ids=input_ids).logits
    assert torch.equal(plain, replayed)
    agreement = replay.take_agreement()
    assert agreement.total == B * L * replay.layers and agreement.fraction == 1.0


def test_replaying_other_routes_changes_the_outputs_and_lowers_agreement(moe):
    model, replay, input_ids = moe
    routes = own_routes(model, replay, input_ids)
    other = (routes + 1) % replay.num_experts  # every token to a shifted expert set (never equal to its own for k<E)
    with torch.no_grad():
        plain = model(input_ids=input_ids).logits
        with replay.replaying(other):
            replayed = model(input_ids=input_ids).logits
    assert (plain - replayed).abs().max() > 1e-3
    assert replay.take_agreement().fraction < 1.0


def test_tokens_without_a_recorded_route_route_by_the_learners_own_top_k(moe):
    model, replay, input_ids = moe
    routes = own_routes(model, replay, input_ids)
    partial = routes.clone()
    partial[:, 4:] = NO_ROUTE
    with torch.no_grad():
        plain = model(input_ids=input_ids).logits
        with replay.replaying(partial):
            replayed = model(input_ids=input_ids).logits
    assert torch.equal(plain, replayed)
    assert replay.take_agreement().total == B * 4 * replay.layers


def test_the_router_gets_a_gradient_through_the_replayed_gate_weights(moe):
    model, replay, input_ids = moe
    routes = (own_routes(model, replay, input_ids) + 1) % replay.num_experts
    with replay.replaying(routes):
        model(input_ids=input_ids).logits.square().mean().backward()
    for router in replay.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_outside_replaying_the_hooks_leave_the_models_routing_alone(moe):
    model, replay, input_ids = moe
    routes = own_routes(model, replay, input_ids)
    replay.remove()
    assert torch.equal(routes, own_routes(model, RoutingReplay(model), input_ids))
    assert replay.take_agreement().total == 0


def test_routes_of_another_shape_are_refused_naming_the_expected_layout(moe):
    model, replay, input_ids = moe
    wrong = torch.zeros(B, L, replay.layers + 1, replay.top_k, dtype=torch.int64)
    with pytest.raises(RoutingReplayError, match="MoE layers"), replay.replaying(wrong):
        pass
    out_of_range = torch.full((B, L, replay.layers, replay.top_k), replay.num_experts)
    with pytest.raises(RoutingReplayError, match="expert ids outside"), replay.replaying(out_of_range):
        pass


def test_a_dense_architecture_is_refused_at_start_naming_it():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with pytest.raises(RoutingReplayError, match="Qwen2ForCausalLM.*'qwen2'"):
        RoutingReplay(Qwen2ForCausalLM(config))


def test_the_learner_with_routing_replay_on_refuses_a_dense_model_at_start_naming_it(tmp_path):
    from inflight.learn.app import main

    with pytest.raises(SystemExit, match=r"inflight.learn: --routing-replay on cannot replay LlamaForCausalLM"):
        main(["--model", "tiny-llama", "--routing-replay", "on", "--device", "cpu", "--run-dir", str(tmp_path / "r"),
              "--rollouts-port", "1", "--control-port", "1"])  # fmt: skip  # port 1: nothing may have bound
