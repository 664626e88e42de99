"""Learner log-probabilities of the sampled tokens, from the last hidden states and the LM head.

The learner step calls `token_logprobs` with the model's final hidden states (after the last norm), the LM head weight
and the completion tokens, at the sampling temperature, so the result is comparable with vLLM's processed behaviour
logprobs. The log-softmax runs in fp32 and tokens are processed `chunk_tokens` at a time, so the tokens × vocab
logits tensor never exists whole — neither in forward nor in backward: `_ChunkedTokenLogprobs` keeps only the
per-token log-normaliser and recomputes each chunk's logits in backward. Peak extra memory is about
chunk_tokens × vocab fp32 values.

With a `Truncation` (top-k / top-p / min-p sampling, learner/truncation.py) the log-softmax runs over the tokens the
sampler kept, chunk by chunk in forward and again in backward (the mask is recomputed from the same logits).

`naive_token_logprobs` materialises all logits; it is the reference for tests and the baseline for benchmarks.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from learner.truncation import Truncation


def naive_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    lm_head_bias: torch.Tensor | None = None,
    truncation: Truncation | None = None,
) -> torch.Tensor:
    """log_softmax((hidden @ Wᵀ + b) / temperature)[t, targets[t]], via the full [T, V] logits (over the kept tokens
    with a `truncation`)."""
    logits = _logits(hidden, lm_head_weight, lm_head_bias, temperature)
    if truncation is not None:
        truncation.mask_(logits, targets)
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)


def token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    lm_head_bias: torch.Tensor | None = None,
    truncation: Truncation | None = None,
) -> torch.Tensor:
    """Log-probability of `targets[t]` under softmax((hidden[t] @ Wᵀ + b) / temperature), for every t; with an active
    `truncation`, under that softmax renormalised over the tokens the sampler's rule keeps (the target always kept).

    hidden: [T, H]; lm_head_weight: [V, H] (same dtype as hidden); targets: [T] int64; lm_head_bias: [V] or None.
    Returns [T] in float32 (float64 when the inputs are float64). Differentiable w.r.t. hidden, weight and bias.
    The matmul runs in the inputs' dtype, as the model's own LM head does; everything after it runs in fp32.
    The weight must be a plain full tensor (with FSDP, call this where the LM head is unsharded).
    """
    _check_logprob_inputs(hidden, lm_head_weight, targets, temperature, chunk_tokens, lm_head_bias)
    rule = truncation if truncation is not None and truncation.active else None
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
        truncation: Truncation | None,
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
    truncation: Truncation | None = None,
    targets: torch.Tensor | None = None,
) -> torch.Tensor:
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logits = logits.to(_accum_dtype(hidden)) / temperature
    if truncation is not None:
        truncation.mask_(logits, targets)
    return logits


def _check_logprob_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    bias: torch.Tensor | None,
) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden has shape {tuple(hidden.shape)} and lm_head_weight {tuple(weight.shape)}, "
            "expected [T, H] and [V, H] with the same H"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden dtype is {hidden.dtype}, lm_head_weight dtype is {weight.dtype}: cast them to one")
    if targets.dtype != torch.int64 or targets.shape != (hidden.shape[0],):
        raise ValueError(
            f"targets has dtype {targets.dtype} and shape {tuple(targets.shape)}, "
            f"expected torch.int64 and ({hidden.shape[0]},), one target per hidden row"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"lm_head_bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    if not temperature > 0:
        raise ValueError(f"temperature is {temperature}, expected > 0 (use the sampling temperature)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens is {chunk_tokens}, expected >= 1")
