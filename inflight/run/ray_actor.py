"""`ProcessHost`: the Ray actor that runs one side of `inflight.run --launcher ray` — today's entry point
(`python -m inflight.serve` / `inflight.learn`) as its child process, on whichever node Ray placed it.

Runs in a Ray worker process (one per actor); the driver (inflight/run/ray_launcher.py) wraps the class with
`ray.remote` and calls its methods. The child is a `inflight.run.launch.Side`: its output goes line by line to
`<run_dir>/<name>.log` (appended: a restarted serve continues the same log), and it gets SIGTERM when this actor's
process goes, however it goes (prctl PDEATHSIG), so a killed actor leaves no serve behind; the engine processes
under a serve follow it by their own parent watch (vllm_patches/plugin.py).

What "Ray restarts a serve" means: a serve actor is created with `restart_on_exit` and Ray's `max_restarts`. When its
child exits without being asked to (killed with -9, crashed), the actor writes why into the log and ends its own
process; Ray then restarts the actor in the same placement-group bundle, which re-runs `__init__` and so starts a new
serve with the same command line. A node lost is the same path, Ray's side only. The learner's actor is created
without either: its exit is reported to the driver (`poll`), which ends the job.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from inflight.run.launch import Side, free_ports


class ProcessHost:
    """One side's child process on this actor's node."""

    def __init__(
        self,
        name: str,
        log_path: str,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
        cores: list[int] | None = None,
        restart_on_exit: bool = False,
    ):
        self.name, self.log_path, self.restart_on_exit = name, Path(log_path), restart_on_exit
        self.side: Side | None = None
        self.stopping = False
        self.started = time.time()
        if argv is not None:
            self.launch(argv, env or {}, cores)

    def node(self) -> dict:
        """Where this actor runs: the node's routable address, Ray's node id, this actor's pid and start time."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "started": self.started,
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_ports(self, n: int, host: str) -> list[int]:
        """`n` ports free on this node's `host` now (closed again: the side binds them right after)."""
        return free_ports(n, host)

    def launch(self, argv: list[str], env: dict[str, str], cores: list[int] | None) -> int:
        """Start the child: `argv` after this node's interpreter, this worker's environment with `env` over it (and
        the GPUs Ray gave this actor as CUDA_VISIBLE_DEVICES); its pid."""
        import ray

        full = dict(os.environ) | env
        gpus = ray.get_gpu_ids()
        if (refused := normal_priority()) is not None:
            with self.log_path.open("a") as log:
                log.write(f"# [ray] {self.name}: {refused}\n")
        # the GPUs Ray assigned here (none: a CPU side), not the driver's numbering; the driver's when it gave them
        if "CUDA_VISIBLE_DEVICES" not in env:
            full["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        self.side = Side(self.name, [sys.executable, *argv], full, cores, self.log_path, "none", die_with_parent=True)
        if self.restart_on_exit:
            threading.Thread(target=self._watch, name=f"{self.name}-watch", daemon=True).start()
        return self.side.proc.pid

    def _watch(self) -> None:
        """A serve's child that exits unasked ends this actor, so that Ray restarts it (module docstring)."""
        assert self.side is not None
        code = self.side.proc.wait()
        if self.stopping:
            return
        self.side.reader.join(5)
        with self.log_path.open("a") as log:
            log.write(f"# [ray] {self.name} exited with code {_reason(code)}: ending its actor so Ray restarts it\n")
        os._exit(1)

    def poll(self) -> dict:
        """The child's state: exit code (None while it runs), whether it printed its ready line, its pid, last lines."""
        if self.side is None:
            return {"code": None, "ready": False, "pid": None, "tail": ""}
        return {
            "code": self.side.proc.poll(),
            "ready": self.side.ready.is_set(),
            "pid": self.side.proc.pid,
            "tail": self.side.last_lines(),
        }

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the child, wait up to `timeout_s`, then SIGKILL (`Side.stop`); its exit code."""
        self.stopping = True
        return self.side.stop(timeout_s) if self.side is not None else None


def _reason(code: int | None) -> str:
    """An exit code as a person reads it: `-9 (SIGKILL)`."""
    if code is not None and code < 0:
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)


def normal_priority() -> str | None:
    """Back to the normal scheduling class at nice 0 for this actor's thread, and so for the side it starts (a child
    inherits both); None when done, else why not and the fix. Why: Ray runs its workers at nice 15
    (`RAY_worker_niceness`, so its own daemons come first), and a serve at nice 15 yields its core to any nice-0 thread
    that wakes there (the driver, kernel threads) at once, not for a fair share: measured on this 2-core machine, the
    commit stall 6.7 vs 3.6 ms locally and 13% fewer tokens/s (benchmarks/launchers.py); a local Ray the run starts
    runs its own processes in the idle class (inflight/run/ray_launcher.py:ray_system_cores), which a side must leave.
    Raising a priority or leaving the idle class needs CAP_SYS_NICE or RLIMIT_NICE (root in most containers has it)."""
    if os.sched_getscheduler(0) == os.SCHED_IDLE:
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except PermissionError:
            return "runs in the idle scheduling class and may not leave it: start Ray's nodes in the normal class"
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= 0:
        return None
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        return (
            f"runs at nice {nice}, as Ray starts its workers, and may not raise its priority: start Ray's nodes with "
            "RAY_worker_niceness=0 in their environment (`RAY_worker_niceness=0 ray start ...`)"
        )
    return None
