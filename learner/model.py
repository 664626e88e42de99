"""The policy being trained: a transformers causal LM whose forward returns token logprobs, not logits.

The learner entry point calls `load_policy` once, `shard_policy` when it runs data-parallel under torchrun, and then
`PolicyModel.forward` inside every `train_step` (learner/step.py). The weight publisher calls `full_hf_state` after
each optimizer step to get the full tensors under the names vLLM loads (the HF checkpoint names).

Why the logprobs are computed inside the root module's forward: under FSDP2 the root owns the parameters that no
decoder layer owns (embeddings, final norm, LM head — tied or not), and they are unsharded plain tensors only while
the root's forward (and backward) runs. `token_logprobs` needs the LM head weight as a full tensor, and it never
materialises the tokens × vocab logits; calling `self.hf(...)` would build exactly those logits.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from learner.fused_loss import FusedLossInputs, fused_policy_loss
from learner.logprobs import token_logprobs
from learner.lora import LoraSpec, apply_lora, is_lora_name
from learner.truncation import Truncation

_WRAPPER_PREFIX = "hf."  # PolicyModel keeps the HF model under `self.hf`; HF names are the names below it
_LORA_BASE = ".base_layer."  # where PEFT keeps a LoRA-wrapped linear module's own (frozen) weight


@dataclass
class PolicyOutput:
    """What `PolicyModel.forward` returns, whatever its arguments.

    `logp` [B, L] float32 always (detached when the loss was fused). `loss` (scalar) and `metrics` (`policy_loss`'s)
    only when `fused` loss inputs were given — the loss computed together with the LM head; otherwise `loss` is None
    and `metrics` empty, and the caller computes the loss from `logp` (learner/losses.py). A dataclass FSDP2 traverses:
    it hooks its backward on the tensors inside that need gradients.
    """

    logp: torch.Tensor
    loss: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _HeadRows:
    """The rows that go through the LM head: hidden states [N, H] in the head's dtype, their targets [N], and their
    flat positions in [B · L] when `positions` picked a subset (`index`; None: every position, N = B · L)."""

    hidden: torch.Tensor
    targets: torch.Tensor
    index: torch.Tensor | None

    def pick(self, per_token: torch.Tensor) -> torch.Tensor:
        """A [B, L] per-token tensor at these rows, [N]."""
        flat = per_token.reshape(-1)
        return flat if self.index is None else flat.index_select(0, self.index)

    def scatter(self, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """[N] values back to [B, L] (0 at the positions left out), a copy, not a view: FSDP2 warns that in-place
        ops on a view of the root's output would skip its hooks."""
        if self.index is not None:
            values = values.new_zeros(shape.numel()).index_copy(0, self.index, values)
        return values.view(shape).clone()


class PolicyModel(torch.nn.Module):
    """A causal LM (`self.hf`, e.g. LlamaForCausalLM) whose forward gives log π(target | prefix) per position.

    `lora`: the adapters `learner/lora.py:apply_lora` injected into `self.hf` (only they train), None = full
    fine-tuning."""

    def __init__(self, hf_model: torch.nn.Module, lora: LoraSpec | None = None) -> None:
        super().__init__()
        for attr in ("model", "lm_head"):
            if not hasattr(hf_model, attr):
                raise ValueError(
                    f"{type(hf_model).__name__} has no `{attr}` attribute; PolicyModel expects a transformers "
                    "*ForCausalLM with `.model` (the decoder) and `.lm_head` (e.g. Llama, Qwen2)"
                )
        self.hf = hf_model
        self.lora = lora

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk_tokens: int = 1024,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        autocast: torch.dtype | None = None,
        fused: FusedLossInputs | None = None,
        truncation: Truncation | None = None,
    ) -> PolicyOutput:
        """`logp` [B, L] float32: log softmax(logits[b, t] / T)[targets[b, t]], logits from input_ids[b, :t+1], T the
        temperature.

        With right padding no attention mask is needed: causal attention keeps real positions from seeing the pads
        that follow them; the values at pad positions are meaningless and must be masked by the caller.
        `positions` ([B, L] bool): only these go through the LM head (the completion tokens that train, say); the
        others are 0. `autocast` (e.g. torch.bfloat16): the decoder runs under autocast in that dtype, while the LM
        head and the log-softmax stay in the parameters' dtype — the logprobs feed importance ratios.
        `fused` ([B, L] loss inputs): the policy loss is computed with the LM head in one pass (learner/fused_loss.py,
        the Triton kernel on CUDA) and returned in `loss` and `metrics`, `logp` then detached.
        `truncation` (top-k / top-p / min-p sampling, learner/truncation.py): logprobs under the sampler's kept set;
        the fused loss computes full-softmax logprobs only, so the two are refused together.
        """
        _check_forward_inputs(input_ids, targets, positions, fused, truncation)
        rows = self._head_rows(input_ids, targets, attention_mask, positions, autocast)
        with torch.autocast(input_ids.device.type, enabled=False):
            if fused is None:
                out = PolicyOutput(self._logprobs(rows, temperature, chunk_tokens, truncation))
            else:
                out = self._fused_loss(rows, fused, temperature, chunk_tokens)
        return replace(out, logp=rows.scatter(out.logp, input_ids.shape))

    def _head_rows(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        attention_mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        autocast: torch.dtype | None,
    ) -> _HeadRows:
        """The decoder's last hidden states (under autocast when asked) at `positions`, cast to the LM head's dtype."""
        with torch.autocast(input_ids.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            hidden = self.hf.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = hidden.last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).to(self.hf.lm_head.weight.dtype)
        flat_targets = targets.reshape(-1)
        if positions is None:
            return _HeadRows(hidden, flat_targets, None)
        index = positions.reshape(-1).nonzero().squeeze(1)
        return _HeadRows(hidden.index_select(0, index), flat_targets.index_select(0, index), index)

    def _logprobs(
        self, rows: _HeadRows, temperature: float, chunk_tokens: int, truncation: Truncation | None
    ) -> torch.Tensor:
        lm_head = self.hf.lm_head
        bias = getattr(lm_head, "bias", None)
        return token_logprobs(rows.hidden, lm_head.weight, rows.targets, temperature, chunk_tokens, bias, truncation)

    def _fused_loss(
        self, rows: _HeadRows, fused: FusedLossInputs, temperature: float, chunk_tokens: int
    ) -> PolicyOutput:
        lm_head = self.hf.lm_head
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("the fused loss takes an LM head without bias: set TrainConfig.fused_loss='off'")
        result = fused_policy_loss(
            rows.hidden,
            lm_head.weight,
            rows.targets,
            rows.pick(fused.behaviour_logp),
            rows.pick(fused.advantages),
            rows.pick(fused.mask),
            rows.pick(fused.seq_ids),
            fused.cfg,
            temperature,
            fused.normalizer,
            chunk_tokens,
        )
        return PolicyOutput(result.logp, result.loss, result.metrics)


def _check_forward_inputs(
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    positions: torch.Tensor | None,
    fused: FusedLossInputs | None,
    truncation: Truncation | None,
) -> None:
    if fused is not None and truncation is not None and truncation.active:
        raise ValueError(
            "the fused loss computes full-softmax logprobs: with top-k/top-p/min-p sampling set "
            "TrainConfig.fused_loss='off'"
        )
    if input_ids.dim() != 2 or targets.shape != input_ids.shape:
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)} and targets {tuple(targets.shape)}, "
            "expected the same [batch, length] shape"
        )
    if positions is not None and positions.shape != input_ids.shape:
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected input_ids' {tuple(input_ids.shape)}")


def load_policy(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    lora: LoraSpec | None = None,
) -> PolicyModel:
    """The HF checkpoint in `model_dir` as a PolicyModel in `dtype` on `device` (the learner passes its
    `learner/world.py:World.device`), dropout off, no KV cache; with `lora`, LoRA adapters on its decoder layers and
    every other weight frozen (learner/lora.py)."""
    # transformers takes seconds to import: kept off the import path of `python -m inflight.learn --help`
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    hf_model.config.use_cache = False
    if lora is not None:
        apply_lora(hf_model, lora)  # before the move: the adapters are created on the base weights' device
    model = PolicyModel(hf_model, lora).to(device)
    model.eval()  # RL fine-tuning keeps dropout off: learner logprobs must match the sampler's
    return model


def shard_policy(
    model: PolicyModel, mesh: torch.distributed.DeviceMesh, compute_dtype: torch.dtype | None = None
) -> PolicyModel:
    """FSDP2: one `fully_shard` unit per decoder layer, then the root (embeddings, final norm, LM head).

    Sharding the root last gives it every parameter no layer took; tied embeddings stay one parameter there.
    Works for a mesh of size 1. Gradients are averaged over the mesh (FSDP2's default); see learner/step.py.
    `compute_dtype` (bf16 on CUDA, `learner/world.py:World.layer_compute_dtype`): the decoder layers are gathered and
    run in it while their master weights and gradient reductions stay in the parameter dtype; the root never gets it,
    so the LM head and the logprobs keep the parameter dtype (they feed importance ratios).
    """
    layers = {}
    if compute_dtype is not None:
        reduce_dtype = next(model.parameters()).dtype
        layers["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    for layer in model.hf.model.layers:
        fully_shard(layer, mesh=mesh, **layers)
    fully_shard(model, mesh=mesh)
    return model


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
        for k, v in checkpoint_named(model.hf, _hf_name(name), t).items()
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
    its own rows), so rank 0 never holds more than one block beyond its own shard — not the full tensor, not the model.
    Other ranks yield nothing. An unsharded model yields each tensor whole.

    Collective when the model is sharded: every rank must exhaust it, in step. A yielded tensor may be the live
    parameter or rank 0's own shard: valid until the next piece is asked for; copy what must outlive that, never write.
    """
    for hf_name, t in local_hf_state(model):
        if _converted(model.hf, hf_name, t.shape):  # whole, then split as the checkpoint stores it (`checkpoint_named`)
            full = t.full_tensor().detach() if isinstance(t, DTensor) else t.detach()  # (collective when sharded)
            if not isinstance(t, DTensor) or dist.get_rank(t.device_mesh.get_group()) == 0:
                for name, part in checkpoint_named(model.hf, hf_name, full).items():
                    yield Piece(name, part.shape, 0, part.contiguous())
        elif not isinstance(t, DTensor):
            yield Piece(hf_name, t.shape, 0, t.detach())
        elif _row_sharded(t):
            yield from _rows_to_rank0(hf_name, t.detach(), max_piece_bytes)
        else:
            full = t.full_tensor().detach()  # another placement: gathered whole (collective)
            if dist.get_rank(t.device_mesh.get_group()) == 0:
                yield Piece(hf_name, full.shape, 0, full)


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
