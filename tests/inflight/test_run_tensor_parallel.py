"""`python -m inflight.run` with a 2-rank learner (torchrun + gloo, FSDP2) publishing to a TP=2 serve (issue 41), on
tiny-moe: it trains, every version reaches the serve, and each serve worker staged only its slices of every update.
(Not asserted, because it does not hold yet: the learner's rank 0 staying below the model's bytes while publishing;
measured here at 1.25x the update after the first publish, whose host snapshot makes it 2.3x.)"""

from __future__ import annotations

import json

import pytest
from serve_support import TEST_KV_GIB, ServeProcess

pytestmark = pytest.mark.engine
STEPS = 3
SERVE_ARGS = (
    f"--progress-s 1 --max-inflight 8 --kv-cache-gib {TEST_KV_GIB} --reward serve_rewards:text_length "
    "--tensor-parallel-size 2"
)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_two_rank_learner_trains_a_tp2_serve_whose_workers_each_stage_only_their_half_of_every_update(tmp_path):
    run_dir = tmp_path / "run"
    launcher = ServeProcess(["--run-dir", str(run_dir), "--steps", str(STEPS), "--model", "tiny-moe",
                             "--group-size", "4", "--groups-per-step", "2", "--max-tokens", "8",
                             "--learn-procs", "2", "--serve-cores", "0-1", "--learn-cores", "0-1",
                             "--serve-args", SERVE_ARGS, "--learn-args", "--bucket-mb 1"],
                            module="inflight.run")  # fmt: skip
    try:
        launcher.proc.wait(900)
    finally:
        launcher.stop()
    assert launcher.proc.returncode == 0, launcher.tail()
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["tokens"] > 0 and s["grad_norm"] > 0 and not s["publish_failed"] for s in steps)
    updates = [e for e in read_jsonl(run_dir / "serve-metrics.jsonl") if e["event"] == "update" and e["ok"]]
    assert [u["version"] for u in updates] == list(range(1, STEPS + 1)), updates
    for step, update in zip(steps, updates, strict=True):
        assert 0 < update["bytes_kept"] < 0.6 * step["publish_bytes"] and not update.get("full_tensors")
