"""The demo through both launchers, side by side in one run: `inflight.run --launcher local`, the same beside an idle
local Ray, and `--launcher ray`.

    python -m benchmarks.launchers [--duration-s 180] [--repeats 1] [--out benchmarks/results/launchers] [-- RUN FLAGS]

Each arm runs the demo's never-stop job (inflight/run/demo.py: SmolLM2 + arithmetic, its flags) for the same budget in
`<out>/<arm>-<repeat>/`, one after the other in this process, the arms interleaved repeat by repeat; then one table
(`<out>/LAUNCHERS.md`, also printed): learner steps, committed updates, commit stall mean / p99, generated tokens/s,
the start-up (seconds from calling the launcher to both sides ready, the launcher's `ready` event; under Ray: Ray's own
start, placement and the actors included) and the CPU Ray's own processes used (GCS, raylet, its idle workers and
agents; the actors that host the sides are not counted) over the run, in cores. The budget counts from `ready`, so
steps and stall compare the runs themselves.

The middle arm, `local+ray`, is the local launcher with a local Ray started beside it the way `--launcher ray` starts
one (inflight/run/ray_launcher.py:connect, off the serve's cores) and left idle: it separates what Ray's processes cost
a 2-core machine from what running the sides as Ray actors costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import RESULTS
from inflight.run.app import main as run_main
from inflight.run.demo import DEMO_FLAGS, split_run_flags
from inflight.run.report import ready_time, write_report

ARMS = ("local", "local+ray", "ray")
INTERRUPTED = 130  # inflight.run's exit code after Ctrl-C or SIGTERM (inflight/run/app.py)
_NUMERIC = ("startup_s", "steps", "updates", "stall_mean_s", "stall_p99_s", "gen_tokens_per_s", "ray_cores")
# Ray's own processes by their command line (lower case): the GCS, the raylet, its agents and monitors, pooled workers
RAY_DAEMONS = (
    "gcs_server", "raylet", "dashboard", "log_monitor", "autoscaler", "runtimeenv", "ray::idle", "default_worker",
)  # fmt: skip


def ray_daemon_cpu() -> dict[int, float]:
    """pid -> CPU seconds (user + system) used so far, for the live processes whose command line names a Ray daemon."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").lower()
            if not any(name in cmdline for name in RAY_DAEMONS) or "processhost" in cmdline:
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            used[int(pid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while it was read
    return used


class RayCpu(threading.Thread):
    """The CPU Ray's own processes use while a run goes on, sampled every second (a local Ray the run starts itself is
    stopped before the run returns: a reading at the end alone would miss it). Each process counts from the first
    reading, or from its start if it started later."""

    def __init__(self):
        super().__init__(daemon=True)
        self.first = ray_daemon_cpu()
        self.last = dict(self.first)
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.wait(1.0):
            self.last.update(ray_daemon_cpu())

    def seconds(self) -> float:
        self.done.set()
        self.join()
        self.last.update(ray_daemon_cpu())
        return sum(cpu - self.first.get(pid, 0.0) for pid, cpu in self.last.items())


def start_idle_ray(flags: list[str]):
    """A local Ray started as `--launcher ray` starts one (its processes off the serve's cores), then left idle."""
    import ray

    from inflight.run.config_file import parse_run_args
    from inflight.run.ray_launcher import connect

    cfg, _ = parse_run_args(flags, "python -m benchmarks.launchers", "")
    before = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = "local"  # a Ray of its own, as the ray arm's driver starts one
    try:
        print(f"[bench] {connect(ray, cfg)}", file=sys.stderr, flush=True)
    finally:
        del os.environ["RAY_ADDRESS"]
        if before is not None:
            os.environ["RAY_ADDRESS"] = before
    return ray


def run_one(arm: str, repeat: int, duration_s: float, out: Path, extra: list[str]) -> dict:
    run_dir = out / f"{arm}-{repeat}"
    launcher = "ray" if arm == "ray" else "local"
    flags = ["--run-dir", str(run_dir), "--launcher", launcher, "--mode", "never-stop", "--duration-s", str(duration_s)]
    flags += [*DEMO_FLAGS, *extra, "--plots", "false"]
    ray = start_idle_ray(flags) if arm == "local+ray" else None
    ray_cpu, started = RayCpu(), time.time()
    try:
        code = run_main(flags)
    finally:
        wall, ray_cpu = time.time() - started, ray_cpu.seconds()
        if ray is not None:
            ray.shutdown()
    ready = ready_time(run_dir)
    summary = write_report(run_dir) if (run_dir / "metrics.jsonl").exists() else {}
    row = {"arm": arm, "repeat": repeat, "code": code, "startup_s": (ready - started) if ready else float("nan")}
    return row | {"ray_cores": ray_cpu / wall} | summary


def _cells(r: dict) -> list[str]:
    nan = float("nan")
    return [
        f"{r['startup_s']:.1f}",
        f"{r.get('steps', 0)}",
        f"{r.get('updates', 0)}",
        f"{1e3 * r.get('stall_mean_s', nan):.1f} / {1e3 * r.get('stall_p99_s', nan):.1f}",
        f"{r.get('gen_tokens_per_s', nan):.1f}",
        f"{r['ray_cores']:.2f}",
    ]


def table(rows: list[dict]) -> str:
    """One line per run, then one per arm with the mean over its repeats (and the stall's spread: min-max of means)."""
    head = "| arm | run | exit | start-up s | steps | updates | stall ms (mean/p99) | gen tok/s | Ray's CPU (cores) |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['arm']} | {r['repeat']} | {r['code']} | " + " | ".join(_cells(r)) + " |" for r in rows]
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if len(mine) > 1:
            stalls = [1e3 * r.get("stall_mean_s", float("nan")) for r in mine]
            mean = {k: statistics.fmean(r.get(k, float("nan")) for r in mine) for k in _NUMERIC}
            cells = _cells(mean | {"arm": arm})
            cells[3] = (
                f"{statistics.fmean(stalls):.1f} ({min(stalls):.1f}-{max(stalls):.1f}) / {cells[3].split('/ ')[1]}"
            )
            lines.append(f"| **{arm}** | mean of {len(mine)} | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_arms(arms: list[str], repeats: int, run: Callable[[str, int], dict]) -> list[dict]:
    """Every arm `repeats` times, interleaved; a run ended by Ctrl-C or SIGTERM (`inflight.run` stops it and exits
    130) ends the benchmark there, with the table of the runs done, instead of going on to the next arm."""
    rows: list[dict] = []
    for repeat in range(repeats):
        for arm in arms:
            rows.append(run(arm, repeat))
            if rows[-1]["code"] == INTERRUPTED:
                print(f"[bench] {arm}-{repeat} was interrupted: stopping the benchmark", file=sys.stderr, flush=True)
                return rows
    return rows


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_run_flags(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.launchers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=180.0, help="training budget per run (default 180)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per arm, the arms interleaved (default 1)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"which arms, comma-separated (default {ARMS})")
    parser.add_argument("--out", default=str(RESULTS / "launchers"), help="parent of the run directories")
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    if unknown := sorted(set(arms) - set(ARMS)):
        parser.error(f"--arms {args.arms!r}: {unknown} is no arm; choose from {', '.join(ARMS)}")
    out = Path(args.out)
    rows = run_arms(arms, args.repeats, lambda arm, i: run_one(arm, i, args.duration_s, out, extra))
    text = table(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "LAUNCHERS.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return max(r["code"] for r in rows)


if __name__ == "__main__":
    sys.exit(main())
