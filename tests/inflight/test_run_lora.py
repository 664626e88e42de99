"""`python -m inflight.run --lora-rank R`: the learner trains LoRA adapters (learner/lora.py) and publishes the adapter
alone; the serve starts from a zero adapter and commits each update in flight into vLLM's adapter slot
(vllm_patches/adapter.py). A real serve and learner on tiny-llama, as tests/inflight/test_run.py runs them."""

from __future__ import annotations

import json

import pytest
from serve_support import ServeProcess
from test_run import FAST, read_jsonl

from vllm_patches.device_plan import checkpoint_weight_bytes

pytestmark = pytest.mark.engine
STEPS = 4


def test_a_lora_run_publishes_the_adapter_alone_and_the_serve_commits_every_version_in_flight(tmp_path, model_dirs):
    run_dir = tmp_path / "run"
    launcher = ServeProcess(
        ["--run-dir", str(run_dir), "--steps", str(STEPS), *FAST, "--lora-rank", "8"], module="inflight.run"
    )
    try:
        launcher.proc.wait(420)
    finally:
        launcher.stop()
    assert launcher.proc.returncode == 0, launcher.tail()
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    model_bytes = checkpoint_weight_bytes(model_dirs["tiny-llama"], "float32")
    # the adapter alone goes out: a fraction of the model's bytes, to the one serve, every step
    assert all(s["publish_serves"] == 1 and 0 < s["publish_bytes"] < 0.2 * model_bytes for s in steps), steps
    assert all(0 < s["trainable_params"] < 0.2 * s["total_params"] for s in steps)
    assert all(s.get("mismatch_lag0", 0.0) < 0.05 for s in steps)  # the serve samples from the learner's policy
    updates = [e for e in read_jsonl(run_dir / "serve-metrics.jsonl") if e["event"] == "update"]
    assert [u["version"] for u in updates if u["ok"]] == list(range(1, STEPS + 1)), updates
    config = json.loads((run_dir / "hf-final" / "adapter_config.json").read_text())
    assert config["r"] == 8 and (run_dir / "hf-final" / "adapter_model.safetensors").exists()
