"""`python -m inflight.run`: the main job — a serve and a learner as separate processes on split pools, one run dir.

    python -m inflight.run --duration-s 600                       # SmolLM2 + arithmetic, never-stop, 10 minutes
    python -m inflight.run --mode blocking --steps 20 --run-dir runs/blocking
    python -m inflight.run --learn-gpus 0,1 --serve-gpus 2 ...    # GPU pools: torchrun + NCCL for the learner
    python -m inflight.run --config run.toml --steps 50           # a run file (inflight/run/config_file.py)

The run directory collects `run-config.json` and `config.toml` (the resolved run, which `--config` reads again), the
resolved config of each side (`learn-config.json`,
`serve-config.json`), both logs (`learn.log`, `serve.log`), both metrics streams (`metrics.jsonl` from the learner,
`serve-metrics.jsonl` from the serve), `checkpoints/`, `hf-final/`, and at the end `summary.json`, `summary.md` and the
plots (`reward.png`, `lag.png`, `throughput.png`).

Exit code: 0 when the learner finished (its step or time budget) and both sides exited cleanly; 130 after Ctrl-C
(both sides are still stopped in order and the summary is written); otherwise non-zero, with the failing side's last
log lines on stderr.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from pathlib import Path

from inflight.config import parse_dataclass, write_resolved
from inflight.run.config import RunConfig
from inflight.run.config_file import SIDE_CONFIGS, parse_run_args, write_run_toml
from inflight.run.launch import Side, free_ports, learn_launcher, side_commands, side_env
from inflight.run.report import summarize, write_report


def _check_side_args(argv: list[str], side: str, run_dir: Path) -> None:
    """Parse a side's argv with that side's own parser before anything starts: a typo fails here, not in a child."""
    flags = argv[2:]  # drop "-m inflight.<side>"
    cfg = parse_dataclass(
        SIDE_CONFIGS[side], flags, f"--{side}-args", f"flags passed to inflight.{side}", one_line_errors=True
    )
    if side == "serve":
        write_resolved(cfg, run_dir / "serve-config.json")


def plan(argv: list[str] | None) -> tuple[RunConfig, dict[str, dict], Path, dict[str, list[str]]]:
    """The command line (and `--config` file) as the run's config, its side tables, its run directory (created) and
    each side's argv, every side's flags checked by that side's own parser: a typo fails here, before anything
    starts."""
    about = __doc__.split("\n\n")[0].split(": ", 1)[1]
    cfg, tables = parse_run_args(argv, "python -m inflight.run", about)
    run_dir = Path(cfg.resolved_run_dir())
    run_dir.mkdir(parents=True, exist_ok=True)
    ports = tuple(range(cfg.port_base, cfg.port_base + 3)) if cfg.port_base else tuple(free_ports(3, cfg.host))
    commands = side_commands(cfg, run_dir, ports, tables)  # type: ignore[arg-type]
    for side, args in commands.items():
        _check_side_args(args, side, run_dir)
    return cfg, tables, run_dir, commands


def main(argv: list[str] | None = None) -> int:
    cfg, tables, run_dir, commands = plan(argv)
    write_resolved(cfg, run_dir / "run-config.json")
    write_run_toml(cfg, tables, run_dir)
    print(f"[run] run directory {run_dir}", file=sys.stderr, flush=True)
    interrupted: list[int] = []

    def on_signal(sig, _frame):
        interrupted.append(sig)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if cfg.launcher == "ray":  # Ray is imported there, and only there (inflight/run/ray_launcher.py)
            from inflight.run.ray_launcher import main as run_on_ray

            code = run_on_ray(cfg, tables, run_dir, interrupted)
        else:
            code = _local(cfg, run_dir, commands, interrupted)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    # a run that trained no step still gets its summary: it says why, from the serve's counts
    if cfg.plots and any((run_dir / name).exists() for name in ("metrics.jsonl", "serve-metrics.jsonl")):
        try:
            summary = write_report(run_dir)
            print(summarize([summary]), file=sys.stderr)
        except Exception as exc:  # a report must never hide the run's own outcome
            print(f"[run] could not write the report: {exc!r}", file=sys.stderr)
    print(f"[run] {run_dir}: exit {code}", file=sys.stderr, flush=True)
    return code


def _local(cfg: RunConfig, run_dir: Path, commands: dict[str, list[str]], interrupted: list[int]) -> int:
    """The sides as child processes of this one (inflight/run/launch.py), stopped in order whatever happens."""
    launchers = {"learn": learn_launcher(cfg, free_ports(1, "127.0.0.1")[0]), "serve": [sys.executable]}
    for side in ("learn", "serve"):
        (run_dir / f"{side}.cmd").write_text(shlex.join([*launchers[side], *commands[side]]) + "\n")
    sides: dict[str, Side] = {}
    code = 0
    try:
        code = _run(cfg, run_dir, commands, launchers, sides, interrupted)
    finally:
        # The learner first: it finishes its step, checkpoints and exports; then the serve, which still has the
        # learner's last update to commit if one is in flight.
        for name in ("learn", "serve"):
            if name in sides:
                rc = sides[name].stop(cfg.stop_timeout_s)
                if rc not in (0, -signal.SIGTERM, 128 + signal.SIGTERM) and code == 0 and not interrupted:
                    print(
                        f"[run] {name} exited with code {rc} while stopping; its last lines:\n"
                        f"{sides[name].last_lines()}",
                        file=sys.stderr,
                    )
                    code = 1
    return code


def _run(cfg: RunConfig, run_dir: Path, commands, launchers, sides: dict[str, Side], interrupted: list[int]) -> int:
    def start(name: str) -> Side:
        env, cores = side_env(cfg, name)
        side = Side(name, [*launchers[name], *commands[name]], env, cores, run_dir / f"{name}.log", cfg.echo)
        sides[name] = side
        return side

    learn = start("learn")  # it binds; the serve connects
    try:
        learn.wait_ready(cfg.start_timeout_s)
        serve = start("serve")
        serve.wait_ready(cfg.start_timeout_s, other=learn)
    except RuntimeError as exc:
        if interrupted:
            return 130
        print(f"[run] {exc}", file=sys.stderr)
        return 1
    started = time.monotonic()
    with (run_dir / "events.jsonl").open("a") as f:
        f.write(json.dumps({"event": "ready", "time": time.time()}) + "\n")
    while True:
        if interrupted:
            print(
                f"[run] {signal.Signals(interrupted[0]).name}: stopping the learner, then the serve",
                file=sys.stderr,
                flush=True,
            )
            return 130
        if learn.proc.poll() is not None:
            if learn.proc.returncode == 0:
                return 0
            print(
                f"[run] learn exited with code {learn.proc.returncode}; its last lines:\n{learn.last_lines()}",
                file=sys.stderr,
            )
            return 1
        if serve.proc.poll() is not None:
            print(
                f"[run] serve exited with code {serve.proc.returncode}; its last lines:\n{serve.last_lines()}",
                file=sys.stderr,
            )
            return 1
        if cfg.duration_s and time.monotonic() - started > cfg.duration_s:
            print(
                f"[run] {cfg.duration_s:.0f}s budget spent: stopping the learner, then the serve",
                file=sys.stderr,
                flush=True,
            )
            rc = learn.stop(cfg.stop_timeout_s)
            if rc != 0:
                print(
                    f"[run] learn exited with code {rc} at the end of the budget; its last lines:\n"
                    f"{learn.last_lines()}",
                    file=sys.stderr,
                )
                return 1
            return 0
        time.sleep(0.2)
