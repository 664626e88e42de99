"""Prepared weights: an update loaded and processed into vLLM's kernel layout off the engine thread, swapped in between
two steps by reassigning references — the zero-stall commit (`--update-memory double`, the default).

Why a copy at all: on CPU every linear layer keeps its weight only inside a packed kernel handle (`layer.cpu_linear`,
a oneDNN or sgl-kernel closure built by `dispatch_cpu_unquantized_gemm`), fused MoE experts are prepacked into the
grouped-gemm layout, and a GPU backend may re-layout in `process_weights_after_loading`. Loading + processing is
O(bytes) of work — 0.3–1 s for SmolLM2 on 2 cores — and the in-place path (`reload_weights`) does all of it on the
engine thread while generation waits. Here the same vLLM machinery runs on a *shadow* of the model instead:

1. `shadow_tree` copies every module object shallowly (its own `_parameters`/`_buffers`/`_modules` dicts and
   `quant_method`, the tensors still shared), so the shadow has the model's names and loaders and touches no live
   tensor once its layers are put on the meta device;
2. each shadow layer is restored to checkpoint format on meta and gets vLLM's online loader (`layerwise.py`), with
   no kernel tensors to copy back into: a layer whose weights are all loaded is materialised into new memory, loaded
   and processed exactly as at first load (CPU repack, MoE prepack, a tied head re-processed against the new
   embedding), into the shadow only;
3. `PreparedWeights.swap_in`, on the engine thread between two steps, moves each processed shadow layer's attributes
   (parameter and buffer dicts, kernel handles, quant method) onto the live module object. Modules are swapped by
   content, never replaced, so every holder of a live module (MoE runners, the attention registry) sees the new
   weights; the work is O(number of layers). A failure part-way puts back what it changed.

The cost is one processed copy of the weights while an update is staged (the staged checkpoint-format tensors are
released once it is built), and the previous processed set until the swap returns.

Where a kernel holds a parameter's address (CUDA graphs), references cannot be swapped: there the prepared layers are
committed by copying (`PreparedWeights.kernel_weights`, vllm_patches/commit.py): vLLM's own kernel-format reload,
`reload_weights(is_checkpoint_format=False)`, one `copy_` per parameter into the live storage, so the engine thread
pays the copy and none of the loaders' Python, and every parameter keeps its address.
"""

from __future__ import annotations

import copy
import gc
import threading
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.attention import is_deferred_attention_layer
from vllm.model_executor.model_loader.reload import layerwise
from vllm.model_executor.model_loader.reload.meta import SKIP_MODULES, restore_layer_on_meta, to_meta_tensor
from vllm.model_executor.model_loader.reload.utils import get_layer_size

from vllm_patches import faults
from vllm_patches.arenas import ArenaTail
from vllm_patches.cores import leave_the_engines_core
from vllm_patches.kernel_copy import kernel_weights

_MISSING = object()  # an attribute the live module did not have before a swap
_OWN_STATE = ("_parameters", "_buffers", "_non_persistent_buffers_set")


@dataclass
class PreparedWeights:
    """Processed shadow layers, ready to swap into the live model: `layers` pairs each live module with the
    attributes it takes from its shadow. Built by `prepare`; consumed once by `swap_in`."""

    version: int
    layers: list[tuple[torch.nn.Module, dict[str, object]]] = field(default_factory=list)
    prepare_s: float = 0.0
    replaced: list[tuple[torch.nn.Module, dict[str, object]]] = field(default_factory=list)  # swap_in's undo

    def swap_in(self, layers: Iterable | None = None) -> int:
        """Install every prepared layer on its live module; returns how many. All-or-nothing: an exception part-way
        (`layers`, the pairs to install, is a test's hook to inject one) restores the layers already swapped, then
        re-raises. O(layers): no tensor data is touched. The replaced attributes are kept until `settle`: with tensor
        parallelism another rank may fail its own swap, and then this one must be put back too."""
        undo: list[tuple[torch.nn.Module, dict[str, object]]] = []
        collecting = gc.isenabled()
        gc.disable()  # a collection started by the loop's allocations would walk the engine's whole heap mid-commit
        try:
            for live, new in self.layers if layers is None else layers:
                attributes = live.__dict__
                undo.append((live, {k: attributes.get(k, _MISSING) for k in new}))
                attributes.update(new)  # one C call per layer; the rare removed attribute is popped after
                if _MISSING in new.values():
                    _set_attributes(live, new)
        except BaseException:
            _restore(undo)
            raise
        finally:
            if collecting:
                gc.enable()
        swapped, self.layers, self.replaced = len(self.layers), [], undo
        return swapped

    def settle(self, keep: bool) -> None:
        """After `swap_in`, once every rank has answered: keep the new layers (the old ones are freed on another
        thread: returning GBs to the allocator took tens of ms on the engine thread for a 360M model, more than the
        swap itself), or put the old ones back."""
        undo, self.replaced = self.replaced, []
        if keep:
            _release_elsewhere(undo)
        else:
            _restore(undo)

    def release(self) -> None:
        """Drop the prepared layers once the copy commit has written them into the live storage (off this thread)."""
        layers, self.layers = self.layers, []
        _release_elsewhere(layers)

    def kernel_weights(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The prepared layers named as vLLM's kernel-format weights, checked for the copy commit
        (vllm_patches/kernel_copy.py)."""
        return kernel_weights(self.layers, model)


def _restore(undo: list[tuple[torch.nn.Module, dict[str, object]]]) -> None:
    for live, old in reversed(undo):
        _set_attributes(live, old)


def _release_elsewhere(layers: list) -> None:
    threading.Thread(target=_release, args=(layers,), name="inflight-release-old-weights", daemon=True).start()


def _release(old: list) -> None:
    """Drop the replaced layers off the engine's cores, once the commit's answer has gone out. A tensor's memory goes
    back to the allocator (munmap, for big ones) while its last reference is dropped, with the GIL held: started at
    once, the frees held up the engine thread's answer to the commit (360M model: commits of 1.3 to 6.5 ms)."""
    leave_the_engines_core()
    time.sleep(0.005)
    old.clear()


def _set_attributes(module: torch.nn.Module, values: dict[str, object]) -> None:
    for name, value in values.items():
        if value is _MISSING:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = value


@dataclass(frozen=True)
class ShadowPreparer:
    """The staging thread's `prepare` collaborator for one update (vllm_patches/staging.py:PrepareUpdate): builds the
    update's processed weights into a shadow of `model`; fails half-way where a test planned it for the worker's
    `ordinal`-th update (vllm_patches/faults.py). Under the worker's `vllm_config` (vLLM's process-global current
    config, which the loaders and custom ops of some layers read, e.g. expert-parallel MoE and mxfp4, and raise when it
    is unset; vLLM's own reload sets it the same way, from the worker's config)."""

    model: torch.nn.Module
    version: int
    ordinal: int
    vllm_config: Any = None  # vLLM's VllmConfig; None outside a worker (a narrow test)
    layout: Any = None  # vllm_patches/placement.py:SliceLayout when `tensors` are this rank's slices

    def __call__(self, tensors: dict[str, torch.Tensor], tail: ArenaTail | None = None) -> PreparedWeights:
        """`tail`: where the layers are materialised (arenas.py: the copy commit's ArenaTail, `low`'s ReusingTail)."""
        weights = faults.half_way(list(tensors.items()), "prepare", self.ordinal)
        weights = weights if tail is None else tail.track(weights, buffered_tensors)
        if self.layout is not None:
            weights = self.layout.carriers(weights)
        config = set_current_vllm_config(self.vllm_config) if self.vllm_config is not None else nullcontext()
        with config, tail or nullcontext():
            return prepare(self.model, weights, self.version)


def buffered_tensors() -> list[torch.Tensor]:
    """Every tensor vLLM's layerwise loaders hold for a layer not processed yet (`ReusingTail` must not write over
    them): the arguments of each buffered loader call."""
    held = []
    for info in list(layerwise.LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            held += [value for value in bound.arguments.values() if isinstance(value, torch.Tensor)]
    return held


def shadow_tree(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[torch.nn.Module, torch.nn.Module]]:
    """A shallow copy of `model`'s module tree and the live → shadow map. A module that appears twice in the tree (a
    tied head that *is* the embedding) is copied once, so the shadow keeps the aliasing."""
    pairs: dict[torch.nn.Module, torch.nn.Module] = {}
    return _visit(model, pairs), pairs


def _visit(module: torch.nn.Module, pairs: dict[torch.nn.Module, torch.nn.Module]) -> torch.nn.Module:
    # A module-level function, not a closure: a recursive closure refers to itself through its cell, a cycle that
    # kept `pairs` — every shadow module, and through them a processed copy of the weights — alive until Python's
    # next full collection, which a big process can put off for dozens of updates (SmolLM2's worker grew by GBs).
    if module in pairs:
        return pairs[module]
    shadow = copy.copy(module)
    pairs[module] = shadow
    shadow.__dict__.update({name: copy.copy(module.__dict__[name]) for name in _OWN_STATE})
    if getattr(module, "quant_method", None) is not None:  # per-layer kernel state (moe_kernel) lives there
        shadow.__dict__["quant_method"] = copy.copy(module.quant_method)
    shadow.__dict__["_modules"] = {n: None if c is None else _visit(c, pairs) for n, c in module._modules.items()}
    return shadow


def prepare(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> PreparedWeights:
    """Load and process `weights` (checkpoint names and format) into a shadow of `model`; the live model is not
    touched. Runs on any thread (the serve's staging thread, moved off the engine's cores by
    staging.leave_the_engines_core). Raises if a layer that received weights could not be processed."""
    start = time.perf_counter()
    weights = _yielding(weights)
    root, pairs = shadow_tree(model)
    root.__dict__["_do_torchao_reload"] = False  # vLLM's torchao hook would re-enter a reload
    armed = [(live, shadow) for live, shadow in pairs.items() if _arm(live, shadow)]
    with torch.no_grad():
        root.load_weights(weights)
        processed = [(live, shadow) for live, shadow in armed if _finish(shadow)]
        prepared = PreparedWeights(version, [(live, _changed(live, shadow)) for live, shadow in processed])
        prepared.layers += _tied_layers(pairs, processed)
    _forget(pairs)
    prepared.prepare_s = time.perf_counter() - start
    return prepared


def _forget(pairs: dict[torch.nn.Module, torch.nn.Module]) -> None:
    """Cut every reference the update leaves from what goes live back to its shadow, so each shadow tree is freed once
    swapped in (and the weights it replaced with it). Two kinds: vLLM's reload record of a shadow (`LAYERWISE_INFO`, a
    WeakKeyDictionary whose value refers back to its key, so it never expires), and the loaders on the new tensors —
    vLLM's `online_process_loader` wrapper closes over the shadow, and `_own_copies_of_the_rest` bound loaders to it.
    Left in place, each update's wrapper wrapped the last one's: the worker kept every shadow tree and grew by about
    one processed copy of the weights per update (a 420-s SmolLM2 run was OOM-killed at 19 GB after 44 updates)."""
    for live, shadow in pairs.items():
        info = layerwise.LAYERWISE_INFO.pop(shadow, None)
        recorded = (*info.restore_metadata[0].values(), *info.restore_metadata[1].values()) if info else ()
        for tensor in (*shadow._parameters.values(), *shadow._buffers.values(), *recorded):
            if tensor is not None:
                _rebind_loaders(tensor, shadow, live)
        if info is not None:
            info.restore_metadata = ({}, {})


def _rebind_loaders(tensor: torch.Tensor, shadow: torch.nn.Module, live: torch.nn.Module) -> None:
    """`tensor`'s loaders unwrapped from vLLM's online wrappers (kept as `__wrapped__`) and bound to `live`, not
    `shadow`. (vLLM's parameter classes keep theirs in `_weight_loader`, plain tensors in `weight_loader`.)"""
    for key, value in _unwrapped(tensor).__dict__.items():
        if isinstance(value, MethodType) and value.__self__ is shadow:
            tensor.__dict__[key] = value.__func__.__get__(live)


def _unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with every loader of its own unwrapped from vLLM's online wrappers (kept as `__wrapped__`)."""
    for key, value in list(tensor.__dict__.items()):
        while getattr(value, "__name__", "") == "online_process_loader":
            value = value.__wrapped__
        tensor.__dict__[key] = value
    return tensor


def _yielding(weights: Iterable[tuple[str, torch.Tensor]], pause_s: float = 0.002):
    """`weights`, pausing `pause_s` between tensors. The loaders are Python between the copies, and every stretch of
    it the staging thread runs is one the engine thread, back from a kernel, may wait on for the GIL: while an update
    was prepared the decode thread blocked ~2,000 times a second. A pause after each tensor leaves the GIL to the
    decode loop; measured on 2 cores with 16 requests decoding (SmolLM2, 272 tensors), 2-ms pauses cut the generation
    lost while preparing by about a quarter against 0.5-ms ones (GIL waits ~2,000 -> ~1,250/s) for a preparation of
    ~1 s instead of ~0.6 s; with no pause at all decoding slowed several-fold."""
    for item in weights:
        time.sleep(pause_s)
        yield item


def _arm(live: torch.nn.Module, shadow: torch.nn.Module) -> bool:
    """Put `shadow` in checkpoint format on meta with vLLM's deferred loader, as `initialize_layerwise_reload` does for
    a live layer, but with no kernel tensors to copy back: processing ends in the shadow's own new tensors. Returns
    whether the layer can load anything."""
    if not (shadow._parameters or shadow._buffers) or type(shadow).__name__ in SKIP_MODULES:
        return False
    info, live_info = layerwise.get_layerwise_info(shadow), layerwise.get_layerwise_info(live)
    info.restore_metadata, info.restore_device = _own_metadata(live_info.restore_metadata), live_info.restore_device
    method = shadow.__dict__.get("quant_method")
    if method is not None and hasattr(method, "moe_kernel"):
        method.moe_kernel = None  # first-load path: pad and prepack (see commit._experts_set_up_afresh)
    restore_layer_on_meta(shadow, info)
    _own_copies_of_the_rest(live, shadow)
    if get_layer_size(shadow) == 0:
        return False
    layerwise.initialize_online_processing(shadow)
    return True


def _own_metadata(metadata):
    """Copies of the layer's recorded checkpoint-format meta tensors. vLLM registers these very objects as the layer's
    parameters on every reload and wraps their loaders in place, harmless when the layer is always the same one; with a
    new shadow per update, the second update's loads would go through the first shadow's wrappers — into the layer
    that update made live. Each shadow therefore gets tensors of its own (same class and attributes), and loaders
    without the wrappers an in-place reload of the live layer (the copy commit's rollback) left on the recorded
    tensors: a wrapper closes over the live layer, and a shadow loading through it wrote into the live model."""
    params, buffers = metadata
    own = {n: _unwrapped(to_meta_tensor(t)) for n, t in params.items()}
    return own, {n: _unwrapped(to_meta_tensor(t)) for n, t in buffers.items()}


def _own_copies_of_the_rest(live: torch.nn.Module, shadow: torch.nn.Module) -> None:
    """vLLM never puts some tensors on meta (a bias, expert maps): their loaders write into the existing tensor, which
    is still the live one in the shadow. Give the shadow copies, their loaders bound to the shadow."""
    for table in (shadow._parameters, shadow._buffers):
        for name, tensor in table.items():
            if tensor is None or tensor.is_meta:
                continue
            own = tensor.detach().clone()
            own.__class__, own.__dict__ = tensor.__class__, dict(tensor.__dict__)
            for key, value in own.__dict__.items():
                if isinstance(value, MethodType) and value.__self__ is live:
                    own.__dict__[key] = value.__func__.__get__(shadow)
            table[name] = own


def _finish(shadow: torch.nn.Module) -> bool:
    """Process `shadow` if the online loader left it waiting (padding: fewer elements loaded than allocated); return
    whether it now holds processed new weights. A layer that received nothing stays live."""
    info = layerwise.get_layerwise_info(shadow)
    if info.can_load() and info.load_numel > 0:  # processed layers were reset by the loader: can_load() is False
        if is_deferred_attention_layer(shadow):
            raise NotImplementedError(
                f"{type(shadow).__name__} loads weights (quantisation scales), which the prepared update does not "
                "support: serve with --update-memory low"
            )
        layerwise._layerwise_process(shadow, info)
    info.reset()
    return not any(t.is_meta for t in (*shadow._parameters.values(), *shadow._buffers.values()) if t is not None)


def _changed(live: torch.nn.Module, shadow: torch.nn.Module) -> dict[str, object]:
    """The attributes `live` must take from `shadow`: every one that processing replaced, added or removed; children
    stay live (each is swapped as a layer of its own)."""
    new = {k: v for k, v in shadow.__dict__.items() if k != "_modules" and live.__dict__.get(k, _MISSING) is not v}
    new.update({k: _MISSING for k in live.__dict__ if k not in shadow.__dict__})
    return new


def _tied_layers(pairs: dict, processed: list) -> list[tuple[torch.nn.Module, dict[str, object]]]:
    """A tied `lm_head` shares the embedding's parameter and receives no weight of its own, but on CPU it keeps its
    own packed copy of it: every live layer whose weight *is* a processed layer's old weight gets a fresh shadow with
    the new one, processed as a first load would."""
    new_weight = {
        id(live._parameters["weight"]): shadow._parameters["weight"]
        for live, shadow in processed
        if live._parameters.get("weight") is not None
    }
    done = {live for live, _ in processed}
    layers = []
    for live in pairs:
        old = live._parameters.get("weight")
        if live in done or old is None or id(old) not in new_weight or not hasattr(live, "quant_method"):
            continue
        shadow = shadow_tree(live)[0]
        shadow._parameters["weight"] = new_weight[id(old)]
        shadow.quant_method.process_weights_after_loading(shadow)
        layers.append((live, _changed(live, shadow)))
    return layers
