"""Real `python -m inflight.serve` / `inflight.learn` subprocesses for tests, with their logs captured line by line; and
the two stand-ins the in-process episode tests share (a recording engine wrapper, a stream that keeps the records)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from inflight.wire.rollouts import decode_rollout

TESTS = Path(__file__).parent
# Test engines get a 256 MiB KV cache (vLLM zeroes it at start; on this VM first-touch page faults make 1 GiB cost
# ~14 s of every engine start). Plenty for the tests' few short sequences, even SmolLM2 in float32 (5.8k tokens).
TEST_KV_GIB = 0.25


# Tests pin fp32 on both sides: `auto` would pick bf16 on a CPU with AMX and fp32 on one without, and a test's
# numerical assertions must mean the same on every machine. A test's own flags come after these, and win.
SERVE_DEFAULTS = ["--progress-s", "1", "--kv-cache-gib", str(TEST_KV_GIB), "--dtype", "float32"]
MODULE_DEFAULTS = {"inflight.serve": SERVE_DEFAULTS, "inflight.learn": ["--autocast", "none"],
                   "inflight.run": ["--dtype", "float32"]}  # fmt: skip


PROGRESS_LINE = re.compile(r"\] v-?\d+ \| [\d.]+ tok/s \| inflight \d+ \|")  # inflight/serve/progress.py's line


class ServeProcess:
    """`python -m inflight.serve` (or another `module`) with its output captured line by line."""

    def __init__(self, args: list[str], env: dict | None = None, module: str = "inflight.serve",
                 prefix: tuple[str, ...] = ()):  # fmt: skip
        full_env = {**os.environ, "PYTHONPATH": f"{TESTS / 'inflight'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", module, *MODULE_DEFAULTS.get(module, []), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**full_env, **(env or {})},
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def in_netns(cls, ns: str, args: list[str], module: str, env: dict | None = None) -> ServeProcess:
        """The same, inside network namespace `ns` (`ip netns exec` replaces itself with the interpreter)."""
        return cls(args, env=env, module=module, prefix=("ip", "netns", "exec", ns))

    def _read(self) -> None:
        echo = os.environ.get("INFLIGHT_TEST_ECHO") == "1"  # debugging a slow or stuck test: `pytest -s` shows all
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if echo:
                print(f"{time.strftime('%H:%M:%S')} [{self.proc.pid}] {line.rstrip()}", file=sys.stderr, flush=True)

    def wait_for(self, text: str, timeout_s: float = 180.0, count: int = 1) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(text in line for line in self.lines) < count:
            if self.proc.poll() is not None:
                time.sleep(0.5)
                raise AssertionError(f"serve exited with {self.proc.returncode} before {text!r}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"serve did not print {text!r} within {timeout_s}s:\n{self.tail()}")
            time.sleep(0.1)

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    def tail(self, n: int = 40) -> str:
        """The last `n` lines, the periodic progress lines ("... tok/s | ...") kept only among the last 5: a serve
        stuck for minutes prints nothing else, and the error that stuck it came before them."""
        recent = len(self.lines) - 5
        kept = [line for i, line in enumerate(self.lines) if i >= recent or not PROGRESS_LINE.search(line)]
        return "\n".join(kept[-n:])

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def rss_bytes(self) -> int:
        import psutil

        main = psutil.Process(self.proc.pid)
        return sum(p.memory_info().rss for p in [main, *main.children(recursive=True)])


class Outbox:
    """The rollout stream's surface the driver uses (episode tests); records are decoded and kept, never sent."""

    def __init__(self):
        self.outbox, self.retained_records, self.sent, self.resent, self.records = [], 0, 0, 0, []

    def offer(self, record: bytes, group_id: str) -> None:
        self.records.append(decode_rollout(record))


class Recording:
    """The real engine, with every request it generated kept: (request id, prompt ids, Completion)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @property
    def generation(self):
        """What the driver hands its episodes: this recorder, in front of the engine's own generation."""
        return self

    async def generate(self, prompt_ids, params, request_id):
        done = await self.engine.generation.generate(prompt_ids, params, request_id)
        self.calls.append((request_id, list(prompt_ids), done))
        return done
