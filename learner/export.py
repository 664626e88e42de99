"""The trained weights as a checkpoint names them: what the weight publisher streams and the exports write.

`inflight/learn/app.py` calls `iter_full_pieces` (a full update, streamed from the FSDP2 shards to rank 0 piece by
piece) or `full_hf_state` (a delta update and the checkpoints: the whole state on rank 0) after an optimizer step. Both
name every tensor as the HF checkpoint does (vLLM loads, and checks updates against, those names): the PolicyModel
wrapper's prefix dropped, a LoRA-wrapped module's base weight under its own name, a converted MoE layer split back as
`save_pretrained` stores it, a tied LM head left out.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Shard

from learner.lora import is_lora_name
from learner.model import PolicyModel

_WRAPPER_PREFIX = "hf."  # PolicyModel keeps the HF model under `self.hf`; HF names are the names below it
_LORA_BASE = ".base_layer."  # where PEFT keeps a LoRA-wrapped linear module's own (frozen) weight


def full_hf_state(model: PolicyModel) -> dict[str, torch.Tensor]:
    """Full parameters on CPU under their HF checkpoint names (a snapshot, not views of the live weights).

    Collective when the model is sharded: every rank must call it; rank 0 gets the tensors, the others `{}`.
    With LoRA these are the frozen base weights (the adapters are `learner/lora.py:adapter_state`'s). A tied LM head
    is left out, as `save_pretrained` leaves it out of the checkpoint (`model.embed_tokens.weight`
    is the one tensor); an untied head is included.
    """
    if _is_sharded(model):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        if dist.get_rank() != 0:
            return {}
        state = _copy_aliases_of_live_params(state, model)
    else:
        state = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
    state = {
        k: v
        for name, t in state.items()
        if not is_lora_name(name)
        for k, v in checkpoint_tensors(model.hf, _hf_name(name), t).items()
    }
    if getattr(model.hf.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def checkpoint_named(hf_model: torch.nn.Module, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's tensor `name` as the checkpoint stores it: one or more tensors under the checkpoint's names.

    Why: transformers 5 loads some checkpoints through a conversion (an MoE layer's per-expert matrices fused into one
    3D `experts.gate_up_proj` / `experts.down_proj`, Mixtral's `block_sparse_moe` renamed `mlp`); `save_pretrained`
    reverts it, and so must every state the learner hands a serve, which loads (and checks updates against) the
    checkpoint's names. The identity for a model loaded without a conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(hf_model, {name: t})


def checkpoint_tensors(hf_model: torch.nn.Module, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """`checkpoint_named`, an MoE layer's fused experts in expert-major order (each expert's tensors together: gate,
    up; gate, up; ...): the order a learner streams them in, an expert at a time (`iter_full_pieces`)."""
    converted = checkpoint_named(hf_model, name, t)
    experts = _expert_layout(hf_model, name, t.shape) if list(converted) != [name] else None
    return converted if experts is None else {n: converted[n] for tensors in experts for n, _ in tensors}


ExpertLayout = list[list[tuple[str, torch.Size]]]  # per expert: its checkpoint tensors' names and shapes


def _expert_layout(hf_model: torch.nn.Module, name: str, shape: torch.Size) -> ExpertLayout | None:
    """For a tensor the checkpoint stores per expert along its dim 0 (transformers' fused `experts.gate_up_proj`,
    `experts.down_proj`): each expert's checkpoint tensors (name, shape), in the order one expert's slice converts to;
    None for any other tensor. Worked out on shape-only tensors: one expert's slice converted and renumbered must give
    exactly the names and shapes the whole tensor converts to."""
    if len(shape) < 2:
        return None
    one = checkpoint_named(hf_model, name, torch.empty((1, *shape[1:]), device="meta"))
    if list(one) == [name] or not all(".experts.0." in n for n in one):
        return None
    renamed = [(n.split(".experts.0.", 1), t.shape) for n, t in one.items()]
    experts = [[(f"{a}.experts.{e}.{b}", size) for (a, b), size in renamed] for e in range(shape[0])]
    whole = checkpoint_named(hf_model, name, torch.empty(shape, device="meta"))
    same = sorted(p for tensors in experts for p in tensors) == sorted((n, t.shape) for n, t in whole.items())
    return experts if same else None


def hf_layout(model: PolicyModel) -> dict[str, torch.Tensor]:
    """`full_hf_state`'s names, in its order, each with a shape-only (meta) tensor of its dtype and full shape: what a
    serve is checked against, gathering nothing (a sharded parameter's DTensor knows its full shape)."""
    layout: dict[str, torch.Tensor] = {}
    for hf_name, t in local_hf_state(model):
        layout.update(checkpoint_tensors(model.hf, hf_name, torch.empty(t.shape, dtype=t.dtype, device="meta")))
    return layout


class Piece(NamedTuple):
    """Rows `start` .. `start + len(tensor)` of the full tensor `name` of shape `shape` (all of it when `start` is 0 and
    `tensor.shape == shape`, always so for a 0-d tensor)."""

    name: str
    shape: torch.Size
    start: int
    tensor: torch.Tensor


def iter_full_pieces(model: PolicyModel, max_piece_bytes: int = 16 << 20) -> Iterator[Piece]:
    """The tensors of `full_hf_state` in pieces, on rank 0, in the same order on every rank: a tensor sharded by rows
    (FSDP2's `Shard(0)`) arrives rank by rank in blocks of at most `max_piece_bytes` (point to point, each rank sending
    its own rows), so rank 0 never holds more than one block beyond its own shard — not the full tensor, not the model;
    an MoE layer's fused experts in blocks of experts (`_per_expert`). Other ranks yield nothing; an unsharded model
    yields each tensor whole.

    Collective when the model is sharded: every rank must exhaust it, in step. A yielded tensor may be the live
    parameter or rank 0's own shard: valid until the next piece is asked for; copy what must outlive that, never write.
    """
    for hf_name, t in local_hf_state(model):
        converted = _converted(model.hf, hf_name, t.shape)
        if converted and (experts := _expert_layout(model.hf, hf_name, t.shape)) is not None:
            yield from _per_expert(model.hf, hf_name, t.detach(), experts, max_piece_bytes)
        elif isinstance(t, DTensor) and _row_sharded(t) and not converted:
            yield from _rows_to_rank0(hf_name, t.detach(), max_piece_bytes)
        else:  # whole (another placement: gathered, collective), split as the checkpoint stores it
            full = t.full_tensor().detach() if isinstance(t, DTensor) else t.detach()
            if not isinstance(t, DTensor) or dist.get_rank(t.device_mesh.get_group()) == 0:
                for name, part in checkpoint_named(model.hf, hf_name, full).items():
                    yield Piece(name, part.shape, 0, part.contiguous())


def _per_expert(
    hf_model: torch.nn.Module, name: str, t: torch.Tensor, experts: ExpertLayout, max_piece_bytes: int
) -> Iterator[Piece]:
    """A tensor stored per expert, an expert at a time: sharded by experts (FSDP2's `Shard(0)`), its experts come to
    rank 0 in blocks of at most `max_piece_bytes` (one expert at least), never the whole layer; each expert's slice is
    converted to its checkpoint tensors (`_expert_layout`'s names)."""
    if isinstance(t, DTensor) and _row_sharded(t):
        blocks: Iterator[Piece] | list[Piece] = _rows_to_rank0(name, t, max_piece_bytes)
    else:
        full = t.full_tensor() if isinstance(t, DTensor) else t  # another placement: gathered whole (collective)
        rank0 = not isinstance(t, DTensor) or dist.get_rank(t.device_mesh.get_group()) == 0
        blocks = [Piece(name, full.shape, 0, full)] if rank0 else []
    for block in blocks:
        for j in range(len(block.tensor)):
            parts = checkpoint_named(hf_model, name, block.tensor[j : j + 1]).values()
            for (ckpt_name, shape), part in zip(experts[block.start + j], parts, strict=True):
                yield Piece(ckpt_name, shape, 0, part.reshape(shape).contiguous())


def local_hf_state(model: PolicyModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, this rank's tensor — a DTensor when sharded, whose `shape` is the full one) in `full_hf_state`'s
    names and order, gathering nothing; a tied LM head left out (it is the embedding, sent once under its own name)."""
    tied = getattr(model.hf.config, "tie_word_embeddings", False)
    for name, t in model.state_dict().items():
        if is_lora_name(name):
            continue  # an adapter tensor: learner/lora.py:adapter_state publishes those
        hf_name = _hf_name(name)
        if not (tied and hf_name == "lm_head.weight"):
            yield hf_name, t


def _converted(hf_model: torch.nn.Module, name: str, shape: torch.Size) -> bool:
    """Whether the checkpoint stores `name` otherwise (`checkpoint_named`), asked of a shape-only tensor."""
    return list(checkpoint_named(hf_model, name, torch.empty(shape, device="meta"))) != [name]


def _row_sharded(t: DTensor) -> bool:
    return t.device_mesh.ndim == 1 and len(t.placements) == 1 and t.placements[0] == Shard(0) and t.dim() > 0


def _rows_to_rank0(name: str, t: DTensor, max_piece_bytes: int) -> Iterator[Piece]:
    group = t.device_mesh.get_group()
    me, world = dist.get_rank(group), dist.get_world_size(group)
    rows = [len(c) for c in torch.chunk(torch.empty(t.shape[0], device="meta"), world)]
    rows += [0] * (world - len(rows))  # FSDP2 splits dim 0 as torch.chunk does: trailing ranks may hold none
    local = t.to_local()
    if local.shape[0] != rows[me]:
        raise RuntimeError(
            f"{name}: rank {me} holds {local.shape[0]} rows, torch.chunk of {t.shape[0]} rows over "
            f"{world} ranks gives {rows[me]}: FSDP2 sharded it differently than expected"
        )
    row_bytes = max(1, math.prod(t.shape[1:]) * local.element_size())  # from the global shape: the same on every rank
    step = max(1, max_piece_bytes // row_bytes)
    offset = 0
    for source, count in enumerate(rows):
        for first in range(0, count, step):
            n = min(step, count - first)
            if me == 0:
                yield Piece(name, t.shape, offset + first, _rows_from(local, source, first, n, group))
            elif me == source:
                dist.send(local[first : first + n].contiguous(), group=group, group_dst=0)
        offset += count


def _rows_from(local: torch.Tensor, source: int, first: int, n: int, group: dist.ProcessGroup) -> torch.Tensor:
    if source == 0:
        return local[first : first + n]
    block = torch.empty((n, *local.shape[1:]), dtype=local.dtype, device=local.device)
    dist.recv(block, group=group, group_src=source)
    return block


def checkpoint_tensor_names(model_dir: str | Path) -> set[str]:
    """Tensor names stored in the `*.safetensors` files of `model_dir`, read from their headers only."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_dir {model_dir} holds no *.safetensors file: pass an HF checkpoint directory")
    names: set[str] = set()
    for path in files:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))  # safetensors: u64 LE header size, then a JSON header
            header = json.loads(f.read(header_len))
        names.update(k for k in header if k != "__metadata__")
    return names


def _copy_aliases_of_live_params(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Clone the tensors that share memory with the live parameters.

    On a mesh of one rank (CPU) the "gathered" full tensor is the local shard itself and `cpu_offload` does not copy
    a CPU tensor, so without this the next optimizer step would change the returned state under the caller.
    """
    live = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in model.parameters()}
    return {name: t.clone() if t.untyped_storage().data_ptr() in live else t for name, t in state.items()}


def _is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _hf_name(name: str) -> str:
    if not name.startswith(_WRAPPER_PREFIX):
        raise ValueError(f"state-dict key {name!r} does not start with {_WRAPPER_PREFIX!r}: expected a PolicyModel")
    return name[len(_WRAPPER_PREFIX) :].replace(_LORA_BASE, ".")  # a LoRA-wrapped module's base weight: its HF name
