"""Child processes of `inflight.run`: their command lines and environments on split pools, their logs, and a clean stop.

Each side runs in its own session (so a terminal's Ctrl-C reaches only the launcher, which forwards it in order: the
learner first, so it checkpoints and exports while the serve still answers, then the serve). Its stdout and stderr go
line by line into `<run_dir>/<side>.log` and, filtered by `--echo`, to the launcher's stderr with a `[side]` prefix.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from inflight.run.config import FORWARDED, RunConfig, parse_cores, parse_gpus
from inflight.run.config_file import table_argv
from inflight.wire.contract import SharedKnobs

# Lines worth a terminal when --echo progress: our own loggers, the serve's progress line, readiness and trouble.
_PROGRESS_MARKS = ("inflight.", "[serve ", "Traceback", "Error", "ERROR", "CRITICAL")

# nanobind's report of Triton objects alive at interpreter exit (torch and vLLM import Triton; ~30 lines per process
# that ran a kernel), printed after the traceback of a side that fails: never the reason, so never its last lines.
_EXIT_NOISE = ("nanobind: ", " - leaked ", " - ... skipped remainder", "See https://nanobind.readthedocs.io")


# --dtype of the run -> the learner's --autocast: fp32 master weights always, the decoder in the run's precision.
LEARN_AUTOCAST = {"auto": "auto", "float32": "none", "bfloat16": "bfloat16"}


# free_ports draws from here up to the kernel's ephemeral range: above the common services and Ray's worker ports
# (10002-19999 by default), which its raylet hands out without asking whether they are free
LOWEST_FREE_PORT = 20_000


def free_ports(n: int, host: str) -> list[int]:
    """`n` distinct ports free on `host` now (closed again: the side binds them seconds later). Drawn at random below
    the kernel's ephemeral range, not with bind(port 0): that range is where every bind(0) and every outgoing
    connection takes its port, so a port handed out there and released is soon taken again (a learner found its store
    port so, bound by another run's process while it loaded its model). A range too narrow to draw from: bind(0)."""
    low = ephemeral_range_low()
    pool = range(LOWEST_FREE_PORT, low) if low - LOWEST_FREE_PORT >= 1000 else None
    rng = random.Random()  # its own generator: a seeded global one would draw the same ports in every run
    socks: list[socket.socket] = []
    try:
        for _ in range(100 * n):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, rng.choice(pool) if pool is not None else 0))
                socks.append(s)
            except OSError:  # in use (or in TIME_WAIT): draw another
                s.close()
        if len(socks) < n:
            raise OSError(f"found {len(socks)} of {n} free ports on {host} in {pool}: free some, or set --port-base")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ephemeral_range_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range); 0 where it is
    not known, so that free_ports falls back to bind(0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def side_commands(
    cfg: RunConfig, run_dir: Path, ports: tuple[int, int, int], tables: dict[str, dict] | None = None
) -> dict[str, list[str]]:
    """The argv of each side (without the interpreter): the knobs the run sets, then the side's table of a run file
    (inflight/run/config_file.py), then the verbatim `--serve-args` / `--learn-args`; argparse keeps the last of a
    repeated flag, so each later part overrides an earlier one."""
    tables = tables or {}
    return {
        "serve": [
            "-m",
            "inflight.serve",
            *_argv(serve_flags(cfg, run_dir, ports)),
            *table_argv(tables.get("serve", {})),
            *shlex.split(cfg.serve_args),
        ],
        "learn": [
            "-m",
            "inflight.learn",
            *_argv(learn_flags(cfg, run_dir, ports)),
            *table_argv(tables.get("learn", {})),
            *shlex.split(cfg.learn_args),
        ],
    }


def shared_flags(cfg: RunConfig) -> dict[str, object]:
    """What both sides are given alike (inflight/wire/contract.py:SharedKnobs), the same value to each."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(SharedKnobs)}


def forwarded_flags(cfg: RunConfig, side: str) -> dict[str, object]:
    """The shared knobs and the side's knobs the run holds under their own names (inflight/run/config.py:FORWARDED)."""
    return shared_flags(cfg) | {name: getattr(cfg, name) for name in FORWARDED[side]}


def serve_flags(cfg: RunConfig, run_dir: Path, ports: tuple[int, int, int]) -> dict[str, object]:
    """The serve's knobs the run sets (ServeConfig field -> value): forwarded, then derived (RUN_DERIVES["serve"])."""
    rollouts, control, _ = ports
    return forwarded_flags(cfg, "serve") | {
        "dtype": cfg.dtype,
        "task_seed": cfg.seed,
        "seed": cfg.seed,
        "rollouts": f"tcp://{cfg.host}:{rollouts}",
        "control": f"tcp://{cfg.host}:{control}",
        "metrics": run_dir / "serve-metrics.jsonl",
    }


def learn_flags(cfg: RunConfig, run_dir: Path, ports: tuple[int, int, int]) -> dict[str, object]:
    """The learner's knobs the run sets (LearnConfig field -> value): forwarded, then derived (RUN_DERIVES["learn"])."""
    rollouts, control, weights = ports
    flags = forwarded_flags(cfg, "learn") | {
        "rollouts_port": rollouts,
        "control_port": control,
        "weights_port": weights,
        "seed": cfg.seed,
        "run_dir": run_dir,
        "autocast": LEARN_AUTOCAST[cfg.dtype],
    }
    if parse_gpus(cfg.learn_gpus):
        flags["backend"] = "nccl"
    return flags


def _argv(flags: dict[str, object]) -> list[str]:
    """`{"max_lag": 4}` -> `["--max-lag", "4"]`; a float as its repr (every digit reaches the side)."""
    out = []
    for name, value in flags.items():
        out += [f"--{name.replace('_', '-')}", repr(value) if isinstance(value, float) else str(value)]
    return out


def learn_launcher(cfg: RunConfig, master_port: int) -> list[str]:
    """The interpreter prefix of the learner: plain python for one rank, torchrun for several."""
    gpus = parse_gpus(cfg.learn_gpus)
    ranks = len(gpus) if gpus else cfg.learn_procs
    if ranks == 1:
        return [sys.executable]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1", "--master-port", str(master_port)]


def side_cores(cfg: RunConfig, side: str) -> list[int] | None:
    """The cores one side is pinned to: `--serve-cores` / `--learn-cores` when given; else core 0 (serve) / core 1
    (learner) on CPU — the 2-core split the demo runs — and None (not pinned) for a side on GPUs, whose host threads
    (data loading, the staging thread, NCCL's proxies) would otherwise all share one core."""
    spec = cfg.serve_cores if side == "serve" else cfg.learn_cores
    if spec:
        return parse_cores(spec)
    if parse_gpus(cfg.serve_gpus if side == "serve" else cfg.learn_gpus):
        return None
    return [0] if side == "serve" else [1]


def side_env(cfg: RunConfig, side: str) -> tuple[dict[str, str], list[int] | None]:
    """Environment and CPU affinity of one side: CPU pools by core, GPU pools by CUDA_VISIBLE_DEVICES."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    gpus = parse_gpus(cfg.serve_gpus if side == "serve" else cfg.learn_gpus)
    cores = side_cores(cfg, side)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    ranks = 1 if side == "serve" else len(gpus) or cfg.learn_procs
    pool = cores if cores is not None else sorted(os.sched_getaffinity(0))
    env["OMP_NUM_THREADS"] = str(max(1, len(pool) // ranks))  # torchrun would set 1 per rank
    if side == "serve" and cores is not None:
        # vLLM's CPU worker pins its OpenMP threads itself; give it exactly the serve's pool.
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    return env, cores


def _die_with_parent() -> None:
    """In a forked child: the kernel sends SIGTERM when the parent thread exits (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def ready_line(name: str) -> str:
    """What a side prints once it is ready: its entry point's line (`inflight.serve ready`), the same for every serve
    of a Ray run (`serve`, `serve-1`, ...) and every learner rank (`learn`, `learn-1`, ...)."""
    return f"inflight.{name.partition('-')[0]} ready"


def worth_quoting(line: str) -> bool:
    """Whether a side's output line may be among the last lines a failure quotes (the log keeps every line): not
    blank (progress bars redraw with '\r', read here as blank lines) and not Triton's exit-time leak report."""
    return bool(line.strip()) and not line.startswith(_EXIT_NOISE)


class Side:
    """One running child: its process, its log and the last lines it printed."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        cores: list[int] | None,
        log_path: Path,
        echo: str,
        die_with_parent: bool = False,
    ):
        self.name, self.argv, self.echo = name, argv, echo
        self.log = log_path.open("a", buffering=1)
        self.log.write(f"# {shlex.join(argv)}\n")
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.ready = threading.Event()
        self.lock = threading.Lock()

        def pin() -> None:
            if die_with_parent:  # a Ray actor's child: SIGTERM when the actor goes (inflight/run/ray_actor.py)
                _die_with_parent()
            if cores is not None:
                os.sched_setaffinity(0, cores)

        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
            preexec_fn=pin,
        )
        self.reader = threading.Thread(target=self._read, name=f"{name}-output", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            line = line.rstrip("\n")
            if worth_quoting(line):
                with self.lock:
                    self.tail.append(line)
            if ready_line(self.name) in line:
                self.ready.set()
            if self.echo == "all" or (self.echo == "progress" and any(m in line for m in _PROGRESS_MARKS)):
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def last_lines(self, n: int = 20) -> str:
        with self.lock:
            return "\n".join(list(self.tail)[-n:])

    def signal(self, sig: int, group: bool = True) -> None:
        """`sig` to the side's process, or to its whole process group (everything it started)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a group with no process left
            if group:
                os.killpg(self.proc.pid, sig)
            elif self.proc.poll() is None:
                os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float) -> int:
        """SIGTERM to the side's own process, wait up to `timeout_s`, then SIGKILL to its whole group; the exit code
        (negative = killed by that signal). The side stops its children itself, in order: a serve signalled as a
        group had its vLLM worker exit in the middle of an engine step, which vLLM reports as the EngineCore's fatal
        error. Whatever of the group outlives the side's exit is killed."""
        self.signal(signal.SIGTERM, group=False)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            print(f"[run] {self.name} did not exit {timeout_s:.0f}s after SIGTERM; killing it", file=sys.stderr)
        self.signal(signal.SIGKILL)
        self.proc.wait()
        self.reader.join(5)
        self.log.close()
        return self.proc.returncode

    def wait_ready(self, timeout_s: float, other: Side | None = None) -> None:
        """Block until the child printed its ready line; RuntimeError if it (or `other`) exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            for side in (self, other):
                if side is not None and side.proc.poll() is not None:
                    raise RuntimeError(
                        f"{side.name} exited with code {side.proc.returncode} before {self.name} was "
                        f"ready; its last lines:\n{side.last_lines()}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name} was not ready after {timeout_s:.0f}s (--start-timeout-s); its last "
                    f"lines:\n{self.last_lines()}"
                )
