"""The built-in `math` reward (`--reward math`): math-verify checks the completion's final answer against the reference.

math-verify (the checker TRL's accuracy reward uses; `pip install 'inflight[envs]'`, checked when `--reward math` is
loaded) parses both sides to SymPy, LaTeX or plain: `\\frac{1}{2}` equals `0.5`, `\\boxed{42}` equals `42`, `1,000`
equals `1000`. The completion's `\\boxed{}` answer is preferred; without one, its last mathematical expression counts.
A reference without `\\boxed{}` is read as if boxed. 1.0 when they agree, else 0.0; nothing parseable is 0.0.

Why a child process: math-verify bounds its parse and compare with `signal.alarm`, which works only on a main thread
(the serve scores in worker threads), and an alarm cannot interrupt C code such as SymPy's big-integer power
(`\\boxed{9^{9^{9^9}}}`). So the check runs in the main thread of one child, `python -m inflight.tasks.math_reward`,
fed msgspec-JSON lines on stdin; a child silent for HARD_LIMIT_S is killed (the reward raises: that sample scores 0.0
and is counted, inflight/tasks/rewards.py) and the next call starts a new one. The child ends when its stdin closes.
"""

from __future__ import annotations

import atexit
import os
import select
import subprocess
import sys
import threading

import msgspec

from inflight.tasks.base import Problem

CHECK_TIMEOUT_S = 3  # math-verify's own alarm per parse and per comparison, inside the child
HARD_LIMIT_S = 30.0  # a child silent this long on a check is stuck where no alarm reaches: killed
START_LIMIT_S = 120.0  # a new child's imports and warm-up check (seconds on a loaded CPU)


class MathCheck(msgspec.Struct):
    """One request to the child: the reference answer and the completion text."""

    reference: str
    completion: str


class MathVerdict(msgspec.Struct):
    """The child's answer: whether they agree, or why it could not tell (`error` non-empty)."""

    correct: bool = False
    error: str = ""


def math_equal(reference: str, completion: str) -> bool:
    """math-verify's verdict in this thread (a main thread: its alarms need one). Raises if the reference is
    unparseable: a task whose answers math-verify cannot read would otherwise score 0 silently."""
    from math_verify import parse, verify

    boxed = reference if "\\boxed" in reference else f"\\boxed{{{reference}}}"
    gold = parse(boxed, parsing_timeout=CHECK_TIMEOUT_S)
    if not gold:
        raise ValueError(f"reference answer {reference!r}: math-verify cannot parse it; pass --reward for this task")
    answer = parse(completion, parsing_timeout=CHECK_TIMEOUT_S)
    return bool(answer) and verify(gold, answer, timeout_seconds=CHECK_TIMEOUT_S)


class MathVerifier:
    """The parent's handle on the child: `check` one pair at a time (a lock), a new child after a stuck or dead one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._encoder, self._decoder = msgspec.json.Encoder(), msgspec.json.Decoder(MathVerdict)

    def check(self, reference: str, completion: str) -> bool:
        with self._lock:
            child = self._child if self._child and self._child.poll() is None else self._start()
            child.stdin.write(self._encoder.encode(MathCheck(reference, completion)) + b"\n")
            child.stdin.flush()
            verdict = self._read(child, HARD_LIMIT_S)
        if verdict.error:
            raise ValueError(verdict.error)
        return verdict.correct

    def _start(self) -> subprocess.Popen:
        self._child = subprocess.Popen(
            [sys.executable, "-m", "inflight.tasks.math_reward"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._read(self._child, START_LIMIT_S)  # its ready line: later checks are timed without its start
        return self._child

    def _read(self, child: subprocess.Popen, limit_s: float) -> MathVerdict:
        """The child's next line (one request, one line: nothing is left buffered between them); a silent or dead
        child is ended and the check raises."""
        ready, _, _ = select.select([child.stdout], [], [], limit_s)
        line = child.stdout.readline() if ready else b""
        if not line:
            self.close()
            raise TimeoutError(f"math-verify gave no verdict within {limit_s}s (or its child died): scored 0")
        return self._decoder.decode(line)

    def close(self) -> None:
        """End the child (its stdin closed, then killed if it lingers)."""
        child, self._child = self._child, None
        if child is None:
            return
        if child.poll() is None and not _closed(child):
            child.kill()
        child.wait()


def _closed(child: subprocess.Popen) -> bool:
    """Close the child's stdin and give it a moment to leave by itself; whether it did."""
    try:
        child.stdin.close()
        child.wait(timeout=1)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return True


VERIFIER = MathVerifier()
atexit.register(VERIFIER.close)


def reward_fn(completion_text: str, problem: Problem) -> float:
    """1.0 if math-verify finds the completion's answer equal to `problem.answer`, else 0.0: `--reward math`."""
    return 1.0 if VERIFIER.check(str(problem.answer), completion_text) else 0.0


def serve_checks() -> None:
    """The child's loop: one MathVerdict line per MathCheck line until stdin closes."""
    from math_verify.errors import TimeoutException  # a BaseException: `except Exception` would let it end the child

    out = os.fdopen(os.dup(1), "wb")  # verdicts only: anything a library prints goes to stderr
    os.dup2(2, 1)
    decoder, encoder = msgspec.json.Decoder(MathCheck), msgspec.json.Encoder()
    out.write(encoder.encode(MathVerdict(correct=math_equal("1", "1"))) + b"\n")  # imported and warm: ready
    out.flush()
    for line in sys.stdin.buffer:
        try:
            check = decoder.decode(line)
            verdict = MathVerdict(correct=math_equal(check.reference, check.completion))
        except (Exception, TimeoutException) as exc:  # the verdict's error, never the child's end
            verdict = MathVerdict(error=f"{type(exc).__name__}: {exc}")
        out.write(encoder.encode(verdict) + b"\n")
        out.flush()


if __name__ == "__main__":
    serve_checks()
