"""Soak: serve + learn on the tiny model with a weight update every step, for a long time; are both sides flat?

    python scripts/soak.py [--minutes 30] [--warmup-minutes 3] [--run-dir runs/soak] [--every-s 20]

Runs `python -m inflight.run` (never-stop, tiny-llama, publish every step) and samples both process trees every
`--every-s` seconds: RSS, threads and open file descriptors (children included: vLLM's engine core and worker). After
the warm-up, each figure's last sample is compared with its first: the verdict is PASS when RSS stays within 10% and
threads and descriptors do not grow. Samples go to `<run-dir>/soak.jsonl`, the verdict to stdout. Opt-in: not in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from inflight.wire.records import read_steps

REWARDS = Path(__file__).resolve().parents[1] / "tests" / "inflight"  # serve_rewards.text_length


def tree_figures(pid: int) -> dict:
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    out = {"rss": 0, "threads": 0, "fds": 0}
    for p in procs:
        try:
            out["rss"] += p.memory_info().rss
            out["threads"] += p.num_threads()
            out["fds"] += p.num_fds()
        except psutil.NoSuchProcess:
            continue
    return out


def sides(launcher: psutil.Process) -> dict[str, int]:
    found = {}
    for child in launcher.children():
        cmd = " ".join(child.cmdline())
        for side in ("serve", "learn"):
            if f"inflight.{side}" in cmd:
                found[side] = child.pid
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/soak.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-minutes", type=float, default=3.0)
    parser.add_argument("--every-s", type=float, default=20.0)
    parser.add_argument("--run-dir", default="runs/soak")
    parser.add_argument("--checkpoint-every", type=int, default=300, help="learner steps between checkpoints")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    total_s = 60 * (args.minutes + args.warmup_minutes)
    # A reward that varies within a group even for a random model, so every step has gradients and every update
    # changes the weights; a checkpoint every few minutes exercises journal rotation and checkpoint pruning too.
    cmd = [sys.executable, "-m", "inflight.run", "--model", "tiny-llama", "--run-dir", str(run_dir), "--duration-s",
           str(total_s), "--group-size", "4", "--groups-per-step", "2", "--max-tokens", "16", "--echo", "none",
           "--serve-args", "--reward serve_rewards:text_length", "--learn-args",
           f"--publish-every 1 --checkpoint-every {args.checkpoint_every} --keep-checkpoints 2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REWARDS), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen(cmd, env=env)
    # Background jobs start with SIGINT ignored: stop on SIGTERM too, and stop the run with SIGTERM (inflight.run
    # handles both: learner first, then serve).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    samples = sample_until_done(launcher, run_dir, args.every_s)
    return report(samples, args, run_dir, launcher.returncode)


def sample_until_done(launcher: subprocess.Popen, run_dir: Path, every_s: float) -> list[dict]:
    """Both sides' figures every `every_s` seconds until the run ends (or Ctrl-C/SIGTERM stops it), each also
    appended to soak.jsonl."""
    proc = psutil.Process(launcher.pid)
    samples: list[dict] = []
    start = time.monotonic()
    try:
        while launcher.poll() is None:
            time.sleep(every_s)
            pids = sides(proc)
            if set(pids) != {"serve", "learn"}:
                continue
            sample = {"t": time.monotonic() - start, **{f"{side}_{k}": v for side, pid in pids.items()
                                                        for k, v in tree_figures(pid).items()}}  # fmt: skip
            samples.append(sample)
            with (run_dir / "soak.jsonl").open("a") as f:
                f.write(json.dumps(sample) + "\n")
    except KeyboardInterrupt:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait()
    return samples


def report(samples: list[dict], args: argparse.Namespace, run_dir: Path, returncode: int | None) -> int:
    """The start/end table after the warm-up; 0 when nothing grew past its limit and the run exited 0."""
    steady = [s for s in samples if s["t"] >= 60 * args.warmup_minutes]
    if len(steady) < 2:
        print("soak: not enough samples after the warm-up", file=sys.stderr)
        return 1
    # Jitter-proof ends: RSS as the mean of three samples; threads and descriptors leak only if the fewest at the end
    # exceed the most at the start.
    head, tail = steady[:3], steady[-3:]
    ok = True
    print(f"soak: {args.minutes:.0f} min after {args.warmup_minutes:.0f} min warm-up, {len(steady)} samples")
    print("| figure | start | end | change |\n|---|---|---|---|")
    for key in sorted(k for k in steady[0] if k != "t"):
        if key.endswith("rss"):
            first, last = sum(s[key] for s in head) / len(head), sum(s[key] for s in tail) / len(tail)
        else:
            first, last = max(s[key] for s in head), min(s[key] for s in tail)
        change = (last - first) / max(first, 1)
        limit_ok = change <= 0.10 if key.endswith("rss") else last <= first
        ok &= limit_ok
        print(f"| {key} | {first:.0f} | {last:.0f} | {100 * change:+.1f}%{'' if limit_ok else ' FAIL'} |")
    steps = len(read_steps(run_dir / "metrics.jsonl"))
    print(f"learner steps (= weight updates): {steps}; launcher exit {returncode}")
    print("PASS" if ok and returncode == 0 else "FAIL")
    return 0 if ok and returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
