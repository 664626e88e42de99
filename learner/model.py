"""The policy being trained: a transformers causal LM whose forward returns token logprobs, not logits.

The learner entry point calls `load_policy` once, `shard_policy` when it runs data-parallel under torchrun, and then
`PolicyModel.forward` inside every `train_step` (learner/step.py). What the publisher sends after each optimizer step,
the full tensors under their checkpoint names, is learner/export.py's.

Why the logprobs are computed inside the root module's forward: under FSDP2 the root owns the parameters that no
decoder layer owns (embeddings, final norm, LM head — tied or not), and they are unsharded plain tensors only while
the root's forward (and backward) runs. `token_logprobs` needs the LM head weight as a full tensor, and it never
materialises the tokens × vocab logits; calling `self.hf(...)` would build exactly those logits.

`token_logprobs` takes the final hidden states (after the last norm), the LM head weight and the completion tokens,
at the sampling temperature, so the result is comparable with vLLM's processed behaviour logprobs. The log-softmax
runs in fp32 and tokens are processed `chunk_tokens` at a time, so the tokens × vocab logits tensor never exists
whole — neither in forward nor in backward: `_ChunkedTokenLogprobs` keeps only the per-token log-normaliser and
recomputes each chunk's logits in backward. Peak extra memory is about chunk_tokens × vocab fp32 values. With a
`truncation` (the sampling knobs, inflight/wire/contract.py:SamplingKnobs: their top-k / top-p / min-p, applied by
learner/truncation.py) the log-softmax runs over the tokens the sampler kept, chunk by chunk in forward and again in
backward (the mask is recomputed from the same logits).
`naive_token_logprobs` materialises all logits; it is the reference for tests and the baseline for benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from inflight.wire.contract import SamplingKnobs
from learner.fused_loss import FusedLossInputs, check_head_inputs, fused_policy_loss
from learner.lora import LoraSpec, apply_lora
from learner.truncation import active_rule, truncate_


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
        truncation: SamplingKnobs | None = None,
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
        `truncation` (the sampling knobs' top-k / top-p / min-p, learner/truncation.py): logprobs under the sampler's
        kept set; the fused loss computes full-softmax logprobs only, so the two are refused together.
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
        self, rows: _HeadRows, temperature: float, chunk_tokens: int, truncation: SamplingKnobs | None
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
    truncation: SamplingKnobs | None,
) -> None:
    if fused is not None and truncation is not None and truncation.truncated:
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


def naive_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    lm_head_bias: torch.Tensor | None = None,
    truncation: SamplingKnobs | None = None,
) -> torch.Tensor:
    """log_softmax((hidden @ Wᵀ + b) / temperature)[t, targets[t]], via the full [T, V] logits (over the kept tokens
    with a `truncation`)."""
    logits = _logits(hidden, lm_head_weight, lm_head_bias, temperature)
    rule = active_rule(truncation)
    if rule is not None:
        truncate_(logits, targets, rule)
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)


def token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    lm_head_bias: torch.Tensor | None = None,
    truncation: SamplingKnobs | None = None,
) -> torch.Tensor:
    """Log-probability of `targets[t]` under softmax((hidden[t] @ Wᵀ + b) / temperature), for every t; with an active
    `truncation`, under that softmax renormalised over the tokens the sampler's rule keeps (the target always kept).

    hidden: [T, H]; lm_head_weight: [V, H] (same dtype as hidden); targets: [T] int64; lm_head_bias: [V] or None.
    Returns [T] in float32 (float64 when the inputs are float64). Differentiable w.r.t. hidden, weight and bias.
    The matmul runs in the inputs' dtype, as the model's own LM head does; everything after it runs in fp32.
    The weight must be a plain full tensor (with FSDP, call this where the LM head is unsharded).
    """
    check_head_inputs(hidden, lm_head_weight, targets, temperature, chunk_tokens, lm_head_bias)
    rule = active_rule(truncation)
    return _ChunkedTokenLogprobs.apply(
        hidden, lm_head_weight, lm_head_bias, targets, float(temperature), chunk_tokens, rule
    )


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Forward saves only logsumexp per token; backward recomputes each chunk's logits.

    d logp_t / d logits_t = (onehot(target_t) − softmax_t) / temperature, so the chunk's logit gradient is
    g_t · (onehot − p_t) / temperature, from which the hidden, weight and bias gradients follow by matmuls. With a
    truncation, p_t is the renormalised kept distribution (0 on dropped tokens: exp(−inf − log_norm)).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_tokens: int,
        truncation: SamplingKnobs | None,
    ) -> torch.Tensor:
        out = hidden.new_empty(hidden.shape[0], dtype=_accum_dtype(hidden))
        log_norm = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk_tokens):
            stop = start + chunk_tokens
            logits = _logits(hidden[start:stop], weight, bias, temperature, truncation, targets[start:stop])
            log_norm[start:stop] = torch.logsumexp(logits, dim=-1)
            out[start:stop] = logits.gather(1, targets[start:stop, None]).squeeze(1) - log_norm[start:stop]
        ctx.save_for_backward(hidden, weight, bias, targets, log_norm)
        ctx.temperature, ctx.chunk_tokens, ctx.truncation = temperature, chunk_tokens, truncation
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, log_norm = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        acc = log_norm.dtype
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = weight.new_zeros(weight.shape, dtype=acc) if need_weight else None
        grad_bias = weight.new_zeros(weight.shape[0], dtype=acc) if need_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            stop = start + ctx.chunk_tokens
            hidden_chunk, g = hidden[start:stop], grad_out[start:stop].to(acc)[:, None]
            # logits → softmax → g·(onehot − p)/temperature, in place in the one chunk-sized buffer
            grad_logits = _logits(hidden_chunk, weight, bias, ctx.temperature, ctx.truncation, targets[start:stop])
            grad_logits.sub_(log_norm[start:stop, None]).exp_().mul_(-g)
            grad_logits.scatter_add_(1, targets[start:stop, None], g).div_(ctx.temperature)
            if need_hidden:
                grad_hidden[start:stop] = grad_logits.to(weight.dtype) @ weight
            if need_weight:
                grad_weight.addmm_(grad_logits.t(), hidden_chunk.to(acc))
            if need_bias:
                grad_bias += grad_logits.sum(dim=0)
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _accum_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.promote_types(hidden.dtype, torch.float32)


def _logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    truncation: SamplingKnobs | None = None,
    targets: torch.Tensor | None = None,
) -> torch.Tensor:
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logits = logits.to(_accum_dtype(hidden)) / temperature
    if truncation is not None:
        truncate_(logits, targets, truncation)
    return logits
