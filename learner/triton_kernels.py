"""Triton row kernel for learner/fused_loss.py: logprob, IS-loss term and logit gradient of one chunk of tokens.

One program per token row of a [C, V] logits chunk (the cuBLAS output of hidden_chunk @ Wᵀ, in the model's dtype):

- pass 1 over the vocabulary in BLOCK_V tiles: online max / sum of exp(logit / T) → log-normaliser; the target's logit
  → logp = logit_target / T − lse;
- the token's loss term and d loss / d logp for the loss kind (tis, ppo, mask), times the token's aggregation weight
  (0 for a masked token: its behaviour logprob is never read into an exp);
- pass 2 over the vocabulary: the logit gradient g · (onehot − softmax) / T, written over the logits in place.

So a chunk costs two reads and one write of C × V values and nothing of size tokens × vocab exists. Imported only
where Triton and CUDA are (learner/fused_loss.py decides); the torch path in fused_loss.py is the same arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KINDS = {"tis": 0, "ppo": 1, "mask": 2}


@triton.jit
def _row_kernel(
    logits_ptr,  # [C, V] in the model's dtype; overwritten with the logit gradient
    stride_row,
    targets_ptr,  # [C] int64
    behaviour_ptr,  # [C] fp32
    adv_ptr,  # [C] fp32
    weight_ptr,  # [C] fp32: aggregation weight, 0 = masked
    logp_ptr,  # [C] fp32 out
    loss_ptr,  # [C] fp32 out: weight * loss term
    hit_ptr,  # [C] int8 out: the trust region changed this token's weight
    vocab,
    inv_temp,
    kind: tl.constexpr,
    p1,  # tis: cap; ppo: 1 - clip_low; mask: mask_low
    p2,  # ppo: 1 + clip_high; mask: mask_high
    write_grad: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    lse = _log_normaliser(base, vocab, inv_temp, BLOCK_V)
    target = tl.load(targets_ptr + row)
    logp = tl.load(base + target).to(tl.float32) * inv_temp - lse
    w = tl.load(weight_ptr + row)
    live = w != 0.0
    term, dterm, hit = _loss_term(logp, tl.load(behaviour_ptr + row), tl.load(adv_ptr + row), live, kind, p1, p2)
    tl.store(logp_ptr + row, logp)
    tl.store(loss_ptr + row, w * term)
    tl.store(hit_ptr + row, (hit & live).to(tl.int8))
    if write_grad:
        _write_logit_grad(base, vocab, inv_temp, lse, target, w * dterm * inv_temp, BLOCK_V)


@triton.jit
def _log_normaliser(base, vocab, inv_temp, BLOCK_V: tl.constexpr):
    """Pass 1: log Σ exp(logit / T) over the row, with an online max per lane so no tile overflows."""
    offs = tl.arange(0, BLOCK_V)
    run_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_temp
        new_max = tl.maximum(run_max, x)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # a lane that has seen only padding stays at 0
        run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    return row_max + tl.log(tl.sum(run_sum * tl.exp(run_max - row_max), axis=0))


@triton.jit
def _loss_term(logp, behaviour, adv, live, kind: tl.constexpr, p1, p2):
    """(loss term, d term / d logp, trust-region hit) of one token; a masked token (`live` False) gets ratio 1 and
    advantage 0, so its behaviour logprob never reaches an exp."""
    ratio = tl.exp(tl.where(live, logp - behaviour, 0.0))
    adv = tl.where(live, adv, 0.0)
    if kind == 0:  # tis: -A * min(r, cap).detach() * logp
        capped = tl.minimum(ratio, p1)
        term = -adv * capped * logp
        dterm = -adv * capped
        hit = ratio > p1
    elif kind == 1:  # ppo: -min(r A, clip(r) A)
        unclipped = ratio * adv
        clipped = tl.minimum(tl.maximum(ratio, p1), p2) * adv
        term = -tl.minimum(unclipped, clipped)
        dterm = tl.where(unclipped <= clipped, -adv * ratio, 0.0)
        hit = clipped < unclipped
    else:  # mask: -A r inside [low, high], else nothing
        in_band = (ratio >= p1) & (ratio <= p2)
        term = tl.where(in_band, -adv * ratio, 0.0)
        dterm = term
        hit = ~in_band
    return term, dterm, hit


@triton.jit
def _write_logit_grad(base, vocab, inv_temp, lse, target, g, BLOCK_V: tl.constexpr):
    """Pass 2: the logit gradient g · (onehot(target) − softmax(logit / T)), written over the row in its dtype."""
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < vocab, other=0.0).to(tl.float32) * inv_temp
        grad = -g * tl.exp(x - lse) + tl.where(cols == target, g, 0.0)
        tl.store(base + cols, grad.to(base.dtype.element_ty), mask=cols < vocab)


def row_pass(
    logits: torch.Tensor,
    targets: torch.Tensor,
    behaviour: torch.Tensor,
    adv: torch.Tensor,
    weight: torch.Tensor,
    logp: torch.Tensor,
    loss: torch.Tensor,
    hit: torch.Tensor,
    temperature: float,
    kind: str,
    p1: float,
    p2: float,
    write_grad: bool,
) -> None:
    """`_row_kernel` over every row of the [C, V] `logits` chunk, one program per row; the arguments and outputs of
    learner/fused_loss.py:_torch_row_pass (`hit` int8 here)."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    _row_kernel[(rows,)](
        logits,
        logits.stride(0),
        targets,
        behaviour,
        adv,
        weight,
        logp,
        loss,
        hit,
        vocab,
        1.0 / temperature,
        kind=KINDS[kind],
        p1=p1,
        p2=p2,
        write_grad=write_grad,
        BLOCK_V=4096,
        num_warps=8,
    )
