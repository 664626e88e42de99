"""`LogFollower`: the driver of `inflight.run --launcher ray` prints its actors' progress lines from their logs.

Each Ray actor (inflight/run/ray_actor.py) writes its child's whole output to `<run_dir>/<name>.log`; this thread, in
the driver process (inflight/run/ray_run.py), reads what each log gained and prints the lines `--echo` asks for with a
`[name]` prefix, as the local launcher prints its children's (inflight/run/launch.py). The run directory is shared by
the driver and the actors: one machine, or a shared file system across nodes (docs/multi-node.md).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from inflight.run.launch import _PROGRESS_MARKS


class LogFollower:
    """Follows a set of log files (added while it runs) and echoes their new lines."""

    def __init__(self, echo: str, every_s: float = 0.5):
        self.echo, self.every_s = echo, every_s
        self.logs: dict[str, tuple[Path, int]] = {}  # name -> (path, bytes already read)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="log-follower", daemon=True)

    def add(self, name: str, path: Path) -> None:
        with self.lock:
            if name not in self.logs:  # a restarted actor appends to the log it had
                self.logs[name] = (path, path.stat().st_size if path.exists() else 0)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join(5)
        self._read_all()  # the last lines, written while stopping

    def _run(self) -> None:
        while not self.done.wait(self.every_s):
            self._read_all()

    def _read_all(self) -> None:
        with self.lock:
            items = list(self.logs.items())
        for name, (path, offset) in items:
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            cut = data.rfind(b"\n") + 1  # whole lines only; the rest is read next time
            with self.lock:
                self.logs[name] = (path, offset + cut)
            for line in data[:cut].decode(errors="replace").splitlines():
                self._echo(name, line)

    def _echo(self, name: str, line: str) -> None:
        if line.startswith("# "):  # the command line and the actor's own notes: the log keeps them
            return
        if self.echo == "all" or (self.echo == "progress" and any(m in line for m in _PROGRESS_MARKS)):
            print(f"[{name}] {line}", file=sys.stderr, flush=True)
