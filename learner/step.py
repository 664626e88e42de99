"""One optimizer step of the learner: packed micro-batch → policy logprobs → off-policy loss → AdamW update.

The learner loop (inflight.learn) builds a `Batch` from complete rollout groups with `make_batch`, calls
`train_step` once per step on every data-parallel rank, then publishes the new weights.

Data parallelism: each of N ranks holds whole sequences of the global batch. The loss on a rank is its share of the
whole-batch loss — its token losses divided by the GLOBAL normaliser (unmasked tokens for token aggregation,
sequences with an unmasked token for sequence aggregation), so the ranks' losses sum to the whole-batch loss.
FSDP2 averages gradients over the ranks (it divides the reduce-scatter by N); backpropagating N × the rank's share
undoes that division, so the reduced gradient is that of the whole-batch loss and the step equals a 1-rank step on
the whole batch. (The alternative, `set_gradient_divide_factor(1.0)`, must be set on every FSDP unit; scaling the
loss keeps the whole rule in this file.) N is a power of two in practice, so the scaling is exact in floating point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from inflight.wire.contract import SamplingKnobs
from learner.fused_loss import FusedLossInputs, fused_enabled
from learner.knobs import FUSED_MODES, StepSettings
from learner.losses import LossConfig, policy_loss
from learner.model import PolicyModel, PolicyOutput
from learner.routing_replay import NO_ROUTE, RoutingReplay

# the learner's --autocast once resolved for its device (inflight/learn/app.py), as train_step's `autocast` dtype
AUTOCAST = {"none": None, "bfloat16": torch.bfloat16}


@dataclass
class TrainConfig(StepSettings):
    """Optimizer and loss settings for RL fine-tuning of a small (~100M) model; the defaults run the demo. The
    learning rate, the clipping and the fused loss are the learner's flags, declared in learner/knobs.py; `sampling`
    is the sampling flags' own section (inflight/wire/contract.py:SamplingKnobs). The decoder's autocast dtype is
    `train_step`'s, not a setting here: the learner's --autocast, resolved for its device."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    chunk_tokens: int = 1024
    loss: LossConfig = field(default_factory=LossConfig)
    # the serve's sampling knobs (their one declaration): logprobs at its temperature (behaviour logprobs are after
    # it) and, with top-k / top-p / min-p, over the kept tokens (learner/truncation.py); "auto" fusing then stays off
    # (the fused loss is full-softmax only)
    sampling: SamplingKnobs = field(default_factory=SamplingKnobs)

    def __post_init__(self) -> None:
        checks = [
            (self.lr > 0, f"TrainConfig.lr is {self.lr}, expected > 0 (e.g. 1e-5)"),
            (all(0 <= b < 1 for b in self.betas), f"TrainConfig.betas is {self.betas}, expected each in [0, 1)"),
            (self.eps > 0, f"TrainConfig.eps is {self.eps}, expected > 0 (e.g. 1e-8)"),
            (self.weight_decay >= 0, f"TrainConfig.weight_decay is {self.weight_decay}, expected >= 0"),
            (self.grad_clip is None or self.grad_clip > 0, f"TrainConfig.grad_clip is {self.grad_clip}, expected > 0"),
            (self.chunk_tokens >= 1, f"TrainConfig.chunk_tokens is {self.chunk_tokens}, expected >= 1"),
            (
                self.fused_loss in FUSED_MODES,
                f"TrainConfig.fused_loss is {self.fused_loss!r}, expected one of {list(FUSED_MODES)}",
            ),
            (
                not (self.fused_loss == "on" and self.sampling.truncated),
                f"TrainConfig.fused_loss is 'on' with {self.sampling}: the fused loss computes full-softmax "
                "logprobs; set fused_loss 'auto' or 'off' for top-k/top-p/min-p sampling",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        try:
            self.sampling.validate_sampling()
        except ValueError as exc:  # the rule names the flag; this says which config holds it
            raise ValueError(f"TrainConfig.sampling: {exc}") from None


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over all trainable parameters (sharded DTensors under FSDP2: the optimizer state is sharded too)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


class Sample(NamedTuple):
    """One finished rollout as the learner trains on it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]  # vLLM's logprob of each completion token, after temperature
    advantage: float
    token_mask: list[bool]  # per completion token: False = do not train on it (e.g. too stale)
    # MoE routing replay: int [positions, MoE layers, top_k], the experts input token t was routed to when sampled
    # (t < positions <= prompt + completion − 1); None = none recorded (learner/routing_replay.py)
    routes: Any = None


@dataclass
class Batch:
    """A right-padded micro-batch, one sequence per row, all [B, L].

    Position t holds input token t and the target t + 1, so the logprob computed at t is that of the target.
    `mask` is True only where the target is a completion token that trains; elsewhere the other fields are filler.
    """

    input_ids: torch.Tensor  # int64
    targets: torch.Tensor  # int64
    behaviour_logp: torch.Tensor  # float32
    advantages: torch.Tensor  # float32
    mask: torch.Tensor  # bool
    seq_ids: torch.Tensor  # int64, the row index
    # int64 [B, L, MoE layers, top_k]: the recorded experts of input position t, NO_ROUTE where none; None when no
    # sample has routes
    routes: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(_to(getattr(self, f), device) for f in self.__dataclass_fields__))


def _to(t: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def make_batch(samples: Sequence[Sample], pad_id: int) -> Batch:
    """Pack samples into a right-padded Batch (rows of length max(len(prompt) + len(completion)) − 1).

    The completion token j of a sample with a P-token prompt is the target at position P − 1 + j, where its
    behaviour logprob, the sample's advantage and token_mask[j] go.
    """
    if not samples:
        raise ValueError("samples is empty, expected at least one (prompt, completion, ...) sample")
    if pad_id < 0:
        raise ValueError(f"pad_id is {pad_id}, expected a token id >= 0 (e.g. the tokenizer's pad or eos id)")
    for index, sample in enumerate(samples):
        _check_sample(index, sample)
    length = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples) - 1
    shape = (len(samples), length)
    batch = Batch(
        input_ids=torch.full(shape, pad_id, dtype=torch.int64),
        targets=torch.full(shape, pad_id, dtype=torch.int64),
        behaviour_logp=torch.zeros(shape, dtype=torch.float32),
        advantages=torch.zeros(shape, dtype=torch.float32),
        mask=torch.zeros(shape, dtype=torch.bool),
        seq_ids=torch.arange(len(samples), dtype=torch.int64)[:, None].expand(shape).clone(),
    )
    for row, s in enumerate(samples):
        tokens = torch.tensor(list(s.prompt_ids) + list(s.completion_ids), dtype=torch.int64)
        n, first = len(tokens) - 1, len(s.prompt_ids) - 1  # first: the position whose target is completion token 0
        batch.input_ids[row, :n] = tokens[:-1]
        batch.targets[row, :n] = tokens[1:]
        completion = slice(first, n)
        batch.behaviour_logp[row, completion] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        batch.advantages[row, completion] = float(s.advantage)
        batch.mask[row, completion] = torch.tensor(s.token_mask, dtype=torch.bool)
    batch.routes = _batch_routes(samples, shape)
    return batch


def _batch_routes(samples: Sequence[Sample], shape: tuple[int, int]) -> torch.Tensor | None:
    """The samples' routes as one [B, L, layers, top_k] tensor (NO_ROUTE where a row has none); None if none has."""
    # int64 copies: a record's routes are a read-only view of its message (torch warns on those, and must not write)
    given = {
        row: torch.from_numpy(np.array(s.routes, dtype=np.int64))
        for row, s in enumerate(samples)
        if s.routes is not None
    }
    if not given:
        return None
    layout = next(iter(given.values())).shape[1:]
    routes = torch.full((*shape, *layout), NO_ROUTE, dtype=torch.int64)
    for row, r in given.items():
        if r.shape[1:] != layout or r.shape[0] > shape[1]:
            raise ValueError(
                f"samples[{row}].routes has shape {tuple(r.shape)}, expected at most {shape[1]} positions of "
                f"{tuple(layout)} (the other samples'): its rollout was recorded from another model"
            )
        routes[row, : r.shape[0]] = r
    return routes


def _check_sample(index: int, s: Sample) -> None:
    if not isinstance(s, Sample):
        raise TypeError(
            f"samples[{index}] is a {type(s).__name__}, expected a learner.step.Sample: its fields are read by name"
        )
    if len(s.prompt_ids) < 1:
        raise ValueError(f"samples[{index}].prompt_ids is empty, expected >= 1 token (the first token has no logprob)")
    if len(s.completion_ids) < 1:
        raise ValueError(f"samples[{index}].completion_ids is empty, expected >= 1 token: drop the sample")
    for name in ("behaviour_logprobs", "token_mask"):
        if len(getattr(s, name)) != len(s.completion_ids):
            raise ValueError(
                f"samples[{index}].{name} has {len(getattr(s, name))} entries, expected one per completion token "
                f"({len(s.completion_ids)})"
            )


def train_step(
    model: PolicyModel,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: TrainConfig,
    world_size: int = 1,
    global_tokens: int | None = None,
    global_sequences: int | None = None,
    probe_mask: torch.Tensor | None = None,
    replay: RoutingReplay | None = None,
    autocast: torch.dtype | None = None,
) -> dict[str, float]:
    """Forward, loss, backward, clip, AdamW step, zero grads; the same on every data-parallel rank (collective).

    `world_size`: the number of data-parallel ranks the model is sharded over (checked against its mesh).
    `global_tokens` / `global_sequences`: the whole-batch normaliser for token / sequence aggregation (see the
    module docstring); when None they are summed over the ranks with one all-reduce (or local for one rank).
    Metrics: `loss` (whole-batch), `grad_norm` (global, before clipping), `normalizer`, and the rank-local
    `policy_loss` metrics (tokens, clip_fraction, ess, mean_abs_logratio).
    `probe_mask` ([B, L] bool, optional): also report `probe_abs_logratio_sum` and `probe_tokens` (rank-local) — the
    learner uses it for |logπθ − logμ| on lag-0 tokens, the mismatch floor between trainer and sampler.
    `replay` (MoE routing replay, learner/routing_replay.py): the forward routes every token to `batch.routes`; the
    metrics then add `route_matches` / `route_total` (rank-local routing agreement) and, with `probe_mask`,
    `probe_abs_logratio_sum_unreplayed`: the probe's mismatch in one more forward (no graph), routed by the model.
    `autocast` (None or torch.bfloat16, `AUTOCAST` of the learner's resolved --autocast): the decoder's compute dtype.
    `batch` and `probe_mask` may be built on the CPU (`make_batch`): they are moved to the model's device (the
    learner's `learner/world.py:World.device`), a no-op where they already are.
    """
    _check_world_size(model, world_size)
    _check_autocast(autocast)
    device = _model_device(model)
    batch = batch.to(device)
    probe_mask = probe_mask.to(device) if probe_mask is not None else None
    given = global_tokens if cfg.loss.aggregation == "token" else global_sequences
    normalizer = float(given) if given is not None else _global_count(batch, cfg.loss.aggregation, model)
    normalizer = max(normalizer, 1.0)  # nothing trains anywhere: a zero loss, not 0 / 0
    with replay.replaying(batch.routes) if replay is not None else nullcontext():
        out = _forward_loss(model, batch, cfg, normalizer, probe_mask, autocast)
    metrics = dict(out.metrics)
    if probe_mask is not None:
        metrics.update(_probe_metrics(out.logp, batch.behaviour_logp, probe_mask))
    if replay is not None:
        metrics.update(_replay_metrics(model, batch, cfg, replay, probe_mask, autocast))
    (out.loss * world_size).backward()  # FSDP2 divides the reduced gradient by world_size; this undoes it
    grad_norm = _clip_grad_norm(model, cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = _sum_over_ranks(out.loss.detach(), model)
    return {"loss": loss, "grad_norm": grad_norm, "normalizer": normalizer, **metrics}


def _forward_loss(
    model: PolicyModel,
    batch: Batch,
    cfg: TrainConfig,
    normalizer: float,
    probe_mask: torch.Tensor | None,
    autocast: torch.dtype | None,
) -> PolicyOutput:
    """The policy's logprobs and this rank's share of the loss: fused with the LM head where `cfg.fused_loss` turns it
    on (full-softmax only, so not with a truncation), else `policy_loss` over the logprobs."""
    positions = batch.mask if probe_mask is None else batch.mask | probe_mask  # the LM head runs only where needed
    fused = None
    if fused_enabled(cfg.fused_loss, batch.input_ids.device) and not cfg.sampling.truncated:
        fused = FusedLossInputs(batch.behaviour_logp, batch.advantages, batch.mask, batch.seq_ids, cfg.loss, normalizer)
    out = _policy_forward(model, batch, cfg, positions, autocast, fused)
    if out.loss is not None:
        return out
    flat = [t.reshape(-1) for t in (out.logp, batch.behaviour_logp, batch.advantages, batch.mask, batch.seq_ids)]
    result = policy_loss(*flat, cfg.loss, normalizer=normalizer)
    return PolicyOutput(out.logp, result.loss, result.metrics)


def _policy_forward(
    model: PolicyModel,
    batch: Batch,
    cfg: TrainConfig,
    positions: torch.Tensor,
    autocast: torch.dtype | None,
    fused: FusedLossInputs | None = None,
) -> PolicyOutput:
    """The policy's forward over `batch` at the LM head `positions`, with the step's temperature, chunking, autocast
    and truncation (and the fused loss when given)."""
    return model(
        batch.input_ids,
        batch.targets,
        cfg.sampling.temperature,
        cfg.chunk_tokens,
        positions=positions,
        autocast=autocast,
        fused=fused,
        truncation=cfg.sampling,
    )


def _replay_metrics(
    model: PolicyModel,
    batch: Batch,
    cfg: TrainConfig,
    replay: RoutingReplay,
    probe_mask: torch.Tensor | None,
    autocast: torch.dtype | None,
) -> dict[str, float]:
    """Routing agreement of the replayed forward, and the probe's mismatch without replay. The unreplayed forward runs
    only when some rank has a probe token (a step of stale tokens only has none), and then on every rank, whether or
    not its own slice has one: under FSDP2 a forward is a collective."""
    agreement = replay.take_agreement()
    metrics = {"route_matches": float(agreement.matches), "route_total": float(agreement.total)}
    if probe_mask is not None and _sum_over_ranks(probe_mask.sum().to(torch.float64), model) > 0:
        with torch.no_grad():
            plain = _policy_forward(model, batch, cfg, probe_mask, autocast)
        unreplayed = _probe_metrics(plain.logp, batch.behaviour_logp, probe_mask)
        metrics["probe_abs_logratio_sum_unreplayed"] = unreplayed["probe_abs_logratio_sum"]
    return metrics


def _probe_metrics(logp: torch.Tensor, behaviour_logp: torch.Tensor, probe_mask: torch.Tensor) -> dict[str, float]:
    """Σ |logπθ − logμ| and the token count over `probe_mask` (rank-local), outside the graph."""
    with torch.no_grad():
        gap = (logp.detach() - behaviour_logp).abs()[probe_mask]
    return {"probe_abs_logratio_sum": float(gap.sum()), "probe_tokens": float(gap.numel())}


def _model_device(model: torch.nn.Module) -> torch.device:
    """The device of this rank's share of the model's parameters (of the local shard under FSDP2)."""
    param = next(model.parameters())
    return (param.to_local() if isinstance(param, DTensor) else param).device


def _mesh_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The data-parallel group of an FSDP2-sharded model, or None for a plain one."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh.get_group()
    return None


def _check_autocast(autocast: torch.dtype | None) -> None:
    if autocast not in AUTOCAST.values():
        raise ValueError(
            f"autocast is {autocast!r}, expected one of {list(AUTOCAST.values())}: the learner's --autocast resolved "
            "for its device (learner/step.py:AUTOCAST maps 'none' and 'bfloat16')"
        )


def _check_world_size(model: torch.nn.Module, world_size: int) -> None:
    group = _mesh_group(model)
    sharded_over = 1 if group is None else dist.get_world_size(group)
    if world_size != sharded_over:
        raise ValueError(
            f"world_size is {world_size}, but the model is sharded over {sharded_over} rank(s): pass the "
            "data-parallel size the model was given to shard_policy (1 for an unsharded model)"
        )


def _global_count(batch: Batch, aggregation: str, model: torch.nn.Module) -> float:
    if aggregation == "token":
        count = batch.mask.sum()
    else:
        count = torch.tensor(batch.seq_ids[batch.mask].unique().numel(), device=batch.mask.device)
    return _sum_over_ranks(count.to(torch.float64), model)


def _sum_over_ranks(value: torch.Tensor, model: torch.nn.Module) -> float:
    group = _mesh_group(model)
    if group is not None and dist.get_world_size(group) > 1:
        value = value.clone()
        dist.all_reduce(value, group=group)
    return float(value)


def _clip_grad_norm(model: torch.nn.Module, max_norm: float | None) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.clip_grad_norm_(params, math.inf if max_norm is None else max_norm)
    if isinstance(total, DTensor):  # the norm of sharded gradients is a partial value until reduced
        total = total.full_tensor()
    return float(total)
