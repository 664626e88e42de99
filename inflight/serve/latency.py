"""Simulated tool latency for agentic workloads: a long-tailed delay per sample before it is scored.

Real agent rollouts wait on tools (code execution, search) whose latency has a heavy tail; a few samples wait far
longer than the median, which is exactly what stalls synchronous RL. `--tool-latency lognormal:0.5,1.0` draws a
log-normal with median 0.5 s and sigma 1.0; `pareto:0.2,1.5` a Pareto with scale 0.2 s and shape 1.5.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable


def parse_latency(spec: str, seed: int = 0) -> Callable[[], float]:
    """A seeded sampler of seconds for `spec`; raise ValueError naming the flag on a bad spec."""
    kind, _, args = spec.partition(":")
    try:
        a, b = (float(x) for x in args.split(","))
    except ValueError:
        raise ValueError(
            f"--tool-latency is {spec!r}, expected 'lognormal:MEDIAN_S,SIGMA' or 'pareto:SCALE_S,ALPHA'"
        ) from None
    if a <= 0 or b <= 0:
        raise ValueError(f"--tool-latency is {spec!r}: both parameters must be > 0")
    rng = random.Random(seed)
    if kind == "lognormal":
        return lambda: rng.lognormvariate(math.log(a), b)
    if kind == "pareto":
        return lambda: a * rng.paretovariate(b)
    raise ValueError(f"--tool-latency kind is {kind!r}, expected 'lognormal' or 'pareto'")
