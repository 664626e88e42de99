"""Weight-swap benchmark: one run, side by side, on this machine.

1. Transfer bandwidth over the gloo weights group vs bucket size, next to an in-process memcpy of the same bytes.
2. Commit stall (the only pause never-stop imposes) of both commit paths — `--update-memory double` (prepared off the
   engine thread, swapped in) and `low` (vLLM's layerwise reload in place) — next to keep-pause's whole pause, for
   tiny-llama, SmolLM2 and a random model of SmolLM2's family at ~360M parameters (built once, cached); the worker's
   extra resident memory during an update of each path.
3. Generation under updates on SmolLM2 — never-stop on both paths, keep-pause on the in-place one: the generated
   tokens each update costs (stall + slowdown while it is received and prepared). One continuous workload per mode,
   `--cycles` cycles of 2 x `--half` s with an update at each cycle's start; an update's cost is the tokens of the
   quiet half that follows minus those of its own half (paired: each update has its own baseline, seconds later on
   the same engine and workload). Requests ignore EOS and have lengths drawn from one seeded range, so the work does
   not depend on which weights are live (with EOS, checkpoint A ends its answers in a few tokens and B never does,
   and the throughput measured which one was live, not the update).

    python -m benchmarks.weight_swap [--cycles 16] [--half 3.5] [--concurrency 16] [--dtype auto]

Every figure is printed and appended (markdown to `--out`, one JSON line per figure next to it) as soon as it is
measured, so a crash later loses nothing. A figure that cannot be measured (no token in the window, no update
committed) is written as "not measured: <why>"; a section that raises is written the same way, the run goes on, and
the exit status is 1 only then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import json
import multiprocessing as mp
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import RESULTS

MiB = 1 << 20
TESTS_DIR = Path(__file__).resolve().parents[1] / "tests"  # support.Sender and the checkpoint helpers live there


@dataclass(frozen=True)
class Table:
    key: str
    title: str
    columns: tuple[str, ...]
    note: str = ""


@dataclass
class Recorder:
    """Prints each table line and appends it to `out` (markdown) at once; one JSON line per figure to `jsonl`."""

    out: Path
    jsonl: Path
    context: dict  # date, CPU, precision: repeated in every JSON line so that a line stands alone
    failures: list[str] = field(default_factory=list)
    not_measured_count: int = 0

    def emit(self, text: str = "") -> None:
        print(text, flush=True)
        # Opened per line, closed at once: the line is on disk before the next measurement starts.
        with self.out.open("a") as f:
            f.write(text + "\n")

    def record(self, table: Table, label: str, figures: dict) -> None:
        with self.jsonl.open("a") as f:
            f.write(json.dumps({**self.context, "table": table.key, "label": label, **figures}) + "\n")

    def open(self, table: Table) -> None:
        self.emit()
        self.emit(f"### {table.title}")
        self.emit()
        if table.note:
            self.emit(table.note)
            self.emit()
        self.emit("| " + " | ".join(table.columns) + " |")
        self.emit("|" + "---|" * len(table.columns))

    def row(self, table: Table, label: str, cells: list[str], figures: dict) -> None:
        self.emit("| " + " | ".join([label, *cells]) + " |")
        self.record(table, label, figures)

    def not_measured(self, table: Table, label: str, why: str) -> None:
        self.not_measured_count += 1
        blanks = ["—"] * (len(table.columns) - 2)
        self.emit("| " + " | ".join([label, f"not measured: {why}", *blanks]) + " |")
        self.record(table, label, {"not_measured": why})

    @contextlib.contextmanager
    def guard(self, table: Table, label: str):
        """Run one row's measurement; an exception becomes a 'not measured' row and a failure, not a crash."""
        try:
            yield
        except Exception as exc:
            traceback.print_exc()
            why = f"raised {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            self.failures.append(f"{table.key} / {label}: {why}")
            self.not_measured(table, label, why)


# --- transfer -------------------------------------------------------------------------------------------------------


def _receiver(port: int, manifest_files: list[str], repeats: int) -> None:
    from inflight.wire.group import GroupAddress, WeightsGroup
    from inflight.wire.transfer import receive_update
    from inflight.wire.weights import UpdateManifest

    group = WeightsGroup(GroupAddress("127.0.0.1", port, 2, timeout_s=120), 1)
    for path in manifest_files:
        manifest = UpdateManifest.decode(Path(path).read_bytes())
        for _ in range(repeats):
            receive_update(group, manifest)


def transfer_table(dtype: str) -> Table:
    return Table("transfer", f"Transfer bandwidth (SmolLM2 {dtype}, loopback)", ("path", "median s", "GB/s"))


def bench_transfer(rec: Recorder, state, bucket_mib: list[int], dtype: str, repeats: int = 3) -> None:
    """One row per bucket size (gloo, sender here, receiver in a spawned process), then the memcpy baseline."""
    from inflight.wire.group import GroupAddress, WeightsGroup, open_store
    from inflight.wire.weights import plan_manifest

    table = transfer_table(dtype)
    manifests = [plan_manifest(state, 1, size * MiB) for size in bucket_mib]
    total = manifests[0].total_bytes
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for m, size in zip(manifests, bucket_mib, strict=True):
            files.append(str(Path(tmp) / f"m{size}"))
            Path(files[-1]).write_bytes(m.encode())
        store = open_store(GroupAddress("127.0.0.1", 0, 2, timeout_s=120), is_host=True)
        proc = mp.get_context("spawn").Process(target=_receiver, args=(store.port, files, repeats), daemon=True)
        proc.start()
        try:
            group = WeightsGroup(GroupAddress("127.0.0.1", store.port, 2, timeout_s=120), 0, store)
            for m, size in zip(manifests, bucket_mib, strict=True):
                label = f"gloo, {size} MiB buckets ({len(m.bucket_sizes)})"
                seconds = _send_median(group, m, state, repeats)
                _transfer_row(rec, table, label, seconds, total, {"bucket_mib": size, "buckets": len(m.bucket_sizes)})
        finally:
            proc.join(timeout=60)
    _transfer_row(rec, table, "memcpy baseline (one process)", _memcpy_median(state, repeats), total, {})


def _send_median(group, manifest, state, repeats: int) -> float:
    from inflight.wire.transfer import send_update

    return statistics.median(send_update(group, manifest, state).seconds for _ in range(repeats))


def _memcpy_median(state, repeats: int) -> float:
    import torch

    src = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
    dst = torch.empty_like(src)
    copies = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - start)
    return statistics.median(copies)


def _transfer_row(rec: Recorder, table: Table, label: str, seconds: float, total: int, extra: dict) -> None:
    gbs = total / seconds / 1e9
    rec.row(table, label, [f"{seconds:.3f}", f"{gbs:.2f}"], {"median_s": seconds, "gb_s": gbs, "bytes": total, **extra})


# --- engines: commit stall and generation -----------------------------------------------------------------------------


def commit_table(dtype: str) -> Table:
    note = (
        "never-stop stalls generation for the commit only; keep-pause for receive + commit (today's in-place path); "
        "each engine's first update is a warm-up, not counted (its commit is in the JSON as first_commit_s). "
        "extra RSS = the engine worker's peak resident memory during an update minus before it (polled every 10 ms)."
    )
    columns = (
        "model",
        "params",
        "path",
        "commit mean ms",
        "max ms",
        "prepare s",
        "keep-pause ms",
        "extra RSS MiB",
        "n",
    )
    return Table("commit", f"Commit stall ({dtype} engine)", columns, note)


def ratio_table() -> Table:
    return Table("commit-ratio", "Commit stall: prepared swap vs in-place, same run",
                 ("model", "swap / in-place", "swap ms", "in-place ms"))  # fmt: skip


def generation_table(args) -> Table:
    title = (f"Generation under updates, SmolLM2 {args.precision.dtype}, {args.concurrency} in flight: an update "
             f"every {2 * args.half:g} s, {args.cycles} per mode")  # fmt: skip
    note = (
        "tokens lost / update = tokens streamed in the quiet half after the update's half minus those in the update's "
        f"half ({args.half:g} s each), mean over updates, ± its standard error; ratio = update halves' tokens / quiet "
        "halves'. Stall = commit only for never-stop, whole pause for keep-pause; update s = from the push to the "
        "commit."
    )
    columns = ("mode (engine)", "updates", "update s", "mean stall ms", "quiet tokens/s", "ratio",
               "tokens lost / update", "± SE")  # fmt: skip
    return Table("generation", title, columns, note)


@dataclass
class Commits:
    """One engine's commit-stall measurements."""

    stalls: list[float] = field(default_factory=list)
    first_commit_s: float | None = None  # the engine's first update (warm-up: not in `stalls`)
    prepare_s: list[float] = field(default_factory=list)
    pauses: list[float] = field(default_factory=list)  # keep-pause whole stalls (in-place engines only)
    extra_rss: list[int] = field(default_factory=list)


def commit_row(rec: Recorder, table: Table, name: str, params: int, path: str, got: Commits) -> None:
    label = f"{name} ({params / 1e6:.0f}M)"
    if not got.stalls:
        rec.not_measured(table, label, "no update was committed (--commits is 0)")
        return
    mean_ms, max_ms = 1e3 * statistics.mean(got.stalls), 1e3 * max(got.stalls)
    prep = f"{statistics.mean(got.prepare_s):.2f}" if any(got.prepare_s) else "—"
    pause = f"{1e3 * statistics.mean(got.pauses):.0f}" if got.pauses else "—"
    rss = max(got.extra_rss) / MiB if got.extra_rss else 0.0
    cells = [f"{params / 1e6:.0f}M", path, f"{mean_ms:.1f}", f"{max_ms:.1f}", prep, pause, f"{rss:.0f}",
             str(len(got.stalls))]  # fmt: skip
    rec.emit("| " + " | ".join([name, *cells]) + " |")
    rec.record(table, f"{name}/{path}", {"params": params, "path": path, "mean_ms": mean_ms, "max_ms": max_ms,
               "commit_s": got.stalls, "first_commit_s": got.first_commit_s, "prepare_s": got.prepare_s,
               "keep_pause_s": got.pauses,
               "extra_rss_bytes": got.extra_rss})  # fmt: skip


async def bench_commits(engine, sender, states, n: int, keep_pause: bool) -> Commits:
    """A warm-up update, then `n` never-stop updates on an idle engine (and, if asked, `n` keep-pause ones),
    alternating A and B. The warm-up's commit is kept apart (`first_commit_s`): a fresh engine's first update is the
    slow one (a 360M model: commit 8.5 ms and preparation 3.9 s, later ones ~1 ms and ~1.3 s); its memory peak
    counts."""
    got = Commits()
    pid = (await engine.llm.collective_rpc("inflight_worker_pid"))[0]
    for i in range(n + 1 if n else 0):
        with PeakRss(pid) as rss:
            report = await sender.push(engine, states[(i + 1) % 2], engine.version + 1)
        got.extra_rss.append(rss.extra)
        if i == 0:
            got.first_commit_s = report.commit_s
            continue
        got.stalls.append(report.commit_s)
        got.prepare_s.append(report.prepare_s)
    for i in range(n if keep_pause else 0):
        report = await sender.push(engine, states[(i + 1) % 2], engine.version + 1, mode="keep-pause")
        got.pauses.append(report.stall_s)
    return got


class PeakRss:
    """The peak resident memory of process `pid` above its value at entry, polled every 10 ms on a thread."""

    def __init__(self, pid: int):
        self.pid, self.extra, self._stop = pid, 0, False

    def _rss(self) -> int:
        with open(f"/proc/{self.pid}/statm") as f:
            return int(f.read().split()[1]) * 4096

    def __enter__(self):
        import threading

        self.base = self._rss()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop:
            self.extra = max(self.extra, self._rss() - self.base)
            time.sleep(0.01)

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()


def _cast(state: dict, dtype: str) -> dict:
    """Floats in the engine's dtype: the worker refuses an update whose dtypes differ from the ones it computes in."""
    import torch

    want = getattr(torch, dtype)
    return {k: v.to(want).contiguous() if v.is_floating_point() else v for k, v in state.items()}


def _served_state(name: str, dtype: str) -> dict:
    from inflight.models import prepare

    sys.path.insert(0, str(TESTS_DIR))
    from support import load_state

    return _cast(load_state(prepare(name)), dtype)


def _states(model_dir, tmp: Path, dtype: str):
    """The served checkpoint (A) and a perturbed copy (B), the two weights the updates alternate between."""
    sys.path.insert(0, str(TESTS_DIR))
    from support import load_state, perturbed_checkpoint

    return _cast(load_state(model_dir), dtype), _cast(perturbed_checkpoint(model_dir, tmp / "B", seed=3), dtype)


def model_path(name: str) -> Path:
    """A prepared model, or RANDOM_360M: SmolLM2-360M's shape (32 layers, hidden 960, tied head) with random weights,
    built once into the inflight cache (nothing comes from a hub)."""
    from inflight.models import model_dir, prepare

    if name != RANDOM_360M:
        return prepare(name)
    out = model_dir("smollm2").parent / RANDOM_360M
    if not (out / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

        base = prepare("smollm2")
        config = LlamaConfig.from_pretrained(base)
        config.update(dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                           num_key_value_heads=5, tie_word_embeddings=True))  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
        tmp.rename(out)
    return out


RANDOM_360M = "random-360m"


@contextlib.asynccontextmanager
async def running_engine(name: str, args, tmp: Path, update_memory: str):
    """(engine, sender, states, model dir) for `name`, the sender's group joined; the engine is shut down after."""
    sys.path.insert(0, str(TESTS_DIR))
    from support import Sender

    from inflight.serve.app import standalone_engine_config
    from inflight.serve.config import ServeConfig
    from vllm_patches.engine import InflightEngine

    model_dir = model_path(name)
    states = _states(model_dir, tmp, args.precision.dtype)
    flags = ServeConfig(max_model_len=512, dtype=args.precision.dtype, head_dtype="model",
                        kv_cache_gib=args.kv_cache_gib, update_memory=update_memory)  # fmt: skip
    cfg = standalone_engine_config(flags, model_dir)
    engine = await InflightEngine.start(cfg)
    try:
        sender = Sender(timeout_s=120, bucket_bytes=args.update_bucket_mib << 20)
        await sender.connect(engine)
        yield engine, sender, states, model_dir
    finally:
        engine.shutdown()


async def model_benches(rec: Recorder, name: str, args, update_memory: str, gen_rows: list | None) -> Commits:
    """The commit-stall row of `name` on an engine with `update_memory` and, when `gen_rows` is a list, the generation
    measurements of that engine appended to it (one engine start for both)."""
    table, got = commit_table(args.precision.dtype), Commits()
    with tempfile.TemporaryDirectory() as tmp, rec.guard(table, f"{name} {update_memory}"):
        async with running_engine(name, args, Path(tmp), update_memory) as (engine, sender, states, model_dir):
            params = sum(t.numel() for t in states[0].values())
            got = await bench_commits(engine, sender, states, args.commits, keep_pause=update_memory == "low")
            commit_row(rec, table, name, params, update_memory, got)
            if gen_rows is not None:
                gen_rows += await measure_generation(engine, sender, states, model_dir, args, update_memory)
    return got


async def _warm_up(engine, prompts, concurrency: int) -> None:
    """One short batch first, so the measurements do not pay the engine's first-batch costs."""
    from vllm import SamplingParams

    warm = SamplingParams(max_tokens=4)
    await asyncio.gather(
        *(engine.generation.generate(prompts[i % len(prompts)], warm, f"warm-{i}") for i in range(concurrency))
    )


@contextlib.asynccontextmanager
async def _workload(engine, prompts, concurrency: int, tag: str):
    """Keep `concurrency` requests in flight until the block ends (then they are aborted). Each ignores EOS and has a
    length drawn from 24-104 tokens by a seeded generator: the work is the same whichever weights are live, and the
    requests finish at scattered times, so no step prefills a whole batch at once."""
    import random

    from vllm import SamplingParams

    lengths, counter = random.Random(0), 0

    async def worker(w: int):
        nonlocal counter
        while True:
            counter += 1
            params = SamplingParams(max_tokens=lengths.randint(24, 104), temperature=1.0, ignore_eos=True)
            await engine.generation.generate(prompts[counter % len(prompts)], params, f"{tag}-w{w}-{counter}")

    workers = [asyncio.ensure_future(worker(w)) for w in range(concurrency)]
    try:
        yield
    finally:
        for task in workers:
            task.cancel()
        results = await asyncio.gather(*workers, return_exceptions=True)
        errors = [r for r in results if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError)]
        if errors:
            raise errors[0]


@dataclass
class GenerationRun:
    """One mode's paired cycles: tokens streamed in each update's half and in the quiet half after it."""

    label: str
    half_s: float
    update_tokens: list[int] = field(default_factory=list)
    quiet_tokens: list[int] = field(default_factory=list)
    reports: list = field(default_factory=list)


async def measure_generation(engine, sender, states, model_dir, args, update_memory: str) -> list[GenerationRun]:
    """Never-stop on this engine, and keep-pause too on the in-place engine (today's keep-pause): `args.cycles`
    paired cycles each, one continuous workload per mode, after `SETTLE_S` for the requests' ends to scatter."""
    prompts = _prompts(model_dir)
    await _warm_up(engine, prompts, args.concurrency)
    runs = []
    for mode in ("never-stop", *(("keep-pause",) if update_memory == "low" else ())):
        run = GenerationRun(f"{mode} ({update_memory})", args.half)
        async with _workload(engine, prompts, args.concurrency, mode):
            await asyncio.sleep(SETTLE_S)
            for _ in range(args.cycles):
                await _cycle(engine, sender, states, run, mode)
        runs.append(run)
    return runs


SETTLE_S = 4.0


async def _cycle(engine, sender, states, run: GenerationRun, mode: str) -> None:
    """One update at the start of a 2 x half cycle; the tokens of both halves."""
    start, tokens = time.monotonic(), engine.tokens_generated
    run.reports.append(await sender.push(engine, states[engine.version % 2], engine.version + 1, mode=mode))
    await asyncio.sleep(max(0.0, start + run.half_s - time.monotonic()))
    middle = engine.tokens_generated
    await asyncio.sleep(max(0.0, start + 2 * run.half_s - time.monotonic()))
    run.update_tokens.append(middle - tokens)
    run.quiet_tokens.append(engine.tokens_generated - middle)


def emit_generation(rec: Recorder, table: Table, runs: list[GenerationRun]) -> None:
    rec.open(table)
    lost = {}
    for run in runs:
        lost[run.label] = _generation_row(rec, table, run)
    swap, in_place = lost.get("never-stop (double)"), lost.get("never-stop (low)")
    if swap is not None and in_place:
        rec.emit()
        rec.emit(f"Tokens lost per update, prepared swap / in-place commit (never-stop): {swap / in_place:.2f} "
                 f"({swap:.0f} vs {in_place:.0f})")  # fmt: skip
        rec.record(table, "lost-ratio", {"prepared_over_in_place": swap / in_place, "prepared": swap,
                                         "in_place": in_place})  # fmt: skip


def _generation_row(rec: Recorder, table: Table, run: GenerationRun) -> float | None:
    """One mode's row; returns its mean tokens lost per update (None when not measured)."""
    slow = [r.total_s for r in run.reports if r.total_s > run.half_s]
    if not run.reports or sum(run.quiet_tokens) == 0:
        rec.not_measured(table, run.label, "no update or no token in the quiet halves (engine too slow here?)")
        return None
    if slow:
        why = f"{len(slow)} update(s) outlasted their half ({max(slow):.1f} s > {run.half_s:g} s): raise --half"
        rec.not_measured(table, run.label, why)
        return None
    lost = [q - u for q, u in zip(run.quiet_tokens, run.update_tokens, strict=True)]
    mean = statistics.mean(lost)
    se = statistics.stdev(lost) / len(lost) ** 0.5 if len(lost) > 1 else float("nan")
    quiet_tok_s = sum(run.quiet_tokens) / (run.half_s * len(lost))
    ratio = sum(run.update_tokens) / sum(run.quiet_tokens)
    stall_ms = 1e3 * statistics.mean(r.stall_s for r in run.reports)
    update_s = statistics.mean(r.total_s for r in run.reports)
    cells = [str(len(lost)), f"{update_s:.2f}", f"{stall_ms:.1f}", f"{quiet_tok_s:.1f}", f"{ratio:.3f}",
             f"{mean:.0f}", f"{se:.0f}"]  # fmt: skip
    rec.row(table, run.label, cells,
            {"updates": len(lost), "update_s": update_s, "mean_stall_ms": stall_ms, "quiet_tok_s": quiet_tok_s,
             "ratio": ratio, "tokens_lost_per_update": mean, "tokens_lost_se": se, "lost": lost,
             "update_tokens": run.update_tokens, "quiet_tokens": run.quiet_tokens,
             "stall_s": [r.stall_s for r in run.reports], "prepare_s": [r.prepare_s for r in run.reports]})  # fmt: skip
    return mean


def _prompts(model_dir, n: int = 32) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [[{"role": "user", "content": f"What is {i % 9 + 1} + {i * 7 % 9 + 1}? Reply with only the number."}]
            for i in range(n)]  # fmt: skip
    return [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
            for m in msgs]  # fmt: skip


# --- driver ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weight_swap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=16, help="updates per generation mode; 0 = no generation")
    half_help = "seconds per half cycle (the update's half, then the quiet one); an update must land within it"
    parser.add_argument("--half", type=float, default=3.5, help=half_help)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--commits", type=int, default=5, help="updates per model for the commit-stall figure")
    models_help = f"models for the commit-stall table; {RANDOM_360M} is built on first use (~1.4 GB, a minute)"
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2", RANDOM_360M], help=models_help)
    parser.add_argument("--buckets-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    from inflight.learn.config import PublishKnobs  # the learner's --bucket-mb, declared once

    update_help = "bucket size of the commit and generation tables' updates, MiB; default: a learner's --bucket-mb"
    parser.add_argument("--update-bucket-mib", type=int, default=PublishKnobs.bucket_mb, help=update_help)
    dtype_help = "engine precision; auto = bf16 only where this machine computes it natively"
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help=dtype_help)
    kv_help = "KV cache per engine, GiB; 0.25 holds 16 x 512 tokens and is zeroed faster at start than vLLM's 1"
    parser.add_argument("--kv-cache-gib", type=float, default=0.25, help=kv_help)
    out_help = "markdown file the tables are appended to; one JSON line per figure goes to the same name .jsonl"
    parser.add_argument("--out", type=Path, default=RESULTS / "weight_swap.md", help=out_help)
    args = parser.parse_args(argv)
    if args.cycles < 0 or args.half <= 0 or args.concurrency < 1:
        given = f"--cycles {args.cycles}, --half {args.half}, --concurrency {args.concurrency}"
        parser.error(f"{given}: all must be positive, e.g. --cycles 16 --half 3.5 --concurrency 16")
    return args


def header(rec: Recorder, args, argv: list[str]) -> None:
    import torch
    import vllm

    command = shlex.join(["python", "-m", "benchmarks.weight_swap", *argv])
    rec.emit()
    rec.emit(f"## Weight swap, {rec.context['date']}")
    rec.emit()
    rec.emit(f"- CPU: {rec.context['cpu']}")
    rec.emit(f"- Command: `{command}`")
    rec.emit(f"- Engine precision: {args.precision.dtype} ({args.precision.reason})")
    rec.emit(f"- Updates of the commit and generation tables sent in {args.update_bucket_mib} MiB buckets")
    rec.emit(f"- vllm {vllm.__version__}, torch {torch.__version__}; sender and engine share the machine's cores")


def run(args, argv: list[str]) -> Recorder:
    from inflight.machine import cpu_label, resolve_precision, serve_device

    args.precision = resolve_precision(args.dtype, serve_device())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    context = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_label(),
               "dtype": args.precision.dtype}  # fmt: skip
    rec = Recorder(args.out, args.out.with_suffix(".jsonl"), context)
    header(rec, args, argv)
    rec.open(transfer_table(args.precision.dtype))
    with rec.guard(transfer_table(args.precision.dtype), "transfer"):
        bench_transfer(rec, _served_state("smollm2", args.precision.dtype), args.buckets_mib, args.precision.dtype)
    rec.open(commit_table(args.precision.dtype))
    stalls, gen_rows = {}, []
    for name in args.models:
        for update_memory in ("double", "low"):
            rows = gen_rows if name == "smollm2" and args.cycles > 0 else None
            got = asyncio.run(model_benches(rec, name, args, update_memory, rows))
            stalls[name, update_memory] = got.stalls
            # Collected now, while modules are intact: left to interpreter teardown, AsyncLLM.__del__ shuts the
            # engine down again on half-torn-down globals and prints a TypeError traceback.
            gc.collect()
    emit_ratios(rec, stalls)
    if gen_rows:
        emit_generation(rec, generation_table(args), gen_rows)
    return rec


def emit_ratios(rec: Recorder, stalls: dict) -> None:
    """Swap / in-place per model, then the swap's flatness across model sizes (largest / smallest mean stall)."""
    table = ratio_table()
    rec.open(table)
    swaps = {}
    for name in dict.fromkeys(n for n, _ in stalls):
        swap, inplace = stalls.get((name, "double")), stalls.get((name, "low"))
        if not swap or not inplace:
            rec.not_measured(table, name, "a path has no commit (see the commit-stall rows)")
            continue
        swaps[name] = statistics.mean(swap)
        ratio = swaps[name] / statistics.mean(inplace)
        rec.row(table, name, [f"{ratio:.3f}", f"{1e3 * swaps[name]:.1f}", f"{1e3 * statistics.mean(inplace):.1f}"],
                {"ratio": ratio, "swap_s": swaps[name], "in_place_s": statistics.mean(inplace)})  # fmt: skip
    if len(swaps) > 1:
        flat = max(swaps.values()) / min(swaps.values())
        rec.emit()
        rec.emit(f"Prepared swap, largest / smallest mean commit stall across {len(swaps)} models: {flat:.2f}")
        rec.record(table, "flatness", {"largest_over_smallest": flat})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.monotonic()
    rec = run(args, argv)
    print(f"\nweight_swap: {time.monotonic() - started:.0f} s; tables appended to {rec.out}, figures to {rec.jsonl}")
    if rec.not_measured_count:
        print(f"weight_swap: {rec.not_measured_count} figure(s) not measured (see the 'not measured' rows)")
    if rec.failures:
        print(f"weight_swap: FAILED — {len(rec.failures)} section(s) raised:", *rec.failures, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
