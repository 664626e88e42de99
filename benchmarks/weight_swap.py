"""Weight-swap benchmark: one run, side by side, on this machine.

1. Transfer bandwidth over the gloo weights group vs bucket size, next to an in-process memcpy of the same bytes.
2. Commit stall (the only pause never-stop imposes) for tiny-llama and SmolLM2.
3. Generation tokens/s under an update every few seconds — never-stop vs keep-pause — as a ratio to no updates.

    python -m benchmarks.weight_swap [--duration 20] [--update-every 3] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def _receiver(port: int, manifest_files: list[str], repeats: int) -> None:
    from inflight.wire.group import GroupAddress, WeightsGroup
    from inflight.wire.transfer import receive_update
    from inflight.wire.weights import UpdateManifest

    group = WeightsGroup(GroupAddress("127.0.0.1", port, 2, timeout_s=120), 1)
    for path in manifest_files:
        manifest = UpdateManifest.decode(Path(path).read_bytes())
        for _ in range(repeats):
            receive_update(group, manifest)


def bench_transfer(state, bucket_mib: list[int], repeats: int = 3) -> list[tuple[str, float, float]]:
    """(label, seconds, GB/s) for each bucket size and for the memcpy baseline."""
    import torch

    from inflight.wire.group import GroupAddress, WeightsGroup, open_store
    from inflight.wire.transfer import send_update
    from inflight.wire.weights import plan_manifest

    manifests = [plan_manifest(state, 1, size * MiB) for size in bucket_mib]
    total = manifests[0].total_bytes
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for m, size in zip(manifests, bucket_mib, strict=True):
            files.append(str(Path(tmp) / f"m{size}"))
            Path(files[-1]).write_bytes(m.encode())
        store = open_store(GroupAddress("127.0.0.1", 0, 2, timeout_s=120), is_host=True)
        proc = mp.get_context("spawn").Process(target=_receiver, args=(store.port, files, repeats))
        proc.start()
        group = WeightsGroup(GroupAddress("127.0.0.1", store.port, 2, timeout_s=120), 0, store)
        rows = []
        for m, size in zip(manifests, bucket_mib, strict=True):
            times = [send_update(group, m, state).seconds for _ in range(repeats)]
            rows.append((f"gloo, {size} MiB buckets ({len(m.bucket_sizes)})", statistics.median(times)))
        proc.join()
    src = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
    dst = torch.empty_like(src)
    copies = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - start)
    rows.append(("memcpy baseline (one process)", statistics.median(copies)))
    return [(label, s, total / s / 1e9) for label, s in rows]


async def _workload(engine, prompts, params, duration: float, concurrency: int, on_tick=None) -> int:
    """Keep `concurrency` requests in flight for `duration` s; return tokens of the requests that finished."""
    tokens, counter, deadline = 0, 0, time.monotonic() + duration

    async def worker(w: int):
        nonlocal tokens, counter
        while time.monotonic() < deadline:
            counter += 1
            done = await engine.generate(prompts[counter % len(prompts)], params, f"w{w}-{counter}")
            if time.monotonic() <= deadline:
                tokens += len(done.token_ids)

    workers = [asyncio.ensure_future(worker(w)) for w in range(concurrency)]
    if on_tick is not None:
        await on_tick(deadline)
    await asyncio.gather(*workers)
    return tokens


async def bench_generation(engine, sender, states, prompts, args) -> dict[str, dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=64, temperature=1.0)
    results = {}
    for mode in ("none", "never-stop", "keep-pause"):
        reports = []

        async def updates(deadline, mode=mode, reports=reports):
            while time.monotonic() + args.update_every < deadline:
                await asyncio.sleep(args.update_every)
                state = states[len(reports) % 2]
                reports.append(await sender.push(engine, state, engine.version + 1, mode=mode))

        start = time.monotonic()
        tick = None if mode == "none" else updates
        tokens = await _workload(engine, prompts, params, args.duration, args.concurrency, tick)
        elapsed = time.monotonic() - start
        results[mode] = {"tok_s": tokens / elapsed, "updates": len(reports),
                         "stall_ms": 1e3 * statistics.mean(r.stall_s for r in reports) if reports else 0.0}  # fmt: skip
    return results


async def bench_commits(engine, sender, states, n: int) -> list[float]:
    stalls = []
    for i in range(n):
        report = await sender.push(engine, states[(i + 1) % 2], engine.version + 1)
        stalls.append(report.commit_s)
    return stalls


def _prompts(model_dir, n: int = 32) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [[{"role": "user", "content": f"What is {i % 9 + 1} + {i * 7 % 9 + 1}? Reply with only the number."}]
            for i in range(n)]  # fmt: skip
    return [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
            for m in msgs]  # fmt: skip


def _states(model_dir, tmp: Path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support import load_state, perturbed_checkpoint

    return load_state(model_dir), perturbed_checkpoint(model_dir, tmp / "B", seed=3)


async def engine_benches(name: str, args, with_generation: bool) -> dict:
    sys_path_tests = Path(__file__).resolve().parents[1] / "tests"
    import sys

    sys.path.insert(0, str(sys_path_tests))
    from support import Sender

    from inflight.models import prepare
    from vllm_patches.engine import EngineConfig, InflightEngine

    model_dir = prepare(name)
    with tempfile.TemporaryDirectory() as tmp:
        states = _states(model_dir, Path(tmp))
        engine = await InflightEngine.start(EngineConfig(model=str(model_dir), max_model_len=512))
        try:
            sender = Sender(timeout_s=120)
            await sender.connect(engine)
            out = {"commit_s": await bench_commits(engine, sender, states, args.commits), "states": states}
            if with_generation:
                out["generation"] = await bench_generation(engine, sender, states, _prompts(model_dir), args)
        finally:
            engine.shutdown()
    return out


def report(transfer, commits: dict, generation: dict, args) -> str:
    lines = ["## Transfer bandwidth (SmolLM2 bf16, loopback)", "", "| path | median s | GB/s |", "|---|---|---|"]
    lines += [f"| {label} | {s:.3f} | {gbs:.2f} |" for label, s, gbs in transfer]
    lines += ["", "## Commit stall (never-stop)", "", "| model | mean ms | max ms | n |", "|---|---|---|---|"]
    for name, stalls in commits.items():
        lines.append(f"| {name} | {1e3 * statistics.mean(stalls):.1f} | {1e3 * max(stalls):.1f} | {len(stalls)} |")
    base = generation["none"]["tok_s"]
    every, dur = f"{args.update_every:.0f} s", f"{args.duration:.0f} s"
    title = f"## Generation, an update every {every} ({dur}, {args.concurrency} in flight, SmolLM2)"
    lines += [
        "",
        title,
        "",
        "| mode | tokens/s | ratio to no updates | updates | mean stall ms |",
        "|---|---|---|---|---|",
    ]
    for mode, r in generation.items():
        lines.append(f"| {mode} | {r['tok_s']:.1f} | {r['tok_s'] / base:.3f} | {r['updates']} | {r['stall_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weight_swap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per generation mode")
    parser.add_argument("--update-every", type=float, default=3.0, help="seconds between updates")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--commits", type=int, default=5, help="updates per model for the commit-stall figure")
    parser.add_argument("--buckets-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    args = parser.parse_args(argv)
    tiny = asyncio.run(engine_benches("tiny-llama", args, with_generation=False))
    smol = asyncio.run(engine_benches("smollm2", args, with_generation=True))
    transfer = bench_transfer(smol["states"][0], args.buckets_mib)
    commits = {"tiny-llama": tiny["commit_s"], "smollm2": smol["commit_s"]}
    print(report(transfer, commits, smol["generation"], args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
