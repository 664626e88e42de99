"""Heap-trim policy: commit stall and RSS drift of never-stop updates, side by side in one run.

    python -m benchmarks.trim_policy [--minutes 3] [--warmup-minutes 1] [--policies never,0,30]

Each policy is one `scripts/soak.py` run (tiny Llama, the learner publishes after every step) with
`INFLIGHT_TRIM_EVERY_S` set for both sides: `never` (no trim), `0` (after every commit / publish), `30` (at most every
30 s, the default). Printed per policy: the engine's commit stall after the warm-up (median, p90, p99, from the serve's
update records) with its ratio to `never`, and the soak's RSS change for both sides. Short runs only compare stalls;
RSS drift needs the 30-minute soak (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks import RESULTS
from inflight.run.report import committed_updates, load_run

SOAK = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


def stalls_ms(run_dir: Path, warmup_s: float) -> list[float]:
    updates = committed_updates(load_run(run_dir)["serve"])
    if not updates:
        return []
    t0 = updates[0].time
    return sorted(1e3 * u.commit_s for u in updates if u.time - t0 >= warmup_s)


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trim_policy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--warmup-minutes", type=float, default=1.0)
    parser.add_argument("--policies", default="never,0,30", help="comma-separated INFLIGHT_TRIM_EVERY_S values")
    parser.add_argument("--run-dir", default="runs/trim-policy")
    parser.add_argument("--out", default=str(RESULTS / "trim_policy.md"))
    args = parser.parse_args(argv)
    rows = []
    for policy in args.policies.split(","):
        run_dir = Path(args.run_dir) / policy
        if run_dir.exists():
            raise SystemExit(f"{run_dir} exists: remove it or pass another --run-dir")
        env = {**os.environ, "INFLIGHT_TRIM_EVERY_S": policy}
        soak = subprocess.run([sys.executable, str(SOAK), "--minutes", str(args.minutes), "--warmup-minutes",
                               str(args.warmup_minutes), "--run-dir", str(run_dir)],
                              env=env, capture_output=True, text=True)  # fmt: skip
        change = dict(re.findall(r"^\| (\w+_rss) \| \d+ \| \d+ \| ([+-][\d.]+%)", soak.stdout, re.M))
        stalls = stalls_ms(run_dir, 60 * args.warmup_minutes)
        if soak.returncode not in (0, 1) or not stalls:  # 1 = the soak's verdict, still a measurement
            print(soak.stdout[-2000:], soak.stderr[-2000:], sep="\n", file=sys.stderr)
            raise SystemExit(f"policy {policy}: the run failed (exit {soak.returncode})")
        rows.append((policy, stalls, change))
        print(f"policy {policy}: {len(stalls)} commits, median {quantile(stalls, 0.5):.1f} ms", flush=True)
    base = next((quantile(s, 0.5) for p, s, _ in rows if p == "never"), None)
    lines = [f"Commit stall (ms) after a {args.warmup_minutes:g}-min warm-up, {args.minutes:g}-min runs, tiny Llama, "
             "an update every learner step.", "",
             "| INFLIGHT_TRIM_EVERY_S | commits | median | p90 | p99 | median / never | learner RSS | serve RSS |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for policy, stalls, change in rows:
        ratio = f"{quantile(stalls, 0.5) / base:.2f}" if base else "-"
        lines.append(f"| {policy} | {len(stalls)} | {quantile(stalls, 0.5):.1f} | {quantile(stalls, 0.9):.1f} | "
                     f"{quantile(stalls, 0.99):.1f} | {ratio} | {change.get('learn_rss', '?')} | "
                     f"{change.get('serve_rss', '?')} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
