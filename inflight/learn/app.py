"""`python -m inflight.learn`: consume rollouts, train with FSDP2, push weights back to every serve.

Runs as one process or under torchrun (gloo on CPU, NCCL on GPU). Rank 0 owns the sockets (rollouts PULL, control
ROUTER, the weights-group store); every step it waits for `groups_per_step` complete groups, gates stale tokens, and
broadcasts the samples; all ranks train on their slice; the new full weights go out as `version + 1`. The loop is
visible in `Learner.run`; each step appends one line to `<run_dir>/metrics.jsonl`.
"""

from __future__ import annotations

import collections
import logging
import signal
import sys
import time
from pathlib import Path

import torch

from inflight.config import parse_dataclass, setup_logging, write_resolved
from inflight.learn.config import LearnConfig
from inflight.wire.memory import trim_after_update
from inflight.wire.records import StepMetrics, encode_line, to_record

log = logging.getLogger("inflight.learn")


class Learner:
    def __init__(self, cfg: LearnConfig, rank: int, world: int):
        from inflight.models import resolve_model
        from learner.model import full_hf_state, load_policy, shard_policy
        from learner.step import TrainConfig, make_optimizer

        torch.manual_seed(cfg.seed)
        self.cfg, self.rank, self.world = cfg, rank, world
        self.run_dir = Path(cfg.run_dir)
        self.model_path = resolve_model(cfg.model)
        self.model = load_policy(self.model_path, dtype=getattr(torch, cfg.dtype))
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh("cpu", (world,))
            shard_policy(self.model, self.mesh)
        self.train_cfg = TrainConfig(
            lr=cfg.lr,
            grad_clip=cfg.grad_clip,
            temperature=cfg.temperature,
            autocast=cfg.autocast,
            fused_loss=cfg.fused_loss,
            loss=_loss_config(cfg),
        )
        self.optimizer = make_optimizer(self.model, self.train_cfg)
        self.version, self.step, consumed, by_server = 0, 0, [], {}
        if cfg.resume:
            self.version, self.step, consumed, by_server = self._resume()
        self.stop_requested = False
        self.first_step = self.step
        state = full_hf_state(self.model)
        if rank == 0:
            self._open_sockets(state, consumed, by_server)

    def _resume(self):
        from learner.checkpoint import latest_checkpoint, load_checkpoint

        path = latest_checkpoint(self.run_dir / "checkpoints")
        if path is None:
            raise SystemExit(f"--resume: no checkpoint under {self.run_dir / 'checkpoints'}; drop --resume to start")
        meta = load_checkpoint(path, self.model, self.optimizer)
        log.info("resumed from %s: step %d, version %d", path, meta["step"], meta["version"])
        return meta["version"], meta["step"], meta["consumed"], meta.get("consumed_by_server", {})

    def _open_sockets(self, state, consumed, by_server) -> None:
        from inflight.learn.buffer import RolloutBuffer
        from inflight.learn.publisher import WeightPublisher
        from inflight.wire.endpoints import ControlServer, RolloutReceiver

        cfg = self.cfg
        keys = None
        if cfg.secret_file:
            from inflight.wire.secure import derive_keys, read_secret

            keys = derive_keys(read_secret(cfg.secret_file))
        self.receiver = RolloutReceiver(cfg.host, cfg.rollouts_port, keys=keys)
        self.control = ControlServer(cfg.host, cfg.control_port, keys=keys)
        self.publisher = WeightPublisher(self.control, cfg.host, cfg.weights_port, cfg.backend, cfg.timeout_s,
                                         cfg.bucket_mb << 20)  # fmt: skip
        self.publisher.set_model(state, cfg.contract())  # serves that differ are refused at Hello
        if self.version > 0:  # serves start from the base checkpoint: they get the resumed weights when they join
            self.publisher.latest = (self.version, state)
        self.buffer = RolloutBuffer(cfg.model, consumed, cfg.temperature)
        self.buffer.consumed_by_server.update(by_server)
        self._open_journal()
        self.metrics_file = (self.run_dir / "metrics.jsonl").open("a")
        log.info("learner listening: rollouts %s, control %s, weights store port %d", self.receiver.address,
                 self.control.address, self.publisher.store_port)  # fmt: skip
        print(f"inflight.learn ready: rollouts {self.receiver.address} control {self.control.address} weights "
              f"{cfg.host}:{self.publisher.store_port}", file=sys.stderr, flush=True)  # fmt: skip

    def _open_journal(self) -> None:
        """The write-ahead log of accepted rollouts (inflight/learn/journal.py): replayed on --resume, else emptied."""
        import shutil

        from inflight.learn.journal import RolloutJournal
        from inflight.wire.rollouts import RolloutError, decode_rollout

        directory = self.run_dir / "journal"
        if not self.cfg.resume and directory.exists():
            shutil.rmtree(directory)
        self.journal = RolloutJournal(directory)
        self.raw: dict[str, bytes] = {}  # rollout id -> record, for records of groups not trained yet
        self.acks: dict[str, set[str]] = collections.defaultdict(set)  # server id -> group ids to acknowledge
        replayed = 0
        for record in self.journal.replay():
            try:
                rollout = decode_rollout(record)
            except RolloutError as exc:  # our own fsynced file: only a bug or a disk fault gets here
                log.error("journal: skipping an unreadable record: %s", exc)
                continue
            if self.buffer.add(rollout, replay=True):
                self.raw[rollout.rollout_id] = record
                replayed += 1
        if replayed:
            log.info("journal: replayed %d rollouts of untrained groups (%d groups complete)", replayed,
                     len(self.buffer.ready))  # fmt: skip

    def _receive(self) -> None:
        """Take what arrived, journal the accepted records (fsync), then queue acknowledgements of held groups."""
        received = self.receiver.receive_raw(timeout_s=0.05)
        fresh = []
        for rollout, record in received:
            if self.buffer.add(rollout):
                self.raw[rollout.rollout_id] = record
                fresh.append(record)
        self.journal.append(fresh)
        for rollout, _ in received:  # a re-sent group the learner already holds is acknowledged again
            if self.buffer.holds(rollout.group_id):
                self.acks[rollout.server_id].add(rollout.group_id)

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> int:
        from inflight.learn.dist import broadcast_samples

        while not self.cfg.steps or self.step < self.cfg.steps:
            started = time.perf_counter()
            batch = self._next_samples() if self.rank == 0 else None
            waited = time.perf_counter() - started
            samples = broadcast_samples(batch[0] if batch else None, self.rank, self.world)
            if not samples:
                break
            metrics = self._train(samples)
            self.version += 1
            self.step += 1
            publish = self._publish() if self.version % self.cfg.publish_every == 0 else {}
            if self.rank == 0:
                self._log(batch[1], metrics, publish, waited, time.perf_counter() - started,
                          [len(s.completion_ids) for s in samples])  # fmt: skip
            if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
                self.checkpoint()
        if not (self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0):
            self.checkpoint()
        self.export_hf()
        return 0

    def _next_samples(self):
        """Rank 0: wait for `groups_per_step` complete groups; None when a stop was requested."""
        from inflight.learn.samples import build_samples

        last_progress = 0.0
        while not self.stop_requested:
            self._receive()
            self.publisher.pump(0)
            self.publisher.catch_up(dict(self.buffer.consumed_by_server))
            # --wait-for-serves: the first step waits until that many serves have said Hello.
            waiting = self.step == self.first_step and len(self.publisher.serves) < self.cfg.wait_for_serves
            groups = None if waiting else self.buffer.take(self.cfg.groups_per_step)
            if groups is not None:
                for group in groups:
                    for rollout in group:
                        self.raw.pop(rollout.rollout_id, None)
                self.publisher.send_progress(dict(self.buffer.consumed_by_server), self.version, self.acks)
                return build_samples(groups, self.version, self.cfg.max_lag, self.cfg.advantage)
            if any(self.acks.values()) or time.monotonic() - last_progress > 1.0:
                self.publisher.send_progress(dict(self.buffer.consumed_by_server), self.version, self.acks)
                last_progress = time.monotonic()
        return None

    def _train(self, samples) -> dict:
        from learner.step import Sample, make_batch, train_step

        mine = samples[self.rank :: self.world]
        as_train = [Sample(s.prompt_ids, s.completion_ids, s.behaviour_logprobs, s.advantage, s.token_mask)
                    for s in mine]  # fmt: skip
        tokens = sum(sum(s.token_mask) for s in samples)
        batch = make_batch(as_train, pad_id=0)
        fresh = [t._replace(token_mask=s.on_policy_prefix) for t, s in zip(as_train, mine, strict=True)]
        lag0 = make_batch(fresh, pad_id=0).mask
        start = time.perf_counter()
        sequences = sum(any(s.token_mask) for s in samples)  # a wholly gated sample does not count
        metrics = train_step(self.model, self.optimizer, batch, self.train_cfg, self.world, global_tokens=tokens,
                             global_sequences=sequences, probe_mask=lag0 & batch.mask)  # fmt: skip
        metrics["train_s"] = time.perf_counter() - start
        if metrics.get("probe_tokens"):
            metrics["mismatch_lag0"] = metrics["probe_abs_logratio_sum"] / metrics["probe_tokens"]
        metrics["train_tokens"] = tokens
        return metrics

    def _publish(self) -> dict:
        from learner.model import full_hf_state

        start = time.perf_counter()
        state = full_hf_state(self.model)  # collective: every rank gathers, rank 0 keeps the tensors
        if self.rank != 0:
            return {}
        report = self.publisher.publish(state, self.version, dict(self.buffer.consumed_by_server))
        seconds = time.perf_counter() - start
        del state  # the snapshot (the publisher keeps what a late joiner needs)
        trim_after_update()  # freed snapshots and buckets back to the OS (INFLIGHT_TRIM_EVERY_S)
        return {"publish_s": seconds, "publish_bytes": report.bytes, "publish_serves": report.serves,
                "publish_bytes_per_s": report.bytes / report.seconds if report.seconds else 0.0,
                "publish_failed": report.failed}  # fmt: skip

    def _log(self, gate, metrics: dict, publish: dict, waited: float, step_s: float, lengths: list[int]) -> None:
        """One StepMetrics line (inflight/wire/records.py): train_step's metrics and the publish report are fields of
        it, so a metric added or renamed there without the record fails here, in the first step of any learner test."""
        rewards = gate.rewards
        # `tokens` is train_step's (rank 0's trained tokens); the batch's, gated included, is the lag histogram's sum.
        record = to_record({
            "step": self.step, "version": self.version, "time": time.time(), "reward": sum(rewards) / len(rewards),
            "lag_histogram": dict(sorted(gate.lag_histogram.items())), "groups": gate.group_ids, "lengths": lengths,
            "gated_fraction": gate.gated / max(gate.tokens, 1), "wait_s": waited,
            "step_s": step_s, "tokens_per_s": metrics.get("train_tokens", 0) / max(metrics.get("train_s", 1e-9), 1e-9),
            "rejected": dict(self.buffer.rejected) | {"wire:" + k: v for k, v in self.receiver.rejected.items()},
            **metrics, **publish,
        }, StepMetrics)  # fmt: skip
        self.metrics_file.write(encode_line(record))
        self.metrics_file.flush()
        log.info("step %d v%d reward %.3f loss %.4f wait %.2fs train %.2fs publish %.2fs", self.step, self.version,
                 record.reward, metrics.get("loss", 0.0), waited, record.train_s, record.publish_s or 0.0)  # fmt: skip

    def checkpoint(self) -> None:
        from learner.checkpoint import checkpoint_dir, prune_checkpoints, save_checkpoint

        consumed = self.buffer.consumed.to_json() if self.rank == 0 else {}
        by_server = dict(self.buffer.consumed_by_server) if self.rank == 0 else {}
        meta = {"step": self.step, "version": self.version, "consumed": consumed, "consumed_by_server": by_server}
        root = self.run_dir / "checkpoints"
        save_checkpoint(checkpoint_dir(root, self.step), self.model, self.optimizer, meta)
        if self.rank == 0:  # the checkpoint holds the trained groups; the journal keeps only the others
            self.journal.rotate(self.raw.values())
            for old in prune_checkpoints(root, self.cfg.keep_checkpoints):
                log.info("checkpoint %s deleted (--keep-checkpoints %d)", old.name, self.cfg.keep_checkpoints)

    def export_hf(self) -> None:
        """The trained weights as an HF directory (`<run_dir>/hf-final`) that vLLM or transformers can load."""
        import shutil

        from safetensors.torch import save_file

        from learner.model import full_hf_state

        state = full_hf_state(self.model)  # collective
        if self.rank != 0:
            return
        out = self.run_dir / "hf-final"
        shutil.copytree(self.model_path, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
        for old in out.glob("*.safetensors"):
            old.unlink()
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), {"format": "pt",
                  "inflight_version": str(self.version)})  # fmt: skip

    def close(self) -> None:
        if self.rank == 0:
            self.publisher.close()
            self.receiver.close()
            self.control.close()
            self.metrics_file.close()
            self.journal.close()


def _loss_config(cfg: LearnConfig):
    from learner.losses import LossConfig

    return LossConfig(kind=cfg.loss, tis_cap=cfg.tis_cap, aggregation=cfg.aggregation)


def main(argv: list[str] | None = None) -> int:
    about = "Consume rollouts, train with FSDP2 (token-level IS, staleness gate), push weights to every serve."
    cfg = parse_dataclass(LearnConfig, argv, "python -m inflight.learn", about)
    setup_logging()
    from inflight.machine import resolve_precision

    precision = resolve_precision(cfg.autocast, "cpu")  # the learner runs on CPU (issue 16 moves it to CUDA)
    cfg.autocast = "bfloat16" if precision.is_bf16 and cfg.autocast != "none" else "none"
    log.info("learner precision: decoder %s, LM head/logprobs/optimizer %s (%s)",
             "bfloat16 autocast" if cfg.autocast == "bfloat16" else cfg.dtype, cfg.dtype, precision.reason)  # fmt: skip
    from inflight.learn.dist import init_world

    rank, world = init_world("nccl" if cfg.backend == "nccl" else "gloo")
    if rank == 0:
        write_resolved(cfg, Path(cfg.run_dir) / "learn-config.json")
    learner = Learner(cfg, rank, world)

    def request_stop(*_):
        learner.stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    from inflight.learn.dist import close_world

    clean = False
    try:
        code = learner.run()
        clean = True
        return code
    finally:
        learner.close()
        close_world(clean)
