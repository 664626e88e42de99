"""`make demo`: the main job on the embedded default — SmolLM2 learning arithmetic with in-flight weight updates —
once never-stop and once blocking (conventional synchronous RL), the same task, seed and time budget, then one table.

    python -m inflight.run.demo [--duration-s 420] [--out runs/demo] [--modes never-stop,blocking] [-- RUN FLAGS]

Each mode is a full `python -m inflight.run` in `<out>/<mode>/` (logs, metrics, checkpoints, plots); the combined
table goes to `<out>/summary.md`. Flags after `--` go to every run (e.g. `-- --lr 3e-5 --max-tokens 32`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from inflight.run.app import main as run_main
from inflight.run.report import summarize, write_report
from inflight.serve.config import MODES

# What the demo trains with on two CPU cores, chosen to learn visibly in a few minutes on both kinds of CPU: 2 groups
# of 8 per step and a 24-token completion budget keep a step short (an fp32 step on an AVX2-only core: ~20 s), and
# lr 3e-5 moves the reward within a dozen steps (0.19 -> 0.6 in 7 steps on an AMD EPYC, fp32). Precision is the run's
# `--dtype auto` on both sides: bf16 where the CPU computes it natively (AMX/avx512_bf16: the learner's decoder under
# bf16 autocast is ~3x faster than fp32), fp32 elsewhere (on an AVX2-only CPU bf16 is ~50x slower: a bf16 learner made
# 0 steps in the budget). The serve always samples in the learner's compute precision: a bf16 learner next to an fp32
# serve drifts apart from it (updates below bf16 resolution move one side only: lag-0 mismatch 0.015 -> 0.5).
DEMO_FLAGS = ["--lr", "3e-5", "--max-tokens", "24", "--groups-per-step", "2"]


def split_run_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(own flags, flags after `--` that go to every `inflight.run`)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def run_modes(
    modes: list[str], duration_s: float, out: Path, extra: list[str], reuse: bool = False, tag: str = "demo"
) -> tuple[dict[str, int], list[dict]]:
    """One `inflight.run` per mode in `<out>/<mode>` with the demo flags + `extra`; (exit codes, summaries).

    `reuse`: a mode whose directory already holds a finished run with the same flags is reported, not re-run.
    """
    codes, summaries = {}, []
    for mode in modes:
        run_dir = out / mode
        flags = ["--mode", mode, "--duration-s", str(duration_s), *DEMO_FLAGS, *extra]
        stamp = run_dir / "ablate-flags.json"
        if reuse and stamp.exists() and json.loads(stamp.read_text()) == flags and (run_dir / "summary.json").exists():
            print(f"[{tag}] {mode}: reusing the finished run in {run_dir}", file=sys.stderr, flush=True)
            codes[mode] = 0
            summaries.append(write_report(run_dir))
            continue
        if run_dir.exists():  # a re-run starts fresh; a finished old run is kept aside, never deleted
            if (run_dir / "summary.json").exists():
                kept = run_dir.with_name(f"{mode}.old-{time.strftime('%Y%m%d-%H%M%S')}")
                run_dir.rename(kept)
                print(f"[{tag}] {mode}: the previous run (other flags) is kept in {kept}", file=sys.stderr)
            else:
                shutil.rmtree(run_dir)
        started = time.monotonic()
        print(f"[{tag}] {mode}: {duration_s:.0f}s of training in {run_dir}", file=sys.stderr, flush=True)
        codes[mode] = run_main(["--run-dir", str(run_dir), *flags, "--plots", "false"])
        print(f"[{tag}] {mode}: exit {codes[mode]} after {time.monotonic() - started:.0f}s", file=sys.stderr)
        if (run_dir / "metrics.jsonl").exists():
            summaries.append(write_report(run_dir))
            if codes[mode] == 0:
                stamp.write_text(json.dumps(flags) + "\n")
        if codes[mode] == 130:  # Ctrl-C / SIGTERM stops the whole series, not just this mode
            break
    return codes, summaries


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_run_flags(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m inflight.run.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=420.0, help="training budget per mode (default 420)")
    parser.add_argument("--out", default="runs/demo", help="parent of the per-mode run directories")
    parser.add_argument("--modes", default="never-stop,blocking", help="comma-separated modes, run in this order")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes is {args.modes!r}: expected a comma-separated subset of {', '.join(MODES)}")

    out = Path(args.out)
    codes, summaries = run_modes(modes, args.duration_s, out, extra)
    table = summarize(summaries) if summaries else "(no run produced metrics)"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(table + "\n")
    print("\n" + table + "\n", flush=True)
    print(f"plots: {', '.join(str(out / m / '{reward,lag,throughput}.png') for m in modes)}", flush=True)
    return max(codes.values(), default=1)


if __name__ == "__main__":
    sys.exit(main())
