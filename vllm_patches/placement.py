"""Where each checkpoint tensor of an update lands on one tensor-parallel rank: the slice of it this rank keeps.

Called by the worker (vllm_patches/worker_extension.py) when an update begins, in the worker process; pure apart from
reading the live model's modules. A placement is one of:

- `slice`: the rank keeps `length` rows of checkpoint dim `dim` from `start`; they land at `part_offset` along the
  parameter's own dim (a fused part's offset: q/k/v in `qkv_proj`, gate/up in `gate_up_proj`, w1/w3 in an expert's
  `w13`), for MoE in local expert `expert`;
- `replicated`: every rank keeps the whole tensor (norms, a replicated linear, a router gate);
- `full`: the layout is not known here, so the rank keeps the whole tensor and vLLM's loader slices it at commit, as
  before; `reason` names why, and the update's report lists it — never a guess;
- `absent`: the tensor belongs to experts another expert-parallel rank holds: this rank keeps nothing.

1:1 parameters are resolved by vLLM's own `nccl_m2n` resolution (vllm/distributed/weight_transfer/m2n_layout.py: a
known column/row-parallel or replicated loader, the declared dim validated against both shapes). It sends fused ones
to its full-tensor fallback; here they are sliced per part the way vLLM's loaders slice them (QKVParallelLinear
`weight_loader`'s q/k/v sizes and kv-head replicas, MergedColumnParallelLinear's `output_sizes`, FusedMoE's
`_load_w13`/`_load_w2`), and so is a vocab-parallel embedding or head (its unpadded vocabulary range). Shapes are
resolved against the layer's checkpoint-format parameters (what vLLM's layerwise reload recorded at first load),
not the live ones, which a CPU backend repacks. At commit (vllm_patches/commit.py, vllm_patches/prepared.py) each
kept slice reaches vLLM's loaders inside a `SliceCarrier`, which has the checkpoint's shape and no storage.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

import msgspec
import torch
from vllm.distributed.weight_transfer.m2n_layout import _base_loader_shard_dim, _validated_shard_dim
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.reload import layerwise

from inflight.wire.weights import ManifestError

REPLICATE = -1  # m2n_layout's "replicated" shard dim
_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w[123])\.weight$")
_W13_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}


class Placement(msgspec.Struct, frozen=True):
    """One checkpoint tensor on one rank (see the module docstring for the kinds)."""

    name: str
    kind: str  # "slice" | "replicated" | "full" | "absent"
    shape: tuple[int, ...]  # the checkpoint tensor's
    param: str = ""  # the live parameter it loads into
    dim: int = -1  # the checkpoint dim sliced
    start: int = 0
    length: int = 0
    part_offset: int = 0  # along the parameter's dim: where this part (or this rank's vocab) begins
    expert: int = -1  # local expert index (MoE)
    reason: str = ""

    @property
    def kept_shape(self) -> tuple[int, ...]:
        """The shape of what the rank keeps (() for `absent`)."""
        if self.kind == "absent":
            return ()
        if self.kind != "slice":
            return self.shape
        return tuple(self.length if d == self.dim else n for d, n in enumerate(self.shape))

    @property
    def kept_numel(self) -> int:
        return math.prod(self.kept_shape) if self.kind != "absent" else 0

    def take(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """What the rank keeps of the whole `tensor`: a view (the caller copies it out of the bucket)."""
        if self.kind == "absent":
            return None
        return tensor.narrow(self.dim, self.start, self.length) if self.kind == "slice" else tensor


def checkpoint_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in checkpoint format (shape and loader attributes), by full name: what vLLM's layerwise reload
    recorded for each layer at first load (meta tensors), else the module's own (a model loaded without it)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        info = layerwise.LAYERWISE_INFO.get(module)
        recorded = info.restore_metadata[0] if info is not None else {}
        own = dict(module.named_parameters(recurse=False))
        for name, tensor in {**own, **recorded}.items():  # vLLM records no bias (never put on meta): the live one
            out[f"{prefix}.{name}" if prefix else name] = tensor
    return out


def resolve(model: torch.nn.Module, tensors: Iterable[tuple[str, tuple[int, ...]]]) -> list[Placement]:
    """Every checkpoint tensor's placement on this rank (`tensors`: name and shape). Raises ManifestError naming the
    tensor when a known layout contradicts the checkpoint's shape (the update must fail before any commit)."""
    params = checkpoint_parameters(model)
    modules = dict(model.named_modules())
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    return [_resolve_one(name, tuple(shape), params, modules, packed) for name, shape in tensors]


def _resolve_one(name: str, shape: tuple[int, ...], params: dict, modules: dict, packed: dict) -> Placement:
    prefix, _, leaf = name.rpartition(".")
    if name in params:
        module = modules.get(prefix)
        if isinstance(module, VocabParallelEmbedding):
            return _vocab(name, shape, params[name], module)
        return _one_to_one(name, shape, params[name], module)
    if (match := _EXPERT.match(name)) and (experts := _routed_experts(match["layer"], modules)) is not None:
        return _expert(name, shape, match, *experts, params)
    for fused, parts in packed.items():
        for index, part in enumerate(parts):
            if prefix.endswith(f".{part}") or prefix == part:
                target = prefix[: len(prefix) - len(part)] + fused
                if f"{target}.{leaf}" in params:
                    return _fused(name, shape, f"{target}.{leaf}", params, modules.get(target), index)
    return Placement(name, "full", shape, reason="no live parameter of this name or of a known fused layer")


def _routed_experts(layer: str, modules: dict) -> tuple[str, RoutedExperts] | None:
    """The routed-experts module of an MoE layer and its name: `layer` itself, or its MoE runner's `routed_experts`
    (vLLM's FusedMoEFactory returns a runner holding them)."""
    module = modules.get(layer)
    if isinstance(module, RoutedExperts):
        return layer, module
    inner = getattr(module, "routed_experts", None)
    for name in (f"{layer}.routed_experts", layer):
        if isinstance(inner, RoutedExperts) and modules.get(name) is inner:
            return name, inner
    return (layer, inner) if isinstance(inner, RoutedExperts) else None


def _one_to_one(name: str, shape: tuple[int, ...], param: torch.Tensor, module) -> Placement:
    """vLLM's m2n resolution: a known loader's declared dim, validated against both shapes."""
    tp = getattr(module, "tp_size", 1) or 1
    declared = _base_loader_shard_dim(_unwrapped(param), tp)
    if declared is None:
        declared = _plain_parallel_dim(param, module, tp)
    if declared is None and tuple(shape) == tuple(param.shape):  # not split here (a norm has no loader): kept whole
        return Placement(name, "replicated", shape, name)
    if declared is None:
        loader = getattr(getattr(param, "weight_loader", None), "__qualname__", "none")
        return Placement(name, "full", shape, name, reason=f"loader {loader} is not a known tensor-parallel loader")
    dim = _validated_shard_dim(shape, tuple(param.shape), declared, tp)
    if dim is None:
        raise ManifestError(
            f"{name}: checkpoint shape {list(shape)} does not split into the live parameter's {list(param.shape)} "
            f"over {tp} ranks (dim {declared}): the update was built for another model or parallelism"
        )
    if dim == REPLICATE:
        return Placement(name, "replicated", shape, name)
    local = param.shape[dim]
    return Placement(name, "slice", shape, name, dim, module.tp_rank * local, local)


def _plain_parallel_dim(param: torch.Tensor, module, tp: int) -> int | None:
    """The split dim of a plain (not fused, not packed) column- or row-parallel linear's parameter, as its
    `weight_loader`/`weight_loader_v2` narrows it (output_dim / input_dim at tp_rank * local size); None otherwise.
    For the loaders m2n's identity check does not recognise on this platform."""
    packed = any(getattr(param, a, None) is not None for a in ("packed_dim", "packed_factor", "marlin_tile_size"))
    flags = any(bool(getattr(param, a, False)) for a in ("is_sharded_weight", "needs_scalar_to_array", "is_transposed"))
    if packed or flags or getattr(module, "tp_size", None) != tp:
        return None
    if isinstance(module, RowParallelLinear):
        dim = getattr(param, "input_dim", None)
    elif isinstance(module, ColumnParallelLinear) and not isinstance(module, MergedColumnParallelLinear):
        dim = getattr(param, "output_dim", None)
    else:
        return None
    return dim if isinstance(dim, int) and dim >= 0 else None


def _unwrapped(param: torch.Tensor) -> torch.Tensor:
    """`param`, or a meta copy of it with its own loader: vLLM's in-place reload wraps the recorded parameters'
    loaders in `online_process_loader` (and keeps them so), which m2n's fail-closed check would not recognise."""
    loader = getattr(param, "weight_loader", None)
    if getattr(loader, "__name__", "") != "online_process_loader":
        return param
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    probe = param.data.to("meta")
    probe.__class__, probe.__dict__ = param.__class__, dict(param.__dict__)
    try:
        probe.weight_loader = loader
    except AttributeError:  # a vLLM parameter class keeps it in `_weight_loader`
        probe.__dict__["_weight_loader"] = loader
    return probe


def _vocab(name: str, shape: tuple[int, ...], param: torch.Tensor, module: VocabParallelEmbedding) -> Placement:
    """VocabParallelEmbedding.weight_loader: the rank's unpadded vocabulary range, into the first rows."""
    idx = module.shard_indices
    start, length = idx.org_vocab_start_index, idx.org_vocab_end_index - idx.org_vocab_start_index
    dim = getattr(param, "output_dim", 0)
    if getattr(param, "packed_dim", None) is not None or dim != 0:
        return Placement(name, "full", shape, name, reason="packed or transposed vocab-parallel parameter")
    if len(shape) != param.dim() or shape[1:] != tuple(param.shape[1:]) or start + length > shape[0]:
        raise ManifestError(
            f"{name}: checkpoint shape {list(shape)} does not hold rows {start}..{start + length} of the live "
            f"vocab-parallel parameter {list(param.shape)}"
        )
    return Placement(name, "slice", shape, name, 0, start, length)


def _fused(name: str, shape: tuple[int, ...], target: str, params: dict, module, index: int) -> Placement:
    """One part of a fused column-parallel layer, sliced the way its `weight_loader(param, w, shard_id)` does."""
    param = params[target]
    dim = getattr(param, "output_dim", None)
    odd = any(getattr(param, a, None) is not None for a in ("packed_dim", "packed_factor")) or dim is None
    if odd or getattr(param, "is_sharded_weight", False):
        return Placement(name, "full", shape, target, reason="packed, quantised or pre-sharded fused parameter")
    if isinstance(module, QKVParallelLinear):
        part = _qkv_part(module, index)
    elif isinstance(module, MergedColumnParallelLinear):
        local = [size // module.tp_size for size in module.output_sizes]
        part = (sum(local[:index]), local[index], module.tp_rank * local[index], module.output_sizes[index])
    else:
        return Placement(name, "full", shape, target, reason=f"fused layer {type(module).__name__} is not known")
    offset, length, start, whole = part
    others_match = all(n == param.shape[d] for d, n in enumerate(shape) if d != dim) and len(shape) == param.dim()
    if shape[dim] != whole or not others_match or offset + length > param.shape[dim]:
        raise ManifestError(
            f"{name}: checkpoint shape {list(shape)} does not fit part {index} of {target} {list(param.shape)} "
            f"({whole} rows expected along dim {dim})"
        )
    return Placement(name, "slice", shape, target, dim, start, length, offset)


def _qkv_part(module: QKVParallelLinear, index: int) -> tuple[int, int, int, int]:
    """(offset in the fused param, local length, start in the checkpoint, checkpoint length) of q, k or v."""
    q = module.num_heads * module.head_size
    kv = module.num_kv_heads * module.head_size
    v = module.num_kv_heads * module.v_head_size
    kv_rank = module.tp_rank // module.num_kv_head_replicas  # a replicated kv head: several ranks hold the same one
    if index == 0:
        return 0, q, module.tp_rank * q, module.total_num_heads * module.head_size
    if index == 1:
        return q, kv, kv_rank * kv, module.total_num_kv_heads * module.head_size
    return q + kv, v, kv_rank * v, module.total_num_kv_heads * module.v_head_size


def _expert(
    name: str, shape: tuple[int, ...], match: re.Match, layer: str, module: RoutedExperts, params: dict
) -> Placement:
    """One expert's projection: FusedMoE._load_w13/_load_w2 on an unquantised layer (w13 [E, 2I, H], w2 [E, H, I])."""
    local = module._map_global_expert_id_to_local_expert_id(int(match["expert"]))
    if local == -1:
        return Placement(name, "absent", shape, reason="an expert another expert-parallel rank holds")
    w13 = match["proj"] in _W13_PART
    target = f"{layer}.{'w13_weight' if w13 else 'w2_weight'}"
    param = params.get(target)
    method = getattr(module, "quant_method", None)
    if param is None or not isinstance(method, UnquantizedFusedMoEMethod) or not module.moe_config.is_act_and_mul:
        method = type(method).__name__ if param is not None else f"{target} (no such parameter)"
        return Placement(name, "full", shape, target, reason=f"expert layout of {method} is not known")
    parallel = module.moe_config.moe_parallel_config
    dim = 0 if w13 else 1  # the checkpoint's intermediate dim: gate/up [I, H], down [H, I]
    length = param.shape[1] // 2 if w13 else param.shape[2]
    offset = _W13_PART[match["proj"]] * length if w13 else 0
    hidden = param.shape[2] if w13 else param.shape[1]
    if len(shape) != 2 or shape[dim] != length * parallel.tp_size or shape[1 - dim] != hidden:
        raise ManifestError(
            f"{name}: checkpoint shape {list(shape)} does not fit {target} {list(param.shape)} over "
            f"{parallel.tp_size} tensor-parallel ranks"
        )
    return Placement(name, "slice", shape, target, dim, parallel.tp_rank * length, length, offset, local)


class SliceLayout:
    """One update's placements on this rank: what the staging thread keeps of each tensor as it streams in (`keep`,
    handed to inflight/wire/transfer.py:receive_kept), and what the commit hands vLLM's loaders (`carriers`)."""

    def __init__(self, placements: Iterable[Placement]):
        self.placements = {p.name: p for p in placements}

    @classmethod
    def resolve(cls, model: torch.nn.Module, manifest) -> SliceLayout:
        """The layout of `manifest`'s tensors (inflight/wire/weights.py:UpdateManifest) on this rank; ManifestError
        when one contradicts the live parameter it maps to (before any bucket is received)."""
        return cls(resolve(model, [(t.name, tuple(t.shape)) for t in manifest.tensors]))

    @property
    def full(self) -> list[str]:
        """The tensors kept whole because their layout is not known here (the update's report names them)."""
        return sorted(name for name, p in self.placements.items() if p.kind == "full")

    def keep(self, name: str, whole: torch.Tensor) -> torch.Tensor | None:
        return self.placements[name].take(whole)

    def carriers(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """`items` (name, kept tensor) as vLLM's loaders take them: each slice inside a `SliceCarrier` of the
        checkpoint's shape, which allocates nothing and answers the loader's own narrow with the kept slice itself."""
        for name, kept in items:
            p = self.placements[name]
            if p.kind != "slice":
                yield name, kept
                continue
            if tuple(kept.shape) != p.kept_shape:
                raise ManifestError(f"{name}: kept {list(kept.shape)}, the layout says {list(p.kept_shape)}")
            yield name, SliceCarrier(p, kept)


# What a SliceCarrier answers itself (its method's name), before any dispatch.
_CARRIER_OWN = {
    torch.Tensor.narrow: "_narrowed",
    torch.narrow: "_narrowed",
    torch.Tensor.unsqueeze: "_unsqueezed",
    torch.unsqueeze: "_unsqueezed",
    torch.Tensor.unbind: "_unbound",
    torch.unbind: "_unbound",
}


class SliceCarrier(torch.Tensor):
    """A checkpoint-shaped tensor with no storage of its own, holding one rank's kept slice: what the commit paths hand
    vLLM's weight loaders (through its layerwise reload, which buffers every argument until a layer is complete).

    Why: the loaders take the whole checkpoint tensor and narrow it to the rank's part themselves. A real tensor of the
    whole shape would cost the rank the whole layer again at every commit (the 1.26x resident peak that issue 41's
    first measurement showed); this one answers shape, dtype and device like the whole tensor, and its `narrow` returns
    the kept slice when asked for exactly the placement's rows. Besides narrow it takes what vLLM's MoE layer does to
    one expert's tensor before its loader narrows it (`unsqueeze(0)` then `unbind()`: a leading dim of one, `lead`).
    Any other narrow, or any operation that would read data (a copy, arithmetic, a transpose), raises, naming the
    tensor: a loader that slices differently from the placement fails the commit or the preparation (both leave the
    live weights as they were), never loads wrong rows."""

    @staticmethod
    def __new__(cls, placement: Placement, kept: torch.Tensor, lead: int = 0) -> SliceCarrier:
        shape = (1,) * lead + tuple(placement.shape)
        carrier = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=kept.dtype, device=kept.device)
        carrier.placement, carrier.kept, carrier.lead = placement, kept, lead
        return carrier

    def __repr__(self) -> str:  # Tensor's repr reads the data this carrier does not have
        return f"SliceCarrier({self.placement.name}, {list(self.shape)}, keeps {list(self.kept.shape)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (own := _CARRIER_OWN.get(func)) is not None and isinstance(args[0], SliceCarrier):
            return getattr(args[0], own)(*args[1:], **kwargs)
        with torch._C.DisableTorchFunctionSubclass():  # metadata (shape, dtype, device, `to` itself) needs no data
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        carrier = next(a for a in args if isinstance(a, SliceCarrier))
        raise carrier._refused(f"applied {func} to")

    def _refused(self, what: str) -> ManifestError:
        return ManifestError(
            f"{self.placement.name}: vLLM's loader {what} the checkpoint tensor, which this rank keeps only a slice "
            f"of: its layout is not the one resolved (vllm_patches/placement.py)"
        )

    def _narrowed(self, dim: int, start: int, length: int) -> torch.Tensor:
        p = self.placement
        if self.lead or (dim % len(p.shape), int(start), int(length)) != (p.dim, p.start, p.length):
            kept = f"this rank kept dim {p.dim} at {p.start} for {p.length}"
            raise self._refused(f"narrows dim {dim} at {start} for {length} ({kept}) of")
        return self.kept

    def _unsqueezed(self, dim: int) -> SliceCarrier:
        if dim != 0:
            raise self._refused(f"unsqueezes dim {dim} of")
        return SliceCarrier(self.placement, self.kept, self.lead + 1)

    def _unbound(self, dim: int = 0) -> tuple[SliceCarrier, ...]:
        if dim != 0 or not self.lead:
            raise self._refused(f"unbinds dim {dim} of")
        return (SliceCarrier(self.placement, self.kept, self.lead - 1),)
