"""The demo through both launchers, side by side in one run: `inflight.run --launcher local` then `--launcher ray`.

    python -m benchmarks.launchers [--duration-s 180] [--out benchmarks/results/launchers] [-- RUN FLAGS]

Each launcher runs the demo's never-stop job (inflight/run/demo.py: SmolLM2 + arithmetic, its flags) for the same
budget in `<out>/<launcher>/`, one after the other in this process; then one table (`<out>/LAUNCHERS.md`, also
printed): learner steps, committed updates, commit stall mean / p99, generated tokens/s, and the start-up (seconds from
calling the launcher to both sides ready, the launcher's `ready` event; under Ray: Ray's own start, placement and the
actors included). The budget counts from `ready`, so steps and stall compare the runs themselves.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from inflight.run.app import main as run_main
from inflight.run.demo import DEMO_FLAGS, split_run_flags
from inflight.run.report import ready_time, write_report

LAUNCHERS = ("local", "ray")


def run_one(launcher: str, duration_s: float, out: Path, extra: list[str]) -> dict:
    run_dir = out / launcher
    flags = ["--run-dir", str(run_dir), "--launcher", launcher, "--mode", "never-stop", "--duration-s", str(duration_s)]
    started = time.time()
    code = run_main([*flags, *DEMO_FLAGS, *extra, "--plots", "false"])
    ready = ready_time(run_dir)
    summary = write_report(run_dir) if (run_dir / "metrics.jsonl").exists() else {}
    return {"launcher": launcher, "code": code, "startup_s": (ready - started) if ready else float("nan"), **summary}


def table(rows: list[dict]) -> str:
    lines = [
        "| launcher | exit | start-up s | steps | updates | stall ms (mean/p99) | gen tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stall = f"{1e3 * r.get('stall_mean_s', float('nan')):.1f} / {1e3 * r.get('stall_p99_s', float('nan')):.1f}"
        lines.append(
            f"| {r['launcher']} | {r['code']} | {r['startup_s']:.1f} | {r.get('steps', 0)} | {r.get('updates', 0)} | "
            f"{stall} | {r.get('gen_tokens_per_s', float('nan')):.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_run_flags(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.launchers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=180.0, help="training budget per launcher (default 180)")
    parser.add_argument("--out", default="benchmarks/results/launchers", help="parent of the two run directories")
    args = parser.parse_args(argv)
    out = Path(args.out)
    rows = [run_one(launcher, args.duration_s, out, extra) for launcher in LAUNCHERS]
    text = table(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "LAUNCHERS.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return max(r["code"] for r in rows)


if __name__ == "__main__":
    sys.exit(main())
