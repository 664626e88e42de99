"""Tolerances derived from the arithmetic a test checks, never tuned to the kernels one CPU happens to take.

Why: oneDNN picks other kernels on an Intel CPU with AMX than on an AMD EPYC with AVX2 only (other blockings, other
summation orders), so two fp32 computations of the same quantity differ by different amounts on the two. A tolerance
read off one machine (1e-6, say) fails on the other. Every bound here is a function of the dtype's unit roundoff and
the size of the reduction behind the result:

- `sum_bound(dtype, n, scale)`: the classic worst-case bound of a recursive sum of n terms, |error| <= n·u·Σ|x_i|,
  with u = eps/2 and Σ|x_i| <= scale (Higham, "Accuracy and Stability of Numerical Algorithms", §4.2). Blocked and
  pairwise sums (what BLAS and oneDNN do) are tighter, so it holds for every kernel.
- A result checked for *logic* (two code paths that must compute the same thing) is computed in float64, where the
  same bound is ~1e-16 relative and no CPU kernel choice can reach it; see `float64_bound`.
"""

from __future__ import annotations

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
