"""`python -m inflight.learn`: consume rollouts, train with FSDP2, push weights back to every serve.

Runs as one process or under torchrun (gloo on CPU, NCCL on GPU), on the device `--device` names; where each rank
runs is one `learner/world.py:World`, built once in `main`. This module is what every rank runs: the model, the
optimizer, the step loop, checkpoints, the final export. Rank 0's network side (sockets, rollout buffer, journal,
weight publisher, metrics file) is `LearnerService` (inflight/learn/service.py): every step rank 0 asks it for
`groups_per_step` complete groups, staleness-gated (`next_groups`), and broadcasts the samples; all ranks train on
their slice; the new full weights go out as `version + 1` (inflight/learn/publisher.py:RankSender). The loop is visible
in `Learner.run`.

The step's samples reach the other ranks by `broadcast_samples`: msgpack bytes in a uint8 tensor over the default
group (never pickle), on that group's device (`learner/world.py:World.device`: NCCL moves GPU memory only); every rank
trains on its slice `samples[rank::world]`, and an empty broadcast means "stop", so all ranks leave the loop at the
same step.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from inflight.config import declared_values, parse_dataclass, setup_logging, write_resolved
from inflight.learn.adapter import AdapterOutputs, counted_parameters, lora_spec
from inflight.learn.config import LearnConfig, PolicyLossKnobs, TrainStepKnobs
from inflight.learn.publisher import CATCH_UP, RankSender
from inflight.learn.samples import GatedSample, GateStats
from inflight.learn.service import LearnerService
from inflight.learn.tracking import Reporting
from inflight.machine import resolve_precision
from inflight.models import resolve_model
from inflight.wire.records import StepMetrics
from learner.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
from learner.export import full_hf_state
from learner.losses import LossConfig
from learner.model import PolicyModel, load_policy, shard_policy
from learner.routing_replay import RoutingReplay, RoutingReplayError
from learner.step import AUTOCAST, Batch, Sample, TrainConfig, make_batch, make_optimizer, train_step
from learner.world import World, WorldError, start_world

log = logging.getLogger("inflight.learn")
_samples_decoder = msgspec.msgpack.Decoder(list[GatedSample])


@dataclasses.dataclass
class Resumed:
    """Where a run goes on from: the checkpoint's version and step, the groups it trained and the count per serve."""

    version: int = 0
    step: int = 0
    consumed: list[str] | dict = dataclasses.field(default_factory=list)
    by_server: dict[str, int] = dataclasses.field(default_factory=dict)


def broadcast_samples(samples: list[GatedSample] | None, world: World, catch_up: Callable) -> list[GatedSample]:
    """Rank 0's `samples` on every rank ([] = stop); the other ranks `catch_up()` each time rank 0 orders it first
    (inflight/learn/publisher.py:order_catch_up). A no-op in a world of one. Collective: every rank calls it."""
    if world.size == 1:
        return samples or []
    payload = msgspec.msgpack.encode(samples or []) if world.rank == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=world.device)
    dist.broadcast(size, 0)
    while world.rank != 0 and int(size) == CATCH_UP:
        catch_up()
        dist.broadcast(size, 0)
    if world.rank == 0:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(world.device)
    else:
        buf = torch.empty(int(size), dtype=torch.uint8, device=world.device)
    dist.broadcast(buf, 0)
    return (samples or []) if world.rank == 0 else _samples_decoder.decode(buf.cpu().numpy().tobytes())


@dataclasses.dataclass
class TrainInputs:
    """What one rank's train step takes: its padded `batch`, the lag-0 prefix tokens that probe the trainer/sampler
    mismatch, and the step's token and sequence counts over every rank (the loss divides by them)."""

    batch: Batch
    probe_mask: torch.Tensor
    tokens: int
    sequences: int

    @classmethod
    def of(cls, samples: list[GatedSample], rank: int, world: int) -> TrainInputs:
        mine = samples[rank::world]
        as_train = [
            Sample(s.prompt_ids, s.completion_ids, s.behaviour_logprobs, s.advantage, s.token_mask, _routes(s))
            for s in mine
        ]
        batch = make_batch(as_train, pad_id=0)  # on the CPU: train_step moves it to the model's device
        fresh = [t._replace(token_mask=s.on_policy_prefix) for t, s in zip(as_train, mine, strict=True)]
        probe = make_batch(fresh, pad_id=0).mask & batch.mask
        tokens = sum(sum(s.token_mask) for s in samples)
        sequences = sum(any(s.token_mask) for s in samples)  # a wholly gated sample does not count
        return cls(batch, probe, tokens, sequences)


def _routes(sample: GatedSample) -> np.ndarray | None:
    return None if sample.routes is None else sample.routes.array()


class Learner:
    """One learner rank: loads the policy on `world.device` (FSDP2-sharded over `world.mesh` when there are several
    ranks) and AdamW, restored from the latest checkpoint with `--resume`; rank 0 also starts the `LearnerService` (it
    binds), the other ranks touch no socket."""

    def __init__(self, cfg: LearnConfig, world: World):
        torch.manual_seed(cfg.seed)
        self.cfg, self.placement, self.run_dir = cfg, world, Path(cfg.run_dir)
        self.rank, self.world = world.rank, world.size  # which slice of each step's samples this rank trains
        self.model_path = resolve_model(cfg.model)
        self.model = load_policy(self.model_path, getattr(torch, cfg.dtype), world.device, lora_spec(cfg))
        self.param_counts = counted_parameters(self.model)  # the step lines' share of them (inflight/learn/adapter.py)
        self.autocast = AUTOCAST[cfg.autocast]  # the decoder's compute dtype: main resolved --autocast already
        if world.mesh is not None:
            shard_policy(self.model, world.mesh, world.layer_compute_dtype(self.autocast))
        # with --lora-rank the adapter is what is published and exported (inflight/learn/adapter.py)
        self.adapter = AdapterOutputs(cfg, self.model, self.model_path, self.rank) if self.model.lora else None
        # --routing-replay on: an architecture it cannot replay is refused here, at start, naming it
        self.replay = RoutingReplay(self.model.hf) if cfg.routing_replay == "on" else None
        self.train_cfg = train_config(cfg)
        self.optimizer = make_optimizer(self.model, self.train_cfg)
        resumed = resume(self.run_dir, self.model, self.optimizer) if cfg.resume else Resumed()
        self.version, self.step = resumed.version, resumed.step
        self.stopping = threading.Event()  # SIGTERM/SIGINT: rank 0 stops waiting for groups, every rank then stops
        self.reporting = open_reporting(cfg) if world.rank == 0 else None  # before the service binds
        self.sender = RankSender(self.model, world, self.adapter is not None, cfg.full_every, cfg.bucket_mb << 20)
        state = self.sender.service_state()  # collective when gathered
        adapter = self.adapter.spec() if self.adapter is not None else None
        self.service = (
            LearnerService(cfg, state, self.version, resumed.consumed, resumed.by_server, world.weights_device, adapter)
            if world.rank == 0
            else None
        )
        # rank 0 hands each version straight to the service's publisher (it reads no socket of the loop's)
        self.sender.publisher = self.service.publisher if self.service is not None else None

    def run(self) -> int:
        """Every rank, until `--steps` (0: until stopped): groups, train step, publish (`--publish-every`), metrics
        line, checkpoint (`--checkpoint-every`; at the end unless the last step wrote one), HF export. The exit code."""
        # Everything loaded so far (torch, transformers, the model's modules) lives as long as the process: moved out of
        # the collector's reach, a full collection no longer walks it. A step on a GPU is bound by the CPU launching
        # kernels, and a multi-millisecond collection in the middle of one is a stall the GPU sits through.
        gc.collect()
        gc.freeze()
        while not self.cfg.steps or self.step < self.cfg.steps:
            started = time.perf_counter()
            catch_up = partial(self.sender.catch_up, self.version)  # every rank streams to a serve that joined late
            batch = self.service.next_groups(self.version, self.stopping.is_set, catch_up) if self.rank == 0 else None
            waited = time.perf_counter() - started
            samples = broadcast_samples(batch.samples if batch is not None else None, self.placement, catch_up)
            if not samples:
                break
            metrics = self._train(samples)
            self.version += 1
            self.step += 1
            publish = self.sender.publish(self.version) if self.version % self.cfg.publish_every == 0 else {}
            if self.rank == 0:
                lengths = [len(s.completion_ids) for s in samples]
                record = self._log(batch.stats, metrics, publish, waited, time.perf_counter() - started, lengths)
                # metrics.jsonl has the line; the tracker mirrors it (and never raises)
                self.reporting.step(record)
                self.reporting.samples(samples, batch.stats.rewards, self.version - 1, self.step)  # gated at version-1
            if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
                self.checkpoint()
        if not (self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0):
            self.checkpoint()
        self.export_hf()
        return 0

    def _train(self, samples: list[GatedSample]) -> dict:
        """This rank's slice of the step's `samples` through one train step; its metrics and `train_s`."""
        step = TrainInputs.of(samples, self.rank, self.world)
        start = time.perf_counter()
        metrics = train_step(
            self.model,
            self.optimizer,
            step.batch,
            self.train_cfg,
            self.world,
            global_tokens=step.tokens,
            global_sequences=step.sequences,
            probe_mask=step.probe_mask,
            replay=self.replay,
            autocast=self.autocast,
        )
        metrics["train_s"] = time.perf_counter() - start
        metrics["train_tokens"] = step.tokens
        return _ratios(metrics)

    def _log(
        self, gate: GateStats, metrics: dict, publish: dict, waited: float, step_s: float, lengths: list[int]
    ) -> StepMetrics:
        """One StepMetrics line (inflight/wire/records.py): train_step's metrics and the publish report are fields of
        it, so a metric added or renamed there without the record fails here, in the first step of any learner test."""
        values = step_values(gate, metrics, waited, step_s, lengths)
        record = self.service.write_step(
            {"step": self.step, "version": self.version, **values, **publish, **self.param_counts}
        )
        log_step(record, metrics.get("loss", 0.0))
        return record

    def checkpoint(self) -> None:
        """Every rank: model, optimizer, step, version and (from rank 0's service) the consumed groups; rank 0 then
        rotates the journal and prunes to `--keep-checkpoints`."""
        consumed = self.service.consumed_state() if self.rank == 0 else {"consumed": {}, "consumed_by_server": {}}
        root = self.run_dir / "checkpoints"
        meta = {"step": self.step, "version": self.version, **consumed}
        save_checkpoint(checkpoint_dir(root, self.step), self.model, self.optimizer, meta)
        if self.rank == 0:  # the checkpoint holds the trained groups; the journal keeps only the others
            self.service.rotate_journal()
            for old in prune_checkpoints(root, self.cfg.keep_checkpoints):
                log.info("checkpoint %s deleted (--keep-checkpoints %d)", old.name, self.cfg.keep_checkpoints)

    def export_hf(self) -> None:
        """The trained weights as an HF directory (`<run_dir>/hf-final`) that vLLM or transformers can load; with
        `--lora-rank` the adapter (`AdapterOutputs.export`)."""
        if self.adapter is not None:
            return self.adapter.export(self.run_dir, self.version)
        export_hf(self.model, self.model_path, self.run_dir / "hf-final", self.version, self.rank)

    def close(self) -> None:
        """Rank 0: close the service (the serves commit the last update first, then the sockets and files close)."""
        if self.service is not None:
            self.service.close()
        if self.reporting is not None:
            self.reporting.close()


def open_reporting(cfg: LearnConfig) -> Reporting:
    """Rank 0's tracker (--report-to), opened before the service binds: a serve started on its ready line is followed
    from its first progress line on."""
    return Reporting(cfg.report_to, Path(cfg.run_dir), dataclasses.asdict(cfg), cfg.model, cfg.log_samples_every)


def resume(run_dir: Path, model: PolicyModel, optimizer: torch.optim.Optimizer) -> Resumed:
    """`--resume`: the latest checkpoint under `<run_dir>/checkpoints` loaded into `model` and `optimizer`
    (collective); where the run goes on from."""
    path = latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise SystemExit(f"--resume: no checkpoint under {run_dir / 'checkpoints'}; drop --resume to start")
    meta = load_checkpoint(path, model, optimizer)
    log.info("resumed from %s: step %d, version %d", path, meta["step"], meta["version"])
    return Resumed(meta["version"], meta["step"], meta["consumed"], meta.get("consumed_by_server", {}))


def _ratios(metrics: dict) -> dict:
    """train_step's sums as the StepMetrics ratios: the lag-0 mismatch (with routing replay: with and without it) and
    the routing agreement."""
    probes = metrics.get("probe_tokens")
    if probes:
        metrics["mismatch_lag0"] = metrics["probe_abs_logratio_sum"] / probes
        if "probe_abs_logratio_sum_unreplayed" in metrics:
            metrics["mismatch_lag0_unreplayed"] = metrics["probe_abs_logratio_sum_unreplayed"] / probes
    if metrics.get("route_total"):
        metrics["routing_agreement"] = metrics["route_matches"] / metrics["route_total"]
    return metrics


def train_config(cfg: LearnConfig) -> TrainConfig:
    """The train step's settings from the flags (the loss, the sampling knobs, clipping); its autocast dtype is
    `Learner.autocast`."""
    return TrainConfig(
        **declared_values(cfg, TrainStepKnobs),  # lr, grad_clip, fused_loss: TrainConfig's own declarations
        loss=LossConfig(**declared_values(cfg, PolicyLossKnobs)),  # --loss is LossConfig's kind
        sampling=cfg.sampling_knobs(),  # --temperature, --top-p, --top-k, --min-p
    )


def step_values(gate: GateStats, metrics: dict, waited: float, step_s: float, lengths: list[int]) -> dict:
    """A step's StepMetrics fields from the gate's statistics and train_step's metrics (all but step, version and
    the publish report)."""
    rewards = gate.rewards
    # `tokens` is train_step's (rank 0's trained tokens); the batch's, gated included, is the lag histogram's sum.
    return {
        "time": time.time(),
        "reward": sum(rewards) / len(rewards),
        "lag_histogram": dict(sorted(gate.lag_histogram.items())),
        "kv_lag_histogram": dict(sorted(gate.kv_lag_histogram.items())),
        "groups": gate.group_ids,
        "lengths": lengths,
        "gated_fraction": gate.gated / max(gate.tokens, 1),
        "wait_s": waited,
        "step_s": step_s,
        "tokens_per_s": metrics.get("train_tokens", 0) / max(metrics.get("train_s", 1e-9), 1e-9),
        **metrics,
        **_episodes(gate),
        **({"route_bytes_per_token": gate.route_bytes / gate.routed_tokens} if gate.routed_tokens else {}),
    }


def log_step(record: StepMetrics, loss: float) -> None:
    log.info(
        "step %d v%d reward %.3f loss %.4f wait %.2fs train %.2fs publish %.2fs",
        record.step,
        record.version,
        record.reward,
        loss,
        record.wait_s,
        record.train_s,
        record.publish_s or 0.0,
    )


def export_hf(model: PolicyModel, model_path: Path, out: Path, version: int, rank: int) -> None:
    """Every rank gathers (collective); rank 0 writes the weights into a copy of `model_path`'s config and tokenizer
    at `out`, tagged with `version`."""
    state = full_hf_state(model)
    if rank != 0:
        return
    shutil.copytree(model_path, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
    for old in out.glob("*.safetensors"):
        old.unlink()
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(out / "model.safetensors"),
        {"format": "pt", "inflight_version": str(version)},
    )


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, place this rank (`--device`, torchrun's environment: `learner/world.py:start_world`), resolve
    the precision, train until done or SIGTERM/SIGINT (a clean stop still checkpoints and exports); the exit code."""
    about = "Consume rollouts, train with FSDP2 (token-level IS, staleness gate), push weights to every serve."
    cfg = parse_dataclass(LearnConfig, argv, "python -m inflight.learn", about)
    setup_logging()
    try:
        world = start_world(cfg.device, cfg.backend)
    except WorldError as exc:  # before any model or socket: the message names the flag and the fix
        raise SystemExit(f"inflight.learn: {exc}") from None
    cfg.device = world.device_type  # the resolved config says where the run trained
    _resolve_precision(cfg, world)
    if world.rank == 0:
        write_resolved(cfg, Path(cfg.run_dir) / "learn-config.json")
    try:
        learner = Learner(cfg, world)
    except RoutingReplayError as exc:  # --routing-replay on for a model it cannot replay: refused at start, by name
        world.close(False)
        raise SystemExit(f"inflight.learn: {exc}") from None

    stopping = learner.stopping
    for stop in (signal.SIGTERM, signal.SIGINT):  # stop after the step in progress, checkpointed and exported
        signal.signal(stop, lambda *_: stopping.set())
    clean = False
    try:
        code = learner.run()
        clean = True
        return code
    finally:
        learner.close()
        del learner  # the model's FSDP reference cycles go while the group lives (World.close), not at exit
        world.close(clean)


def _resolve_precision(cfg: LearnConfig, world: World) -> None:
    """`--autocast auto` becomes bfloat16 or none for the world's device (inflight/machine.py), logged with why."""
    precision = resolve_precision(cfg.autocast, world.device_type)
    cfg.autocast = "bfloat16" if precision.is_bf16 and cfg.autocast != "none" else "none"
    log.info(
        "learner rank %d/%d on %s (default group %s, weights over %s); precision: decoder %s, "
        "LM head/logprobs/optimizer %s (%s)",
        world.rank,
        world.size,
        world.device,
        world.backend,
        world.weights_backend,
        "bfloat16" if cfg.autocast == "bfloat16" else cfg.dtype,
        cfg.dtype,
        precision.reason,
    )


def _episodes(gate: GateStats) -> dict:
    """The StepMetrics episode fields, for a batch with environment tokens (absent for single-turn batches)."""
    if not gate.env_tokens:
        return {}
    return {
        "env_tokens": gate.env_tokens,
        "turns_mean": sum(gate.turns) / max(len(gate.turns), 1),
        "turns": gate.turns,
        "env_lengths": gate.env_lengths,
    }
