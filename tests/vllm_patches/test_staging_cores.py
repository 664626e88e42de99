"""Where a serve worker's background work runs (vllm_patches/cores.py): off the cores the worker computes on, on
the ones its parent (vLLM's EngineCore) may use and the worker does not. Real processes: a child pinned to one core,
as vLLM's CPU worker pins itself, under a parent allowed on more. The benchmark that shows what this buys is
`benchmarks.weight_swap` (generation lost per update, BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least two cores this process may use",
)

CHILD = """
import json, os, sys, threading
from vllm_patches.cores import leave_the_engines_core, on_spare_cores, spare_cores

os.sched_setaffinity(0, {int(sys.argv[1])})  # as vLLM's CPU worker pins its compute thread
seen = {"spare": sorted(spare_cores()), "base_nice": os.getpriority(os.PRIO_PROCESS, 0)}

def background():
    leave_the_engines_core()
    seen["thread"] = sorted(os.sched_getaffinity(0))
    seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

thread = threading.Thread(target=background)
thread.start()
thread.join()
with on_spare_cores():
    seen["inside"] = sorted(os.sched_getaffinity(0))
    started = {}
    child = threading.Thread(target=lambda: started.update(cores=sorted(os.sched_getaffinity(0))))
    child.start()
    child.join()
    seen["started_inside"] = started["cores"]
seen["after"] = sorted(os.sched_getaffinity(0))
seen["main_nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
print(json.dumps(seen))
"""


def run_child(pinned: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(pinned)], capture_output=True, text=True, timeout=120,
                         check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_pinned_workers_background_thread_moves_to_its_parents_other_cores_niced_and_leaves_the_rest_alone():
    cores = sorted(os.sched_getaffinity(0))
    seen = run_child(cores[0])
    others = cores[1:]
    assert seen["spare"] == others
    assert seen["thread"] == others, "the staging thread must leave the core the worker computes on"
    assert seen["nice"] == max(10, seen["base_nice"]), "niced to 10 (a process already nicer stays as it is)"
    assert seen["inside"] == others and seen["started_inside"] == others, "threads started inside keep the spare cores"
    assert seen["after"] == [cores[0]], "the calling thread gets its own cores back"
    assert seen["main_nice"] == seen["base_nice"], "only the background thread is niced"


def test_an_unpinned_worker_has_no_spare_core_and_its_background_thread_stays_where_it_was():
    # A GPU worker is not pinned: its parent's cores are its own, so nothing moves (only the priority is lowered).
    code = (
        "import json, os, threading\n"
        "from vllm_patches.cores import leave_the_engines_core, spare_cores\n"
        "before = sorted(os.sched_getaffinity(0)); leave_the_engines_core()\n"
        "after = sorted(os.sched_getaffinity(0))\n"
        "print(json.dumps({'spare': sorted(spare_cores()), 'before': before, 'after': after}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["spare"] == [] and seen["after"] == seen["before"]
