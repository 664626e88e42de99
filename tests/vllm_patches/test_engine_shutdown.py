"""An engine shutdown that vLLM interrupts part-way (vllm_patches/engine.py:finish_interrupted_shutdown): vLLM 0.32's
force kill of a slow EngineCore raises psutil.NoSuchProcess when one of its children has just exited, leaving the rest
alive. The processes here are real (a parent with a child of its own); the AsyncLLM around them is a stand-in."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil

from vllm_patches.engine import InflightEngine, finish_interrupted_shutdown

TREE = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"
)


class Proc:
    """A real process with multiprocessing.Process's is_alive / join / pid."""

    def __init__(self):
        self.popen = subprocess.Popen([sys.executable, "-c", TREE])
        deadline = time.monotonic() + 30
        while not psutil.Process(self.popen.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.pid = self.popen.pid
        self.child = psutil.Process(self.pid).children()[0]

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float) -> None:
        self.popen.wait(timeout)


class Resources:
    """The client's background resources: releasing them is a call, counted."""

    def __init__(self, processes: list | None):
        self.engine_manager = SimpleNamespace(processes=processes) if processes is not None else None
        self.released = 0

    def __call__(self) -> None:
        self.released += 1


class Interrupted:
    """An AsyncLLM whose shutdown raised as vLLM's did, its engine process tree still running."""

    def __init__(self, loop):
        self.proc = Proc()
        self.engine_core = SimpleNamespace(resources=Resources([self.proc]))
        self.output_handler = loop.create_task(asyncio.sleep(3600))

    def shutdown(self) -> None:
        raise psutil.NoSuchProcess(self.proc.child.pid)


def test_a_shutdown_vllm_interrupts_kills_the_rest_of_the_engine_tree_and_releases_the_client():
    loop = asyncio.new_event_loop()
    try:
        llm = Interrupted(loop)
        engine = InflightEngine.__new__(InflightEngine)
        engine.llm, engine.signals = llm, SimpleNamespace(close=lambda: None)
        engine.shutdown()
        assert not llm.proc.is_alive() and llm.engine_core.resources.released == 1
        llm.proc.child.wait(10)  # raises psutil.TimeoutExpired if the child survived
        loop.run_until_complete(asyncio.sleep(0))
        assert llm.output_handler.cancelled()
    finally:
        loop.close()


def test_finishing_a_shutdown_whose_processes_are_already_gone_does_nothing_but_release():
    llm = SimpleNamespace(output_handler=None, engine_core=SimpleNamespace(resources=Resources(None)))
    finish_interrupted_shutdown(llm)
    assert llm.engine_core.resources.released == 1
