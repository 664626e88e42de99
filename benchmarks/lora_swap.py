"""LoRA adapter updates vs full-weight updates, side by side in one run, on SmolLM2 under a generation load.

    python -m benchmarks.lora_swap [--rank 16] [--cycles 8] [--half 3.5] [--concurrency 16] [--json out.json]

Two engines one after the other, the same workload (benchmarks/weight_swap.py's: `--concurrency` requests in flight,
EOS ignored, seeded lengths) and the same paired cycles (an update at the start of each 2 x `--half` s cycle; its cost
is the tokens of the quiet half after it minus those of its own half):
- full: the CPU default serve (`--update-memory double`), each update all of SmolLM2's weights (checkpoints A and B
  alternating: B moves every weight by a quarter of its std);
- adapter: the same serve with a rank-`--rank` adapter on every projection of every layer (`--lora-rank`), each update
  the adapter alone (two random adapters alternating), committed into vLLM's adapter slot (vllm_patches/adapter.py).
Printed per kind: bytes per update, the update's seconds (receive + prepare), the commit stall, tokens lost per update
(mean ± standard error); then adapter / full for each. The CPU is named (lscpu model name and bf16 flags).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.weight_swap import SETTLE_S, TESTS_DIR, GenerationRun, _prompts, _warm_up, _workload


async def run_kind(kind: str, args, tmp: Path) -> dict:
    """One engine of `kind` ("full" or "adapter") under the workload, `args.cycles` updates; its figures."""
    sys.path.insert(0, str(TESTS_DIR))
    sys.path.insert(0, str(TESTS_DIR / "vllm_patches"))
    from support import Sender, load_state, perturbed_checkpoint
    from test_lora_swap import random_adapter

    from inflight.models import model_dir
    from inflight.serve.app import standalone_engine_config
    from inflight.serve.config import ServeConfig
    from inflight.wire.weights import AdapterSpec
    from vllm_patches.adapter import ServedAdapter
    from vllm_patches.engine import InflightEngine

    base = model_dir("smollm2")
    lora = {}
    if kind == "adapter":
        states = [random_adapter(base, tmp / name, seed, rank=args.rank) for seed, name in ((1, "A"), (2, "B"))]
        spec: AdapterSpec | None = ServedAdapter.read(tmp / "A").spec
        lora = {"lora_rank": spec.rank, "lora_alpha": spec.alpha, "lora_targets": ",".join(spec.targets),
                "lora_init": str(tmp / "A")}  # fmt: skip
    else:
        states, spec = [load_state(base), perturbed_checkpoint(base, tmp / "B", seed=7)], None
    flags = ServeConfig(max_model_len=512, kv_cache_gib=args.kv_cache_gib, dtype="bfloat16", head_dtype="model", **lora)
    cfg = standalone_engine_config(flags, base)
    engine = await InflightEngine.start(cfg)
    try:
        sender = Sender(timeout_s=120)
        await sender.connect(engine)
        prompts = _prompts(base)
        await _warm_up(engine, prompts, args.concurrency)
        run = GenerationRun(kind, args.half)
        async with _workload(engine, prompts, args.concurrency, kind):
            await asyncio.sleep(SETTLE_S)
            for _ in range(args.cycles):
                await cycle(engine, sender, states, run, spec)
    finally:
        engine.shutdown()
    return figures(run)


async def cycle(engine, sender, states, run: GenerationRun, adapter) -> None:
    """One never-stop update at the start of a 2 x half cycle; the tokens of both halves."""
    start, tokens = time.monotonic(), engine.tokens_generated
    state = states[(engine.version + 1) % 2]
    run.reports.append(await sender.push(engine, state, engine.version + 1, adapter=adapter))
    await asyncio.sleep(max(0.0, start + run.half_s - time.monotonic()))
    middle = engine.tokens_generated
    await asyncio.sleep(max(0.0, start + 2 * run.half_s - time.monotonic()))
    run.update_tokens.append(middle - tokens)
    run.quiet_tokens.append(engine.tokens_generated - middle)


def figures(run: GenerationRun) -> dict:
    lost = [q - u for q, u in zip(run.quiet_tokens, run.update_tokens, strict=True)]
    late = [r.total_s for r in run.reports if r.total_s > run.half_s]
    return {
        "kind": run.label,
        "updates": len(lost),
        "bytes_per_update": statistics.mean(r.bytes for r in run.reports),
        "update_s": statistics.mean(r.total_s for r in run.reports),
        "stall_ms": 1e3 * statistics.mean(r.stall_s for r in run.reports),
        "stall_ms_max": 1e3 * max(r.stall_s for r in run.reports),
        "tokens_lost": statistics.mean(lost),
        "tokens_lost_se": statistics.stdev(lost) / len(lost) ** 0.5 if len(lost) > 1 else float("nan"),
        "quiet_tok_s": sum(run.quiet_tokens) / (run.half_s * len(lost)),
        "late_updates": len(late),  # an update that outlasted its half: its cost spills into the quiet half
        "lost": lost,
    }


def report(rows: list[dict], args) -> dict:
    from inflight.machine import cpu_label

    full, adapter = rows
    ratios = {key: adapter[key] / full[key] for key in ("bytes_per_update", "update_s", "stall_ms") if full[key]}
    print(f"SmolLM2 bf16, rank-{args.rank} adapter on every projection; CPU: {cpu_label()}")
    print(
        f"{'kind':<8} {'MB/update':>10} {'update s':>9} {'stall ms':>9} {'max ms':>7} {'lost/update':>14} {'tok/s':>6}"
    )
    for r in rows:
        lost = f"{r['tokens_lost']:.0f} ± {r['tokens_lost_se']:.0f}"
        print(
            f"{r['kind']:<8} {r['bytes_per_update'] / 1e6:>10.2f} {r['update_s']:>9.2f} {r['stall_ms']:>9.1f} "
            f"{r['stall_ms_max']:>7.1f} {lost:>14} {r['quiet_tok_s']:>6.1f}"
        )
    print("adapter / full: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return {"cpu": cpu_label(), "rank": args.rank, "rows": rows, "adapter_over_full": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_swap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--cycles", type=int, default=8)
    parser.add_argument("--half", type=float, default=3.5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("full", "adapter"):
            rows.append(asyncio.run(run_kind(kind, args, Path(tmp))))
    result = report(rows, args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
