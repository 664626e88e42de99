"""`python -m inflight.run --model tiny-moe --routing-replay on`: a real serve recording MoE routes and a real learner
replaying them train end to end, and every step's metrics line says how well the routes agreed and what they cost."""

from __future__ import annotations

import json

import pytest
from serve_support import TEST_KV_GIB, ServeProcess

pytestmark = pytest.mark.engine
STEPS = 3
SERVE_ARGS = f"--progress-s 1 --max-inflight 16 --kv-cache-gib {TEST_KV_GIB} --reward serve_rewards:text_length"


def test_run_with_routing_replay_trains_a_tiny_moe_and_reports_agreement_mismatch_and_bytes(tmp_path):
    run_dir = tmp_path / "run"
    launcher = ServeProcess(["--run-dir", str(run_dir), "--steps", str(STEPS), "--model", "tiny-moe",
                             "--routing-replay", "on", "--group-size", "4", "--groups-per-step", "2",
                             "--max-tokens", "8", "--serve-args", SERVE_ARGS], module="inflight.run")  # fmt: skip
    try:
        launcher.proc.wait(400)
    finally:
        launcher.stop()
    assert launcher.proc.returncode == 0, launcher.tail()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["publish_serves"] == 1 and not s["publish_failed"] and s["grad_norm"] > 0 for s in steps)
    # every sample carried its routes: 2 MoE layers × top-2 uint8 ids per position, plus the record's framing
    assert all(4 < s["route_bytes_per_token"] < 6 for s in steps)
    assert all(0.9 <= s["routing_agreement"] <= 1.0 for s in steps)
    lag0 = [s for s in steps if "mismatch_lag0_unreplayed" in s]
    assert lag0, "no step had lag-0 tokens to probe"
    assert all(s["mismatch_lag0"] <= s["mismatch_lag0_unreplayed"] for s in lag0)
    assert json.loads((run_dir / "learn-config.json").read_text())["routing_replay"] == "on"
    assert json.loads((run_dir / "serve-config.json").read_text())["routing_replay"] == "on"
