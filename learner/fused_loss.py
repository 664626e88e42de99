"""The policy loss fused with the LM head: hidden states in, scalar loss out, never a tokens × vocab tensor.

`fused_policy_loss` gives the same loss and gradients as `token_logprobs` (learner/model.py) followed by
`policy_loss` (learner/losses.py) for every loss kind and aggregation, but in one pass per chunk of tokens:

1. logits_chunk = hidden_chunk @ Wᵀ (cuBLAS / the CPU BLAS, in the model's dtype, as the model's own LM head);
2. a row pass (a Triton kernel on CUDA, the same arithmetic in torch elsewhere) turns each row into the token's
   logprob, its weighted loss term and, in place of the logits, the logit gradient w · dℓ/dlogp · (onehot − p) / T;
3. grad_hidden_chunk = grad_logits @ W and grad_W += grad_logitsᵀ @ hidden_chunk (fp32 accumulation).

Because the loss is known per token, the gradient is finished in forward (as fused linear-cross-entropy kernels do);
backward only scales it by the incoming gradient. Peak extra memory: one chunk of logits plus the fp32 gradient of W,
against the naive path's several tokens × vocab fp32 tensors.

The aggregation (token or sequence mean, local or global normaliser) becomes one weight per token, so the fused loss
is Σ_t weight_t · ℓ_t; `aggregation_weights` builds it exactly as `policy_loss` aggregates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from learner.knobs import FUSED_MODES
from learner.losses import LossConfig, _metrics

_TRITON: bool | None = None


@dataclass
class FusedLossInputs:
    """What `PolicyModel.forward` needs to compute the loss inside the root's forward ([B, L] per-token tensors)."""

    behaviour_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    seq_ids: torch.Tensor
    cfg: LossConfig
    normalizer: float | None = None


class FusedPolicyLoss(NamedTuple):
    """`fused_policy_loss`'s result: the scalar loss (differentiable w.r.t. the hidden states and the LM head weight),
    the detached per-token logprobs (fp32, fp64 for fp64 inputs) and `policy_loss`'s metrics."""

    loss: torch.Tensor
    logp: torch.Tensor
    metrics: dict[str, float]


def fused_enabled(mode: str, device: torch.device) -> bool:
    """TrainConfig.fused_loss: 'auto' is on where the Triton kernel runs (CUDA), 'on' everywhere (the torch row pass
    off CUDA), 'off' keeps `token_logprobs` + `policy_loss`."""
    if mode not in FUSED_MODES:
        raise ValueError(f"fused_loss is {mode!r}, expected one of {FUSED_MODES}")
    return mode == "on" or (mode == "auto" and device.type == "cuda" and triton_available())


def triton_available() -> bool:
    """True where the Triton kernel can run: Triton imports and CUDA is there."""
    global _TRITON
    if _TRITON is None:
        try:
            import learner.triton_kernels  # noqa: F401

            _TRITON = torch.cuda.is_available()
        except Exception:  # no Triton, or a Triton that cannot build here: the torch path is the fallback
            _TRITON = False
    return _TRITON


def aggregation_weights(
    mask: torch.Tensor, seq_ids: torch.Tensor, aggregation: str, normalizer: float | None = None
) -> torch.Tensor:
    """Per-token weight w_t such that Σ_t w_t · ℓ_t equals `policy_loss`'s aggregated loss (0 where masked); float64,
    one value per token, so a float64 loss is not rounded through it."""
    maskf = mask.to(torch.float64)
    if aggregation == "token":
        return maskf / (maskf.sum().clamp(min=1) if normalizer is None else normalizer)
    if aggregation != "sequence":
        raise ValueError(f"aggregation is {aggregation!r}, expected 'token' or 'sequence'")
    _, seq_index = torch.unique(seq_ids, return_inverse=True)
    counts = maskf.new_zeros(int(seq_index.max()) + 1 if seq_index.numel() else 0).index_add(0, seq_index, maskf)
    if normalizer is None:
        normalizer = (counts > 0).sum().clamp(min=1)
    return maskf / counts.clamp(min=1)[seq_index] / normalizer


def fused_policy_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    cfg: LossConfig,
    temperature: float = 1.0,
    normalizer: float | None = None,
    chunk_tokens: int = 2048,
    backend: str = "auto",
) -> FusedPolicyLoss:
    """The loss, the per-token logprobs and the metrics (`FusedPolicyLoss`) of `token_logprobs` + `policy_loss`,
    computed with the LM head chunk by chunk. backend: 'auto' (Triton on CUDA when it is there, else
    torch), 'triton' or 'torch'."""
    check_head_inputs(hidden, lm_head_weight, targets, temperature, chunk_tokens, None)
    for name, t in (
        ("behaviour_logp", behaviour_logp),
        ("advantages", advantages),
        ("mask", mask),
        ("seq_ids", seq_ids),
    ):
        if t.shape != targets.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(targets.shape)} (one per token)")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend is {backend!r}, expected 'auto', 'triton' or 'torch'")
    use_triton = backend == "triton" or (backend == "auto" and hidden.is_cuda and triton_available())
    if use_triton and not (hidden.is_cuda and triton_available()):
        raise ValueError("backend='triton' needs Triton and CUDA tensors; use backend='torch' (or 'auto') here")
    weight = aggregation_weights(mask, seq_ids, cfg.aggregation, normalizer).to(hidden.device)
    loss, logp, hit = _FusedPolicyLoss.apply(
        hidden,
        lm_head_weight,
        targets,
        behaviour_logp.detach(),
        advantages.detach(),
        weight,
        cfg,
        float(temperature),
        chunk_tokens,
        use_triton,
    )
    log_ratio = torch.where(mask, logp - behaviour_logp.detach().float(), 0.0)
    return FusedPolicyLoss(loss, logp, _metrics(log_ratio, mask, hit.bool()))


def _params(cfg: LossConfig) -> tuple[float, float]:
    if cfg.kind == "tis":
        return cfg.tis_cap, 0.0
    if cfg.kind == "ppo":
        return 1 - cfg.clip_low, 1 + cfg.clip_high
    return cfg.mask_low, cfg.mask_high


def _torch_row_pass(
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
    """The Triton row kernel's arithmetic in torch (fp32 or fp64 internally), writing the same outputs."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(acc) / temperature
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(1, targets[:, None]).squeeze(1) - lse
    live = weight != 0
    ratio = torch.exp(torch.where(live, lp - behaviour.to(acc), 0.0))
    a = torch.where(live, adv.to(acc), 0.0)
    if kind == "tis":
        capped = ratio.clamp(max=p1)
        term, dterm, h = -a * capped * lp, -a * capped, ratio > p1
    elif kind == "ppo":
        unclipped, clipped = ratio * a, ratio.clamp(p1, p2) * a
        term = -torch.minimum(unclipped, clipped)
        dterm, h = torch.where(unclipped <= clipped, -a * ratio, 0.0), clipped < unclipped
    else:
        in_band = (ratio >= p1) & (ratio <= p2)
        term = torch.where(in_band, -a * ratio, 0.0)
        dterm, h = term, ~in_band
    w = weight.to(acc)
    logp.copy_(lp)
    loss.copy_(w * term)
    hit.copy_(h & live)
    if write_grad:
        g = (w * dterm / temperature)[:, None]
        grad = torch.exp(x - lse[:, None]).mul_(-g)
        grad.scatter_add_(1, targets[:, None], g)
        logits.copy_(grad)


class _FusedPolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        behaviour,
        adv,
        token_w,
        cfg: LossConfig,
        temperature: float,
        chunk_tokens: int,
        use_triton: bool,
    ):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        write_grad = need_hidden or need_weight
        acc = torch.promote_types(hidden.dtype, torch.float32)
        T = hidden.shape[0]
        logp = torch.empty(T, dtype=acc, device=hidden.device)
        loss_tok = torch.empty(T, dtype=acc, device=hidden.device)
        hit = torch.empty(T, dtype=torch.int8 if use_triton else torch.bool, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        p1, p2 = _params(cfg)
        if use_triton:
            from learner.triton_kernels import row_pass
        else:
            row_pass = _torch_row_pass
        behaviour, adv, token_w = behaviour.to(acc), adv.to(acc), token_w.to(acc)
        for start in range(0, T, chunk_tokens):
            stop = min(start + chunk_tokens, T)
            h = hidden[start:stop]
            logits = h @ weight.t()  # the model's dtype, as its LM head; overwritten with the logit gradient
            row_pass(
                logits,
                targets[start:stop],
                behaviour[start:stop],
                adv[start:stop],
                token_w[start:stop],
                logp[start:stop],
                loss_tok[start:stop],
                hit[start:stop],
                temperature,
                cfg.kind,
                p1,
                p2,
                write_grad,
            )
            if need_hidden:
                torch.mm(logits, weight, out=grad_hidden[start:stop])
            if need_weight:
                _accumulate(grad_weight, logits.t(), h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(logp, hit)
        return loss_tok.sum(), logp, hit

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_hit):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_loss.to(grad_hidden.dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_loss).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None, None, None, None, None, None


def _accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out (fp32/fp64) += a @ b for low-precision a, b: on CUDA cuBLAS accumulates into the fp32 `out` straight from
    bf16 operands (`out_dtype`); elsewhere one temporary of out's shape in the operands' dtype."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif out.is_cuda:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out.add_(a @ b)


def check_head_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    bias: torch.Tensor | None,
) -> None:
    """The LM head's inputs, checked alike by `token_logprobs` (learner/model.py) and `fused_policy_loss`."""
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
