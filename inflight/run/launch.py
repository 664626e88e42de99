"""Child processes of `inflight.run`: their command lines and environments on split pools, their logs, and a clean stop.

Each side runs in its own session (so a terminal's Ctrl-C reaches only the launcher, which forwards it in order: the
learner first, so it checkpoints and exports while the serve still answers, then the serve). Its stdout and stderr go
line by line into `<run_dir>/<side>.log` and, filtered by `--echo`, to the launcher's stderr with a `[side]` prefix.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from inflight.run.config import RunConfig, parse_cores, parse_gpus

# Lines worth a terminal when --echo progress: our own loggers, the serve's progress line, readiness and trouble.
_PROGRESS_MARKS = ("inflight.", "[serve ", "Traceback", "Error", "ERROR", "CRITICAL")


# --dtype of the run -> the learner's --autocast: fp32 master weights always, the decoder in the run's precision.
LEARN_AUTOCAST = {"auto": "auto", "float32": "none", "bfloat16": "bfloat16"}


def side_commands(
    cfg: RunConfig, run_dir: Path, ports: tuple[int, int, int], tables: dict[str, dict] | None = None
) -> dict[str, list[str]]:
    """The argv of each side (without the interpreter): the shared knobs, then the side's table of a run file
    (inflight/run/config_file.py), then the verbatim `--serve-args` / `--learn-args`; argparse keeps the last of a
    repeated flag, so each later part overrides an earlier one."""
    from inflight.run.config_file import table_argv

    tables = tables or {}
    rollouts, control, weights = ports
    # the sampler's truncation: the serve samples with it, the learner computes its logprobs under it
    sampling = ["--top-p", repr(cfg.top_p), "--top-k", str(cfg.top_k), "--min-p", repr(cfg.min_p)]
    shared_serve = [
        "--model",
        cfg.model,
        "--task",
        cfg.task,
        "--mode",
        cfg.mode,
        "--group-size",
        str(cfg.group_size),
        "--groups-per-step",
        str(cfg.groups_per_step),
        "--max-tokens",
        str(cfg.max_tokens),
        "--temperature",
        repr(cfg.temperature),
        "--max-lag",
        str(cfg.admit_lag),
        "--task-seed",
        str(cfg.seed),
        "--seed",
        str(cfg.seed),
        "--rollouts",
        f"tcp://{cfg.host}:{rollouts}",
        "--control",
        f"tcp://{cfg.host}:{control}",
        "--metrics",
        str(run_dir / "serve-metrics.jsonl"),
        "--dtype",
        cfg.dtype,
        "--env",
        cfg.env,
        *sampling,
    ]
    if cfg.reward:
        shared_serve += ["--reward", cfg.reward]
    if cfg.http_port:
        shared_serve += ["--http-port", str(cfg.http_port)]
    shared_learn = [
        "--model",
        cfg.model,
        "--host",
        cfg.host,
        "--rollouts-port",
        str(rollouts),
        "--control-port",
        str(control),
        "--weights-port",
        str(weights),
        "--groups-per-step",
        str(cfg.groups_per_step),
        "--steps",
        str(cfg.steps),
        "--max-lag",
        str(cfg.max_lag),
        "--temperature",
        repr(cfg.temperature),
        "--lr",
        repr(cfg.lr),
        "--seed",
        str(cfg.seed),
        "--run-dir",
        str(run_dir),
        "--autocast",
        LEARN_AUTOCAST[cfg.dtype],
        "--group-size",
        str(cfg.group_size),
        "--report-to",
        cfg.report_to,
        *sampling,
    ]
    if parse_gpus(cfg.learn_gpus):
        shared_learn += ["--backend", "nccl"]
    return {
        "serve": [
            "-m",
            "inflight.serve",
            *shared_serve,
            *table_argv(tables.get("serve", {})),
            *shlex.split(cfg.serve_args),
        ],
        "learn": [
            "-m",
            "inflight.learn",
            *shared_learn,
            *table_argv(tables.get("learn", {})),
            *shlex.split(cfg.learn_args),
        ],
    }


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


class Side:
    """One running child: its process, its log and the last lines it printed."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], cores: list[int] | None, log_path: Path, echo: str
    ):
        self.name, self.argv, self.echo = name, argv, echo
        self.log = log_path.open("a", buffering=1)
        self.log.write(f"# {shlex.join(argv)}\n")
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.ready = threading.Event()
        self.lock = threading.Lock()

        def pin() -> None:
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
            if line.strip():  # progress bars redraw with '\r', read here as blank lines: not worth quoting
                with self.lock:
                    self.tail.append(line)
            if f"inflight.{self.name} ready" in line:
                self.ready.set()
            if self.echo == "all" or (self.echo == "progress" and any(m in line for m in _PROGRESS_MARKS)):
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def last_lines(self, n: int = 20) -> str:
        with self.lock:
            return "\n".join(list(self.tail)[-n:])

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL; the exit code (negative = killed by that signal)."""
        self.signal(signal.SIGTERM)
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
