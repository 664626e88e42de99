"""Rollout Routing Replay (R3): the learner's MoE layers route every token to the experts the sampler routed it to.

An MoE model's largest train–inference mismatch is routing: a router logit a rounding error away from a tie picks
another expert in the learner than in the engine, and that token's whole MLP output differs. The serve records the
top-k expert ids of every token in every MoE layer (vllm_patches/routes.py) and the rollout carries them
(inflight/wire/rollouts.py:RoutedRollout); `RoutingReplay` makes the HF model use them.

What is replayed is the *selection* only. The gate weights are still the learner's: softmax of its own router logits,
gathered at the recorded ids and renormalised as the family does (Qwen3-MoE / Qwen2-MoE: `norm_topk_prob`; Mixtral:
always), so the router keeps its gradient. A token with no recorded route (a batch's padding, a sequence's last
token, which the engine never fed forward) routes by the learner's own top-k: its output reaches no trained logit.

How: a forward hook on each MoE block's router (`block.gate`, transformers' `*TopKRouter`, which returns
`(logits, top-k weights, top-k ids)`) replaces the weights and ids while `replaying(routes)` is active; outside it the
hooks return the router's own output untouched. Only the families whose router has that shape are accepted; any
other architecture is refused by `RoutingReplay(...)` naming it, since silently training with the learner's own
routes is what `--routing-replay on` exists to prevent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# model_type → the router class every MoE block of that family calls as `block.gate`
SUPPORTED_ROUTERS = {
    "qwen3_moe": "Qwen3MoeTopKRouter",
    "qwen2_moe": "Qwen2MoeTopKRouter",
    "mixtral": "MixtralTopKRouter",
}
NO_ROUTE = -1  # a routes entry with no recorded expert: that token routes by the learner's own top-k


class RoutingReplayError(ValueError):
    """Routing replay cannot run on this model or with these routes."""


@dataclass
class Agreement:
    """Token×layer pairs with a recorded route, and those where the learner's own top-k set equals it."""

    matches: int = 0
    total: int = 0

    @property
    def fraction(self) -> float | None:
        return self.matches / self.total if self.total else None


def moe_routers(hf_model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of `hf_model`'s MoE layers in layer order; refuses (naming it) an architecture it cannot replay."""
    config = hf_model.config
    model_type = getattr(config, "model_type", "?")
    arch = ",".join(getattr(config, "architectures", None) or [type(hf_model).__name__])
    if model_type not in SUPPORTED_ROUTERS:
        raise RoutingReplayError(
            f"--routing-replay on cannot replay {arch} (model_type {model_type!r}): it supports "
            f"{sorted(SUPPORTED_ROUTERS)}; run it with --routing-replay off"
        )
    routers = [m for m in hf_model.modules() if type(m).__name__ == SUPPORTED_ROUTERS[model_type]]
    if not routers:
        raise RoutingReplayError(
            f"--routing-replay on found no {SUPPORTED_ROUTERS[model_type]} in {arch}: the transformers version "
            "lays the MoE block out otherwise; run it with --routing-replay off"
        )
    return routers


class RoutingReplay:
    """Forward hooks on every MoE router of an HF model; `replaying(routes)` makes them route to `routes`.

    `routes`: int [B, L, M, k] for the forward's `input_ids` [B, L]: the expert ids of position (b, t) in MoE layer m
    (M = `layers`, in layer order), `NO_ROUTE` where none was recorded. `agreement` accumulates over every replayed
    forward how often the learner's own top-k set equals the recorded one; `take_agreement` reads and resets it.
    """

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.routers = moe_routers(hf_model)
        self.top_k = int(self.routers[0].top_k)
        self.num_experts = int(self.routers[0].num_experts)
        self.agreement = Agreement()
        self._routes: torch.Tensor | None = None
        self._handles = [r.register_forward_hook(self._hook_for(i)) for i, r in enumerate(self.routers)]

    @property
    def layers(self) -> int:
        return len(self.routers)

    @contextmanager
    def replaying(self, routes: torch.Tensor | None) -> Iterator[None]:
        """Route by `routes` in every forward inside the block (None: the learner's own routing, a no-op)."""
        if routes is not None:
            self._check(routes)
        self._routes = routes
        try:
            yield
        finally:
            self._routes = None

    def take_agreement(self) -> Agreement:
        taken, self.agreement = self.agreement, Agreement()
        return taken

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _check(self, routes: torch.Tensor) -> None:
        if routes.dim() != 4 or routes.shape[2:] != (self.layers, self.top_k):
            raise RoutingReplayError(
                f"routes has shape {tuple(routes.shape)}, expected [batch, length, {self.layers} MoE layers, "
                f"top-k {self.top_k}]: the rollouts were recorded from another model"
            )
        if bool((routes >= self.num_experts).any()) or bool((routes < NO_ROUTE).any()):
            raise RoutingReplayError(
                f"routes has expert ids outside [0, {self.num_experts}) (other than {NO_ROUTE}, no route): the "
                "rollouts were recorded from another model"
            )

    def _hook_for(self, layer: int):
        def hook(router: torch.nn.Module, args, output):
            if self._routes is None:
                return None
            return self._replay(router, layer, output)

        return hook

    def _replay(self, router: torch.nn.Module, layer: int, output):
        logits, scores, own = output
        recorded = self._routes[:, :, layer, :].reshape(-1, self.top_k).to(device=own.device, dtype=torch.int64)
        if recorded.shape[0] != own.shape[0]:
            raise RoutingReplayError(
                f"routes cover {recorded.shape[0]} tokens, the MoE layer {layer} routed {own.shape[0]}: pass routes "
                "for exactly the forward's input_ids [batch, length]"
            )
        known = recorded[:, 0] >= 0
        with torch.no_grad():  # why sorted: the engine's top-k is unsorted; agreement is of the expert *sets*
            same = (own.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
            self.agreement.matches += int((same & known).sum())
            self.agreement.total += int(known.sum())
        ids = torch.where(known[:, None], recorded, own.to(torch.int64))
        weights = torch.softmax(logits.float(), dim=-1).gather(1, ids)
        if getattr(router, "norm_topk_prob", True):  # Mixtral's router has no flag: it always renormalises
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(scores.dtype), ids.to(own.dtype)
