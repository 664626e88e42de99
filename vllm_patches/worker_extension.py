"""InflightWorkerExtension: the engine-side half of a never-stop weight swap, mixed into vLLM's worker.

Passed as `worker_extension_cls="vllm_patches.worker_extension.InflightWorkerExtension"`; vLLM adds these methods to its
Worker and they are reached with `collective_rpc`. Flow for one update:

1. `inflight_init_weights_group(...)` joins the weights group (blocks until the learner's rank 0 joins too).
2. `inflight_begin_update(manifest)` checks names/dtypes/shapes against the served checkpoint and returns at once; a
   background thread stages the buckets while `execute_model` keeps running on the engine thread.
3. `inflight_commit_staged(version)` — called by the EngineCore utility `inflight_commit` between two steps — puts
   the update into the live model. All-or-nothing: a failure restores the previous weights and re-raises.

A delta update (the manifest's `base_version`, inflight/wire/delta.py) is applied by the staging thread to the whole
tensors this worker kept of its live version (`_inflight_held`: kept by the in-place path always, as its rollback
source, and by the swap path when the manifest says `keep_base`); the result must match every whole tensor's checksum
or tag, so a delta commits bitwise the tensors a full update would, or fails like a corrupt one.

Two commit paths, chosen once per engine with `inflight_set_update_memory` (the serve's `--update-memory`):
- `double` (default): the staging thread also loads and processes the update into a shadow copy of the changed
  layers (vllm_patches/prepared.py); the commit swaps references, O(layers), whatever the model size. Costs one
  processed copy of the weights while an update is staged.
- `low`: the commit runs vLLM's layerwise reload into the live storage on the engine thread, O(bytes); every
  parameter keeps its storage (what a kernel holding addresses, e.g. a CUDA graph, needs).

On CPU, linear weights are repacked after loading, so plain `model.load_weights` cannot update them; the commit goes
through vLLM's layerwise `reload_weights` and then re-processes a tied `lm_head`, which that path skips. Fused MoE
experts need one more step (`_experts_set_up_afresh`): vLLM's reload treats a set-up kernel as "a weight update" and
skips the experts' own post-load processing — on CPU the prepack into the grouped-gemm layout — so the live storage
received unpacked weights and the engine matched neither checkpoint.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from inflight.wire.group import GroupAddress, WeightsGroup
from inflight.wire.memory import trim_after_update
from inflight.wire.weights import UPDATE_MEMORY, ManifestError, UpdateManifest, check_against, tensor_crc32
from vllm_patches import faults
from vllm_patches.prepared import prepare
from vllm_patches.rpc import CommitApplied, GroupJoined, HeldWeights, StageStatus
from vllm_patches.staging import StagedUpdate, StageState, on_spare_cores

_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
_FLOATS = frozenset(_SAFETENSORS_DTYPES.values())
_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


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


class InflightWorkerExtension:
    """Methods added to vLLM's Worker. Instance state lives in `_inflight_*` attributes created on first use."""

    def inflight_init_weights_group(
        self, host: str, port: int, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float
    ) -> GroupJoined:
        """Join (or re-join, replacing a broken group) the weights group as `rank`."""
        old = getattr(self, "_inflight_group", None)
        if old is not None:
            old.close()
        address = GroupAddress(host, port, world_size, group_name, backend, timeout_s)
        with on_spare_cores():  # the group's transport thread receives every update's bytes: not on the decode's core
            self._inflight_group = WeightsGroup(address, rank)
        return GroupJoined(rank, group_name)

    def inflight_set_weights_key(self, key: bytes) -> bool:
        """From now on verify every update's keyed tags under `key` (the serve's --secret-file, derived by
        inflight/wire/secure.py:weights_key) and refuse tensors without one. Returns True."""
        if not isinstance(key, bytes) or len(key) != 32:
            raise ManifestError("the weights key must be 32 bytes (inflight.wire.secure.weights_key)")
        self._inflight_weights_key = key
        return True

    def inflight_set_update_memory(self, mode: str) -> str:
        """Choose the commit path for this engine's life (see the module docstring): "double" or "low". Refused once an
        update was staged: a rollback source of one path is not valid for the other. Returns the mode."""
        if mode not in UPDATE_MEMORY:
            raise ManifestError(f"update_memory is {mode!r}, expected one of {list(UPDATE_MEMORY)}")
        if getattr(self, "_inflight_stage", None) is not None and mode != self._inflight_update_memory():
            raise ManifestError("update_memory is chosen before the first update and kept for the engine's life")
        self._inflight_memory = mode
        return mode

    def _inflight_update_memory(self) -> str:
        return getattr(self, "_inflight_memory", "double")

    def inflight_worker_pid(self) -> int:
        """This worker's process id (benchmarks read its resident memory from /proc)."""
        return os.getpid()

    def inflight_parameter_storage(self) -> dict[str, int]:
        """Parameter name → data_ptr of its storage, for every engine parameter (tests: which path keeps storage)."""
        model = self.model_runner.get_model()
        return {name: p.untyped_storage().data_ptr() for name, p in model.named_parameters()}

    def inflight_held_weights(self) -> HeldWeights:
        """What this worker keeps of its live version for a delta to apply to (tests: bitwise the learner's)."""
        held = getattr(self, "_inflight_held", None)
        if held is None:
            return HeldWeights(-1, {})
        return HeldWeights(held[0], {name: tensor_crc32(t) for name, t in held[1].items()})

    def inflight_expected_tensors(self) -> dict[str, tuple[str, list[int]]]:
        """HF name → (dtype, shape) of every tensor in the served checkpoint: what an update must contain.

        Floating-point tensors are expected in the dtype the engine computes in (an fp32 engine serving a bf16
        checkpoint takes fp32 updates, so the learner's weights arrive unrounded); others as stored.
        """
        cached = getattr(self, "_inflight_expected", None)
        if cached is None:
            from safetensors import safe_open

            served = str(self.model_config.dtype).removeprefix("torch.")
            cached = {}
            for path in self._inflight_checkpoint_files():
                with safe_open(path, "pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                        sl = f.get_slice(name)
                        dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype())
                        cached[name] = (served if dtype in _FLOATS else dtype, list(sl.get_shape()))
            self._inflight_expected = cached
        return cached

    def _inflight_checkpoint_files(self) -> list[str]:
        files = sorted(glob.glob(os.path.join(self.model_config.model, "*.safetensors")))
        if not files:
            raise ManifestError(f"no *.safetensors in {self.model_config.model}: serve a local HF directory")
        return files

    def inflight_begin_update(self, manifest_bytes: bytes) -> StageStatus:
        """Validate the manifest and start staging its buckets in the background; never blocks on the transfer."""
        manifest = UpdateManifest.decode(manifest_bytes)
        check_against(manifest, self.inflight_expected_tensors())
        group = getattr(self, "_inflight_group", None)
        if group is None or group.broken:
            raise ManifestError("no usable weights group: call inflight_init_weights_group first")
        current = getattr(self, "_inflight_stage", None)
        if current is not None and current.state == StageState.RECEIVING:
            raise ManifestError(f"update v{current.manifest.version} is still being received; wait for it first")
        key = getattr(self, "_inflight_weights_key", None)
        self._inflight_updates = getattr(self, "_inflight_updates", 0) + 1  # ordinal for fault injection
        build = self._inflight_prepare if self._inflight_update_memory() == "double" else None
        held = getattr(self, "_inflight_held", None) if manifest.is_delta else None
        self._inflight_stage = StagedUpdate(manifest, group, self._inflight_device(), key, build, held).start()
        return self._inflight_stage.status()

    def _inflight_prepare(self, tensors: dict[str, torch.Tensor]):
        """On the staging thread: the update loaded and processed into a shadow of the model, ready to swap."""
        version = self._inflight_stage.manifest.version
        weights = faults.half_way(list(tensors.items()), "prepare", self._inflight_updates)
        return prepare(self.model_runner.get_model(), weights, version)

    def _inflight_device(self) -> torch.device:
        return next(self.model_runner.get_model().parameters()).device

    def inflight_update_status(self) -> StageStatus | None:
        stage = getattr(self, "_inflight_stage", None)
        return None if stage is None else stage.status()

    def inflight_wait_staged(self, timeout_s: float) -> StageStatus | None:
        """Block this worker's RPC thread until the staged update finishes (for modes that pause anyway)."""
        stage = getattr(self, "_inflight_stage", None)
        if stage is not None:
            stage.wait(timeout_s)
        return self.inflight_update_status()

    def inflight_commit_staged(self, version: int) -> CommitApplied:
        """Put the verified staged update into the live model: swap in its prepared layers (`double`) or reload it in
        place (`low`). All-or-nothing; raises if nothing valid is staged."""
        stage = getattr(self, "_inflight_stage", None)
        if stage is None or stage.state != StageState.STAGED or stage.manifest.version != version:
            got = "nothing" if stage is None else f"v{stage.manifest.version} in state {stage.state.value}"
            detail = f" ({stage.error})" if stage is not None and stage.error else ""
            raise ManifestError(f"cannot commit v{version}: {got} is staged{detail}")
        start = time.perf_counter()
        try:
            swapped = self._inflight_swap(stage) if stage.prepared is not None else self._inflight_in_place(stage)
        except Exception:
            stage.state = StageState.FAILED
            raise
        stage.state = StageState.COMMITTED
        # The whole tensors of what is now live: the in-place path's rollback source and the next delta's base. The
        # swap path keeps them only when the learner may send a delta next (manifest.keep_base): a copy of the model.
        keep = stage.prepared is None or stage.manifest.keep_base
        self._inflight_held = (version, stage.tensors) if keep else None
        applied = time.perf_counter() - start
        # Freed weights and buckets go back to the OS every 30 s (INFLIGHT_TRIM_EVERY_S), off the engine's critical
        # path: a trim after every commit added ~20 ms to each stall (inflight.wire.memory).
        trim_after_update()
        return CommitApplied(version, applied, swapped)

    def _inflight_swap(self, stage: StagedUpdate) -> int:
        layers = faults.half_way(stage.prepared.layers, "swap", self._inflight_updates)
        swapped = stage.prepared.swap_in(layers)  # all-or-nothing by itself; the old weights go on return
        self.model_runner.reset_encoder_cache()  # what reload_weights also invalidates (multimodal caches)
        return swapped

    def _inflight_in_place(self, stage: StagedUpdate) -> int:
        stage.ready_on_current_stream()  # CUDA: the copies below queue behind the side stream's transfer
        try:
            self._inflight_apply(faults.half_way(list(stage.tensors.items()), "apply", self._inflight_updates))
        except Exception:
            self._inflight_apply(self._inflight_rollback_source())
            raise
        return 0

    def _inflight_apply(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        tied = getattr(self.model_config.hf_config, "tie_word_embeddings", False)
        if getattr(self, "_inflight_log_filter", None) is None:
            expected = ["RotaryEmbedding", "ParallelLMHead"] if tied else ["RotaryEmbedding"]
            self._inflight_log_filter = _ExpectedReloadWarnings(expected)
            logging.getLogger(_LAYERWISE_LOGGER).addFilter(self._inflight_log_filter)
        with _experts_set_up_afresh(model):
            try:
                self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
            except Exception:
                # vLLM's reload has no cleanup of its own: layers it had not reached are left on the meta device with
                # deferred loaders, and the rollback's reload then fails on them ("no attribute 'weight_loader'").
                # Finalising puts every layer back on real tensors (partly new), which the rollback then overwrites.
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(model, self.model_config)
                raise
        if tied and lm_head is not None and hasattr(lm_head, "quant_method"):
            # reload_weights skips a tied lm_head; on CPU it keeps its own prepacked copy of the old matrix.
            lm_head.quant_method.process_weights_after_loading(lm_head)

    def _inflight_rollback_source(self) -> Iterator[tuple[str, torch.Tensor]]:
        held = getattr(self, "_inflight_held", None)
        if held is not None:
            yield from held[1].items()
            return
        from safetensors import safe_open

        for path in self._inflight_checkpoint_files():
            with safe_open(path, "pt") as f:
                for name in f.keys():  # noqa: SIM118
                    yield name, f.get_tensor(name)


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
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

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
