"""InflightWorkerExtension: the engine-side half of a never-stop weight swap, mixed into vLLM's worker.

Passed as `worker_extension_cls="vllm_patches.worker_extension.InflightWorkerExtension"`; vLLM adds these methods to its
Worker and they are reached with `collective_rpc`. The class is a facade: vLLM requires one class, so each method
hands its call to one collaborator, and everything kept between calls is one `WorkerUpdateState`, made at the first
call. Flow for one update, one way:

1. `inflight_init_weights_group(...)` starts joining the weights group on a thread of its own (vllm_patches/joining.py)
   and returns at once; the engine asks `inflight_weights_group_state` until every worker joined.
2. `inflight_begin_update(manifest, ticket)` checks names/dtypes/shapes against the served checkpoint
   (vllm_patches/checkpoint.py) and returns at once; a `vllm_patches/staging.py:StagedUpdate` thread stages the
   buckets while `execute_model` keeps running on the engine thread, and when done pushes a `StagedSignal` under the
   engine's `ticket` (`StagedNotifier`): the engine waits for that, it never asks.
3. `inflight_commit_staged(version)` — called by the EngineCore utility `inflight_commit` between two steps — puts
   the update into the live model (vllm_patches/commit.py), keeping what undoes it, and answers whether it could;
   then `inflight_settle_commit(version, keep)` keeps it on every rank, or rolls it back on every rank when any rank
   failed (vllm_patches/update_enginecore.py): all-or-nothing across tensor-parallel ranks.

A delta update (the manifest's `base_version`, inflight/wire/delta.py) is applied by the staging thread to the whole
tensors this worker kept of its live version (`LiveWeights.held`: kept by the in-place path always, as its rollback
source, and by the swap path when the manifest says `keep_base`); the result must match every whole tensor's checksum
or tag, so a delta commits bitwise the tensors a full update would, or fails like a corrupt one.

The commit path (`double`: prepared off the engine thread and swapped in; `low`: reloaded in place) is chosen once per
engine with `inflight_set_update_memory` (the serve's `--update-memory`; vllm_patches/commit.py says what each costs).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from inflight.wire.group import GroupAddress, WeightsGroup, member_rank
from inflight.wire.weights import ManifestError, UpdateManifest, check_against
from vllm_patches import faults, placement
from vllm_patches.adapter import AdapterPreparer, AdapterSlot, ServedAdapter, check_adapter_update
from vllm_patches.arenas import LayersOutgrewArena, StagingArenas
from vllm_patches.checkpoint import ServedCheckpoint
from vllm_patches.commit import LiveWeights, ModelRunner, RollbackFailed, held_checksums, prepared_commit
from vllm_patches.joining import GroupJoin
from vllm_patches.placement import Placement, SliceLayout
from vllm_patches.prepared import ShadowPreparer
from vllm_patches.routes import RoutedExperts, RouteRecorder, replays_cuda_graphs
from vllm_patches.rpc import GroupJoined, HeldWeights, RankCommit, RankSettled, StageStatus
from vllm_patches.staging import (
    HeldTensors,
    PrepareUpdate,
    StagedNotifier,
    StagedUpdate,
    StageState,
    Tail,
    check_committable,
    prepares_beside,
)

log = logging.getLogger(__name__)


def check_delta_base(manifest: UpdateManifest, held: HeldTensors | None) -> None:
    """A delta applies to checkpoint-format tensors: refused (ManifestError) on a version `low` kept as kernel-format
    copies, which the learner said it would send no delta on (its `keep_base`); its next update is then a full one."""
    if manifest.is_delta and held is not None and held.kernel:
        raise ManifestError(
            f"update v{manifest.version} is a delta on v{manifest.base_version}, whose manifest said no delta would "
            f"follow (keep_base false): this worker kept v{held.version} as kernel-format copies, not its tensors"
        )


def reload_after_outgrown(stage: StagedUpdate | None, live: LiveWeights) -> None:
    """After `low`'s copies outgrew the arena (`LayersOutgrewArena`: a kernel format larger than the checkpoint's by
    more than the room the plan leaves them, e.g. padded or repacked), the engine reloads in place from the next
    update on, which needs the update's own bytes only: one update refused, not every one. Logged once."""
    if stage is None or not live.copies_prepared:
        return
    if stage.failed_with is not None and issubclass(stage.failed_with, LayersOutgrewArena):
        live.copies_prepared = False
        version = stage.manifest.version
        log.warning("v%d's prepared layers outgrew the arena: the engine reloads in place from now on", version)


def prepared_tail(
    live: LiveWeights, manifest: UpdateManifest, layout: SliceLayout | None, arenas: StagingArenas | None
) -> Tail | None:
    """Where a model update's layers, prepared off the engine thread to be copied in, are made (staging.py:Tail), or
    None: swapped in (`double` eager), or reloaded in place on the engine thread (`low` where the model cannot take
    copies, or an update a delta may follow whose arena has no room beside it: `prepares_beside`)."""
    if not live.copies_prepared:
        return None
    if live.memory == "double":
        return "beside"
    if not manifest.keep_base:
        return "over"
    if arenas is not None and prepares_beside(arenas.staging.nbytes, manifest, layout):
        return "beside-base"
    return None


@dataclass
class WorkerUpdateState:
    """Everything the worker extension keeps between RPCs: its collaborators and the update being staged."""

    checkpoint: ServedCheckpoint
    live: LiveWeights
    group: WeightsGroup | None = None
    weights_key: bytes | None = None
    notifier: StagedNotifier | None = None
    stage: StagedUpdate | None = None
    updates: int = 0  # updates begun, from 1: the ordinal fault injection counts (vllm_patches/faults.py)
    adapter: AdapterSlot | None = None  # a serve with --lora-rank: adapter updates go there, not into the model
    staging: str = "auto"  # "sliced": keep this rank's slices; "full": whole tensors; "auto": sliced when TP/EP > 1
    arenas: StagingArenas | None = None  # the device and host arenas every update is staged within (the plan's bytes)
    joining: GroupJoin | None = None  # the last join of the weights group, formed off the engine's thread
    _lock: threading.Lock = field(default_factory=threading.Lock)  # the engine's thread and a joining thread

    def join(self, address: GroupAddress, rank: int, device: torch.device) -> GroupJoin:
        """Close the current group (no update begins on it, nor before the new one formed) and start forming
        the new one on its own thread."""
        with self._lock:
            if self.group is not None:
                self.group.close()
                self.group = None
            self.joining = GroupJoin(address, rank, device, self._formed)
        return self.joining.start()

    def join_state(self) -> GroupJoined:
        if self.joining is None:
            raise ManifestError("no weights group is being joined: call inflight_init_weights_group first")
        return self.joining.state()

    def _formed(self, join: GroupJoin, group: WeightsGroup) -> bool:
        """The joining thread's group is taken if its join is still the last one asked for; else it is closed."""
        with self._lock:
            if self.joining is join:
                self.group = group
                return True
        group.close()
        return False

    def begin(self, manifest: UpdateManifest, model: torch.nn.Module, ticket: int, vllm_config: Any) -> StagedUpdate:
        """Start staging `manifest` in the background; refuses (ManifestError, naming the fix) without a usable group
        or staged-signal channel, or while the previous update is still being received."""
        served = self.adapter.served if self.adapter is not None else None
        check_adapter_update(manifest.adapter, served)
        check_against(manifest, served.expected if served is not None else self.checkpoint.expected())
        if self.group is None or self.group.broken:
            raise ManifestError("no usable weights group: call inflight_init_weights_group first")
        if self.notifier is None:
            raise ManifestError("no staged-signal channel: call inflight_signal_staged_to first (InflightEngine.start)")
        if self.stage is not None and self.stage.state == StageState.RECEIVING:
            raise ManifestError(f"update v{self.stage.manifest.version} is still being received; wait for it first")
        held, arenas = self.live.held, self.arenas
        check_delta_base(manifest, held)
        reload_after_outgrown(self.stage, self.live)
        self.updates += 1
        layout = self._layout(manifest, model, vllm_config)  # a contradicting shape fails here, before any bucket
        tail = None if self.adapter is not None else prepared_tail(self.live, manifest, layout, arenas)
        prepare = self._preparer(manifest, model, vllm_config, layout, tail)
        device = next(model.parameters()).device
        announce = functools.partial(self.notifier.announce, ticket)
        stage = StagedUpdate(
            manifest, self.group, device, self.weights_key, prepare, held, announce, layout, arenas, tail
        )
        if self.adapter is not None and _split(vllm_config):  # vLLM's LoRA layers slice A/B at commit: named whole
            stage.whole = sorted(t.name for t in manifest.tensors)
        self.stage = stage.start()
        return self.stage

    def _layout(self, manifest: UpdateManifest, model: torch.nn.Module, vllm_config: Any) -> SliceLayout | None:
        """This rank's slices of a model update, or None to stage whole tensors: an adapter update (a few
        MB; vLLM's LoRA layers slice A and B per rank at commit, `slice_lora_a`/`slice_lora_b`, and the update's
        report names every adapter tensor as kept whole), a single-rank engine (its slices are the whole tensors), or
        `staging` "full"."""
        if self.adapter is not None or self.staging == "full" or (self.staging == "auto" and not _split(vllm_config)):
            return None
        layout = SliceLayout.resolve(model, manifest)
        if faults.fails("slice", self.updates, self.live.worker.rank):
            layout.placements = faults.misplaced(layout.placements)
        return layout

    def _preparer(
        self,
        manifest: UpdateManifest,
        model: torch.nn.Module,
        vllm_config: Any,
        layout: SliceLayout | None,
        tail: str | None,
    ) -> PrepareUpdate | None:
        """An adapter update is always prepared (into vLLM's LoRAModel); a model update with `double`, or with `low`'s
        copies (`tail`)."""
        if self.adapter is not None:
            return AdapterPreparer(self.adapter, manifest.version)
        if self.live.memory == "double" or tail is not None:
            return ShadowPreparer(model, manifest.version, self.updates, vllm_config, layout)
        return None

    def set_staging(self, mode: str) -> str:
        if mode not in ("auto", "sliced", "full"):
            raise ManifestError(f"staging is {mode!r}, expected one of ['auto', 'sliced', 'full']")
        self.staging = mode
        return mode

    def set_arenas(self, device_bytes: int, host_bytes: int) -> int:
        """From now on stage every update within one device arena and keep the live version in one host arena
        (vllm_patches/arenas.py), the device one made now, the host one once something is kept, both reused. Between
        updates (tests: an arena too small) the version kept so far moves into the new host arena first. Returns
        `device_bytes`."""
        if self.stage is not None and self.stage.state == StageState.RECEIVING:
            raise ManifestError(f"update v{self.stage.manifest.version} is being received: set the arenas after it")
        if device_bytes < 0 or host_bytes < 0:
            raise ManifestError(f"arena sizes must be >= 0 bytes, got {device_bytes} and {host_bytes}")
        device = next(self.live.worker.model_runner.get_model().parameters()).device
        arenas = StagingArenas(device_bytes, host_bytes, device)
        if self.live.held is not None:
            self.live.held.tensors = arenas.hold(self.live.held.tensors)
        if self.arenas is not None:
            self.arenas.close()  # its host buffer is unregistered (CUDA); nothing refers to either buffer now
        self.arenas = arenas
        return device_bytes

    def commit(self, version: int, rank: int) -> RankCommit:
        """Phase one: the staged update into the live adapter or model, between two engine steps, undoable until
        `settle`. Never raises: the outcome names this rank's failure, if any."""
        try:
            if self.adapter is None:
                return RankCommit(rank, applied=self.live.commit(self.stage, version, self.updates))
            stage = check_committable(self.stage, version)
            applied, roll_back = self.adapter.commit(stage.prepared, version)
            stage.state = StageState.COMMITTED
            stage.release()
            self.live.hold_pending(version, None, lambda: None, roll_back)
            return RankCommit(rank, applied=applied)
        except RollbackFailed as exc:
            log.critical("rank %d: v%d failed and its rollback failed too: %s", rank, version, exc)
            return RankCommit(rank, error=f"{exc} (after: {exc.__cause__})", restored=False)
        except Exception as exc:
            log.exception("rank %d could not commit v%d (its previous weights are restored)", rank, version)
            return RankCommit(rank, error=str(exc))

    def settle(self, version: int, keep: bool, rank: int) -> RankSettled:
        """Phase two: keep the commit of `version` or roll it back, as EngineCore decided for every rank."""
        try:
            return RankSettled(rank, self.live.settle(version, keep, self.updates))
        except RollbackFailed as exc:
            log.critical("%s: this rank's weights are neither version", exc)
            return RankSettled(rank, "failed", str(exc))


class InflightWorkerExtension:
    """Methods added to vLLM's Worker, each delegating to a collaborator held by the one `WorkerUpdateState`."""

    # Provided by vLLM's Worker, which this class is mixed into (annotations only: vLLM refuses an attribute clash).
    model_runner: ModelRunner
    model_config: Any
    vllm_config: Any
    rank: int
    # vLLM never calls an __init__ of the extension: the state is made at the first call.
    _inflight: WorkerUpdateState | None = None
    _inflight_routes: RouteRecorder | None = None  # set by inflight_record_routes (--routing-replay on)

    def _inflight_state(self) -> WorkerUpdateState:
        if self._inflight is None:
            checkpoint = ServedCheckpoint(self.model_config.model, str(self.model_config.dtype).removeprefix("torch."))
            self._inflight = WorkerUpdateState(checkpoint, LiveWeights(self, checkpoint))
        return self._inflight

    def inflight_init_weights_group(
        self, host: str, port: int, first_rank: int, world_size: int, group_name: str, backend: str, timeout_s: float
    ) -> GroupJoined:
        """Start joining (or re-joining, replacing the current group) the weights group and return at once, "joining":
        the rendezvous runs on a thread of its own (vllm_patches/joining.py), not on the engine's. This serve's workers
        hold the consecutive ranks from `first_rank`, this one at its tensor-parallel rank (vLLM's `self.rank`)."""
        rank = member_rank(first_rank, self.rank, self.parallel_config.tensor_parallel_size, world_size)
        address = GroupAddress(host, port, world_size, group_name, backend, timeout_s)
        device = next(self.model_runner.get_model().parameters()).device
        return self._inflight_state().join(address, rank, device).state()

    def inflight_weights_group_state(self) -> GroupJoined:
        """The last join's state: "joining", "joined" or "failed" (with its error)."""
        return self._inflight_state().join_state()

    def inflight_set_weights_key(self, key: bytes) -> bool:
        """From now on verify every update's keyed tags under `key` (the serve's --secret-file, derived by
        inflight/wire/secure.py:weights_key) and refuse tensors without one. Returns True."""
        if not isinstance(key, bytes) or len(key) != 32:
            raise ManifestError("the weights key must be 32 bytes (inflight.wire.secure.weights_key)")
        self._inflight_state().weights_key = key
        return True

    def inflight_signal_staged_to(self, address: str) -> bool:
        """Push every update's end of staging to the engine's `StagedSignals` at `address`. Returns True."""
        state = self._inflight_state()
        if state.notifier is not None:
            state.notifier.close()
        state.notifier = StagedNotifier(address, self.rank)
        return True

    def inflight_set_update_memory(self, mode: str, prepared: str = "auto") -> str:
        """The commit path, "double" or "low", for the engine's life (vllm_patches/commit.py), and how it puts its
        prepared layers in (`prepared`: auto, swap, copy or reload, `commit.prepared_commit`); fixed by an update."""
        state, commit = self._inflight_state(), prepared_commit(mode, prepared, replays_cuda_graphs(self.vllm_config))
        return state.live.choose_memory(mode, updated=state.stage is not None, commit=commit, asked=prepared)

    def inflight_set_staging(self, mode: str) -> str:
        """What a worker stages of a model update: "sliced" (its tensor-parallel slices), "full" (every
        whole tensor, as before) or "auto" (sliced when tensor or expert parallel). Benchmarks compare the two."""
        return self._inflight_state().set_staging(mode)

    def inflight_set_staging_arenas(self, device_bytes: int, host_bytes: int) -> int:
        """The staging plan's device and host arena bytes, for every update from now on (`set_arenas`)."""
        return self._inflight_state().set_arenas(int(device_bytes), int(host_bytes))

    def inflight_worker_pid(self) -> int:
        """This worker's process id (benchmarks read its resident memory from /proc)."""
        return os.getpid()

    def inflight_parameter_storage(self) -> dict[str, int]:
        """Parameter name → data_ptr of its storage, for every engine parameter (tests: which path keeps storage)."""
        model = self.model_runner.get_model()
        return {name: p.untyped_storage().data_ptr() for name, p in model.named_parameters()}

    def inflight_placements(self, extra: list[tuple[str, list[int]]] | None = None) -> list[Placement] | str:
        """Where every served checkpoint tensor (and each of `extra`'s name/shape pairs) lands on this rank
        (vllm_patches/placement.py), or the error that would fail an update, as text."""
        expected = self._inflight_state().checkpoint.expected()
        tensors = [(name, tuple(shape)) for name, (_, shape) in expected.items()] + list(extra or [])
        try:
            return placement.resolve(self.model_runner.get_model(), tensors)
        except ManifestError as exc:
            return str(exc)

    def inflight_held_weights(self) -> HeldWeights:
        """What this worker keeps of its live version for a delta to apply to (tests: bitwise the learner's)."""
        return held_checksums(self._inflight_state().live.held)

    def inflight_expected_tensors(self) -> dict[str, tuple[str, list[int]]]:
        """HF name → (dtype, shape) of every tensor an update must contain: the served checkpoint's, or with an
        adapter the adapter's (PEFT names)."""
        state = self._inflight_state()
        return state.adapter.served.expected if state.adapter is not None else state.checkpoint.expected()

    def inflight_begin_update(self, manifest_bytes: bytes, ticket: int) -> StageStatus:
        """Validate the manifest and start staging its buckets in the background; never blocks on the transfer. When
        staging ends, the staging thread signals the engine under `ticket`."""
        manifest = UpdateManifest.decode(manifest_bytes)
        stage = self._inflight_state().begin(manifest, self.model_runner.get_model(), ticket, self.vllm_config)
        return stage.status()

    def inflight_update_status(self) -> StageStatus:
        """The current update's status (the engine asks once, to say how far an update it gave up on had got)."""
        stage = self._inflight_state().stage
        if stage is None:
            raise ManifestError("no update was begun on this worker: inflight_begin_update first")
        return stage.status()

    def inflight_wait_staged(self, timeout_s: float) -> bool:
        """Block until the current update has finished staging or `timeout_s` passed (EngineCore parks in this
        while paused: vllm_patches/update_enginecore.py:inflight_park); whether it finished. Nothing begun: True
        at once."""
        stage = self._inflight_state().stage
        return stage is None or stage.wait(timeout_s)

    def inflight_commit_staged(self, version: int) -> RankCommit:
        """Phase one of a commit: put the verified staged update into the live model — swap in its prepared layers
        (`double`) or reload it in place (`low`); an adapter update into the adapter's slot — keeping what undoes it.
        All-or-nothing on this rank; a failure is returned, not raised (`RankCommit` says why)."""
        return self._inflight_state().commit(version, self.rank)

    def inflight_settle_commit(self, version: int, keep: bool) -> RankSettled:
        """Phase two: keep the commit of `version` (every rank applied it) or roll it back (one did not)."""
        return self._inflight_state().settle(version, bool(keep), self.rank)

    def inflight_live_version(self) -> int:
        """The version of this rank's live weights (0: the served checkpoint); tests check every rank agrees."""
        return self._inflight_state().live.version

    def inflight_use_adapter(self, path: str) -> bool:
        """Serve the PEFT adapter at `path` (loaded by the engine under vllm_patches/adapter.py:ADAPTER_ID): from now on
        every update must be an update of it. Returns True."""
        self._inflight_state().adapter = AdapterSlot(self.model_runner, ServedAdapter.read(path))
        return True

    def inflight_reset_lora_state(self) -> bool:
        """Run vLLM's own `reset_lora_state` (what its `reload_weights` ends with); tests: the live adapter survives."""
        self.model_runner.reset_lora_state()
        return True

    def inflight_record_routes(self) -> int:
        """Record every fed token's top-k experts in every MoE layer from now on (vllm_patches/routes.py); refused
        for a model without MoE layers. Returns the number of MoE layers; idempotent."""
        if self._inflight_routes is None:
            experts = int(self.model_config.get_num_experts())
            self._inflight_routes = RouteRecorder(self.model_runner, experts)
        return self._inflight_routes.layers

    def inflight_take_routes(self, request_id: str) -> RoutedExperts | None:
        """A finished request's recorded routes, handed over once; None when routes are not recorded."""
        return None if self._inflight_routes is None else self._inflight_routes.take(request_id)


def _split(vllm_config: Any) -> bool:
    """Whether the engine's weights are split over ranks (tensor or expert parallelism)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return parallel is not None and (parallel.tensor_parallel_size > 1 or parallel.enable_expert_parallel)
