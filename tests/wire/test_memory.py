"""trim_heap hands freed heap pages back to the OS (what keeps RSS flat over thousands of updates, scripts/soak.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from inflight.wire.memory import trim_heap

PROBE = textwrap.dedent("""
    import ctypes, psutil
    from inflight.wire.memory import trim_heap
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    rss = lambda: psutil.Process().memory_info().rss >> 20
    blocks = [libc.malloc(4096) for _ in range(60_000)]  # ~240 MB of small heap blocks
    for b in blocks:
        ctypes.memset(b, 1, 4096)
    for b in blocks[:-1]:  # the last block pins the top of the heap: free() alone cannot shrink it
        libc.free(b)
    before = rss()
    seconds = trim_heap()
    print(before, rss(), seconds)
""")
# The same, trimmed by a background thread: the call returns at once and the pages are back once the thread is done.
BACKGROUND = PROBE.replace(
    "seconds = trim_heap()",
    textwrap.dedent("""
    import threading, time
    from inflight.wire.memory import trim_heap_in_background
    start = time.perf_counter()
    assert trim_heap_in_background()
    seconds = time.perf_counter() - start
    for t in threading.enumerate():
        if t.name == "inflight-trim-heap":
            t.join()
    """).strip(),
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
@pytest.mark.parametrize("probe", [PROBE, BACKGROUND], ids=["inline", "background"])
def test_trim_returns_freed_heap_pages_that_free_alone_keeps(probe):
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    before, after, seconds = out.stdout.split()
    assert int(before) - int(after) > 150, out.stdout  # MB given back
    assert 0 < float(seconds) < 1.0


def test_trim_is_safe_to_call_repeatedly():
    assert all(trim_heap() >= 0.0 for _ in range(3))


def test_one_background_trim_at_a_time():
    from inflight.wire import memory

    with memory._trimming:  # as if a trim were running
        assert not memory.trim_heap_in_background()
    assert memory.trim_heap_in_background()
    with memory._trimming:  # that one has finished: the lock is free again
        pass
    assert not memory.trim_heap_in_background(min_interval_s=3600)  # too soon after the last one
    with memory._trimming:
        pass
    assert memory.trim_heap_in_background(min_interval_s=0.0)


@pytest.mark.parametrize(("raw", "want"), [("", 30.0), ("0", 0.0), ("12.5", 12.5), ("never", None), ("OFF", None)])
def test_trim_interval_comes_from_the_environment(monkeypatch, raw, want):
    from inflight.wire.memory import trim_every_s

    monkeypatch.setenv("INFLIGHT_TRIM_EVERY_S", raw)
    assert trim_every_s() == want


@pytest.mark.parametrize("raw", ["-1", "soon"])
def test_a_bad_trim_interval_names_the_variable_and_the_fix(monkeypatch, raw):
    from inflight.wire.memory import trim_every_s

    monkeypatch.setenv("INFLIGHT_TRIM_EVERY_S", raw)
    with pytest.raises(ValueError, match=r"INFLIGHT_TRIM_EVERY_S=.*seconds >= 0 .* or 'never'"):
        trim_every_s()


@pytest.mark.parametrize("side", ["inflight.serve", "inflight.learn"])
def test_serve_and_learn_refuse_a_bad_trim_interval_at_start_up(side):
    env = {**os.environ, "INFLIGHT_TRIM_EVERY_S": "soon"}
    out = subprocess.run([sys.executable, "-m", side, "--model", "tiny-llama"], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "INFLIGHT_TRIM_EVERY_S='soon'" in out.stderr
