"""vLLM general plugin (entry point `vllm.general_plugins: inflight`): adds the `inflight_commit` utility to EngineCore.

vLLM loads general plugins in every process; `register` is idempotent and only adds a method. EngineCore runs utility
calls in `_process_input_queue`, strictly between two `step()` calls, and on the synchronous step path (the CPU
default, `--no-async-scheduling` on GPU) each step's outputs are stamped with `_weight_version` as the step finishes.
Applying the staged weights and setting the version in this one call is therefore what makes per-token versions
exact: every token sampled after the commit carries the new version, every token before it the old one.
"""

from __future__ import annotations

import time

KV_MODES = ("keep", "recompute")


def inflight_commit(self, version: int, kv: str = "keep") -> dict:
    """EngineCore utility: commit the staged update on every worker and set the weight version, in one engine step gap.

    kv="keep" leaves running requests' KV (computed by the old weights) in place; kv="recompute" preempts every running
    request so its KV is recomputed by the new weights. A worker failure leaves the version unchanged and re-raises.
    """
    if kv not in KV_MODES:
        raise ValueError(f"kv is {kv!r}, expected one of {KV_MODES}")
    start = time.perf_counter()
    workers = self.collective_rpc("inflight_commit_staged", args=(int(version),))
    self._weight_version = str(int(version))
    if kv == "recompute":
        self.reset_prefix_cache(reset_running_requests=True)
    return {"version": int(version), "stall_s": time.perf_counter() - start, "workers": workers}


def register() -> None:
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, "inflight_commit", None) is not inflight_commit:
        EngineCore.inflight_commit = inflight_commit
