"""benchmarks/gpu_learner.py's flow without a GPU (`--device cpu`): the CPU reference, the learner process with a
receiver process joined as a serve, and the plain loop, on tiny-llama from a journal of real records.

On a GPU the same code runs with the decoder in bf16 and the figures are the GPU check's (scripts/gpu_check.sh). Here
every run is fp32 on one device, so step 1 must agree to rounding, every version must reach the receiver verified,
the last one must equal the exported weights, and the plain loop must have trained exactly the learner's groups (the
benchmark asserts that itself). Throughput is reported, not asserted: on CPU it says nothing about a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from inflight.learn.config import LearnConfig
from inflight.learn.store import RolloutJournal

sys.path.insert(0, str(Path(__file__).parents[1] / "inflight"))
from test_replay import GROUP, interleaved_records  # noqa: E402  (tests/inflight: the replay tests' records)

STEPS = 3
pytestmark = pytest.mark.engine  # slow (three learner runs); no engine, but the same budget class


def recorded_run(root: Path) -> Path:
    """A run directory as `--keep-journal` leaves it: the journal of 7 whole groups (+ a partial one) of tiny-llama
    records in a shuffled arrival order, and the learn-config.json of the learner that recorded it."""
    run = root / "rec"
    journal = RolloutJournal(run / "journal", keep_segments=True)
    journal.append(interleaved_records(groups=7, seed=1))
    journal.close()
    cfg = LearnConfig(model="tiny-llama", groups_per_step=2, group_size=GROUP, max_lag=64, lr=1e-3, seed=5,
                      autocast="none", run_dir=str(run))  # fmt: skip
    (run / "learn-config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    return run


def test_the_gpu_learner_check_trains_the_same_groups_as_the_plain_loop_and_every_update_reaches_the_receiver(
    tmp_path, model_dirs
):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.gpu_learner", "--device", "cpu", "--replay", str(recorded_run(tmp_path)),
           "--steps", str(STEPS), "--out", str(out), "--bucket-mb", "1"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    summary_path = out / "summary.json"
    assert summary_path.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    print("\n" + "\n".join(line for line in run.stdout.splitlines() if line.startswith(("|", "gpu_learner"))))
    assert summary["steps"] == STEPS
    assert summary["received_versions"] == list(range(1, STEPS + 1)), "every step's update reaches the receiver"
    assert summary["last_equals_export"], summary["received_detail"]
    step1 = summary["step1"]
    assert step1["ok"] and step1["loss_rel_err"] < 1e-6 and step1["grad_norm_rel_err"] < 1e-6, step1
    assert [row["step"] for row in summary["plain"]] == list(range(1, STEPS + 1))
    assert all(row["tokens"] > 0 for row in summary["plain"])
    assert np.isfinite(summary["learner_vs_plain"]) and summary["learner_vs_plain"] > 0
    # the exit code carries the verdict: 0 only when every check, throughput included, passed
    assert run.returncode == (0 if summary["learner_vs_plain"] >= 0.9 else 1), run.stderr[-2000:]
