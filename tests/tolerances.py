"""Tolerances derived from the arithmetic a test checks, never tuned to the kernels one CPU happens to take.

Why: oneDNN picks other kernels on an Intel CPU with AMX than on an AMD EPYC with AVX2 only (other blockings, other
summation orders), so two fp32 computations of the same quantity differ by different amounts on the two. A tolerance
read off one machine (1e-6, say) fails on the other. Every bound here is a function of the dtype's unit roundoff and
the size of the reduction behind the result:

- `sum_bound(dtype, n, scale)`: the classic worst-case bound of a recursive sum of n terms, |error| <= n·u·Σ|x_i|,
  with u = eps/2 (2^-24 fp32, 2^-8 bf16, 2^-53 float64) and Σ|x_i| <= scale (Higham, "Accuracy and Stability of
  Numerical Algorithms", §4.2; to first order: γ_n = n·u/(1 − n·u) ≈ n·u). Blocked and pairwise sums (what BLAS and
  oneDNN do) are tighter, so it holds for every kernel. A dot product or a matmul entry is such a sum, with
  Σ|x_i| = Σ|a_i|·|b_i| (§3.1, §3.5: |fl(AB) − AB| <= γ_n·|A|·|B|).
- `lm_head_logprob_bound(s)`: the same for log_softmax(h·Wᵀ / T)[target], the logprob the learner and the serve
  compute; `logprob_gradient_bound` for a gradient through it; `policy_loss_bound` for a policy loss of such logprobs.
- A result checked for *logic* (two code paths that must compute the same thing) is computed in float64, where the
  same bound is ~1e-16 relative and no CPU kernel choice can reach it; see `float64_bound`. Worst-case bounds over the
  vocabulary (V = 49152) are ~1e4 times what float64 shows, still ~1e-11 relative: far below any bug.

`check_within` / `assert_within` assert one such bound and name the observed error, the bound and their ratio when
it fails. With INFLIGHT_TOLERANCE_LOG=<file> in the environment they also append one line per check ("<test>::<what>
<error> <bound>"), which is how the margins quoted in the tests were measured (natively, and with
ONEDNN_MAX_CPU_ISA=SSE41 or AVX2, and with ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2: other kernels).
"""

from __future__ import annotations

import math
import os

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of rounding one real number to `dtype`."""
    return torch.finfo(dtype).eps / 2


def sum_bound(dtype: torch.dtype, n: int, scale: float) -> float:
    """Worst-case rounding error of a `dtype` sum of `n` terms whose magnitudes add up to at most `scale`."""
    return n * unit_roundoff(dtype) * scale


def float64_bound(n: int, scale: float) -> float:
    """`sum_bound` in float64, for comparing two float64 computations of the same value (2 of them: both may err)."""
    return 2 * sum_bound(torch.float64, n, scale)


def abs_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a|·|b|ᵀ in float64: entry (i, j) is Σ_k |a_ik|·|b_jk|, the `scale` of the dot product a_i·b_j."""
    return a.detach().double().abs() @ b.detach().double().abs().t()


def lm_head_logprob_bounds(
    dtype: torch.dtype, hidden: torch.Tensor, weight: torch.Tensor, temperature: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Worst-case error of log_softmax((hidden @ weightᵀ + bias) / T)[t] computed in `dtype`, for each row of hidden.

    Each logit is a dot product of length H: it errs by up to γ_{H+3}·Σ|h_i·w_i| / T (the bias, the division by T and
    the log-sum-exp's subtraction of the max are 3 more roundings). The logprob z_t − LSE(z) moves by that twice (LSE
    is 1-Lipschitz in the largest logit error), and the V-term sum of exponentials (all positive, the largest 1) errs
    by γ_V relative, which the log turns into γ_V absolute: 2·γ_{H+3}·max(|h|·|w|)/T + γ_{V+2} (+2: exp, log).
    """
    scale = abs_products(hidden, weight)
    if bias is not None:
        scale = scale + bias.detach().double().abs()
    vocab = weight.shape[0]
    return 2 * sum_bound(dtype, hidden.shape[-1] + 3, 1) * scale.amax(-1) / temperature + sum_bound(dtype, vocab + 2, 1)


def lm_head_logprob_bound(
    dtype: torch.dtype, hidden: torch.Tensor, weight: torch.Tensor, temperature: float, bias: torch.Tensor | None = None
) -> float:
    """`lm_head_logprob_bounds` of the worst row: one bound for every token's logprob."""
    return float(lm_head_logprob_bounds(dtype, hidden, weight, temperature, bias).max())


def logprob_gradient_bound(
    dtype: torch.dtype, hidden: torch.Tensor, weight: torch.Tensor, temperature: float, scale: float
) -> float:
    """Worst-case error of a gradient through those logprobs, entries of size up to `scale` (the largest |entry|).

    The error enters every term through d logp / d z = (onehot − p)/T: p = exp(logprob) is off by p times the logprob
    error, and Wᵀ·dz sums V terms (γ_{V+3}, +3: onehot − p, × upstream, / T); the layers below pass it on linearly.
    """
    vocab = weight.shape[0]
    return (lm_head_logprob_bound(dtype, hidden, weight, temperature) + sum_bound(dtype, vocab + 3, 1)) * scale


def policy_loss_bound(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    logp_error: float | torch.Tensor,
    dtype: torch.dtype,
) -> float:
    """How far a policy loss Σ_t weights_t·term_t (learner/losses.py; `weights` the aggregation's, 0 where masked) may
    move when each logprob is off by up to `logp_error`, and its terms and sum are computed in `dtype`.

    A term A·w·logp (tis) or A·r (ppo, mask), r = exp(logp − behaviour), moves by at most
    |A|·r·expm1(err)·(1 + |logp| + err) (clipped or banded-out terms do not move at all); computing the terms and their
    T-term sum adds sum_bound over T + 8 roundings of the terms' magnitudes.
    """
    live = weights != 0
    logp, err = logp.detach().double().cpu(), torch.as_tensor(logp_error, dtype=torch.float64).expand_as(logp)
    ratio = torch.where(live, logp - behaviour_logp.detach().double().cpu(), 0.0).exp()
    size = torch.where(live, weights.double().cpu() * advantages.detach().double().cpu().abs(), 0.0)
    size = size * ratio * (1 + logp.abs())
    moved = float((size * torch.expm1(err) * (1 + err)).sum())
    return moved + sum_bound(dtype, logp.numel() + 8, float(size.sum()))


def check_within(error: float, bound: float, what: str) -> None:
    """Assert error <= bound; the message (and the INFLIGHT_TOLERANCE_LOG line) names both and their ratio."""
    error, bound = float(error), float(bound)
    log = os.environ.get("INFLIGHT_TOLERANCE_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(log, "a") as f:
            f.write(f"{test}::{what.replace(' ', '_')} {error:.3e} {bound:.3e}\n")
    ratio = error / bound if bound > 0 else math.inf
    assert error <= bound, f"{what}: error {error:.3e} > bound {bound:.3e} ({ratio:.2f}x the derived bound)"


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: float | torch.Tensor, what: str) -> None:
    """|got − want| <= bound everywhere (absolute: rtol 0; `bound` a number or one per entry), same shapes, no NaN.
    Reports the entry nearest its bound; see `check_within`."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got.detach().double().cpu() - want.detach().double().cpu()).abs()
    assert not diff.isnan().any(), f"{what}: NaN"
    if not diff.numel():
        return
    bound = torch.as_tensor(bound, dtype=torch.float64).cpu().expand_as(diff)
    worst = int(torch.where(bound > 0, diff / bound, torch.where(diff > 0, math.inf, 0.0)).argmax())
    check_within(diff.flatten()[worst], bound.flatten()[worst], what)
