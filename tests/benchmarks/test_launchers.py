"""benchmarks/launchers.py's loop over its arms (the runs themselves are `inflight.run`'s, tested there)."""

from __future__ import annotations

from benchmarks.launchers import INTERRUPTED, run_arms


def test_the_arms_interleave_repeat_by_repeat_and_an_interrupted_run_ends_the_benchmark_there():
    done = []

    def run(arm: str, repeat: int) -> dict:
        done.append((arm, repeat))
        return {"arm": arm, "repeat": repeat, "code": INTERRUPTED if (arm, repeat) == ("b", 1) else 0}

    rows = run_arms(["a", "b", "c"], 3, run)
    assert done == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1)]  # Ctrl-C in b-1: no c-1, no repeat 2
    assert [r["code"] for r in rows] == [0, 0, 0, 0, INTERRUPTED]
    assert len(run_arms(["a", "b"], 2, lambda arm, i: {"code": 0})) == 4
