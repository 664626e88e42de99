"""`python -m inflight.run` with a 2-rank learner (torchrun + gloo, FSDP2) publishing to a TP=2 serve (issue 41), on
tiny-moe: it trains, every version reaches the serve, and each serve worker staged only its slices of every update.
The learner's rank 0 holds no copy of the model while publishing, nor for late serves: its peak extra memory is two
buckets — each at least the largest tensor, which a bucket holds whole — and one block of another rank's rows
(learner/export.py:iter_full_pieces); on tiny-moe, whose two 24-MiB embeddings are 98% of it, that is still 1.2x the
update, on a real model (Llama-3.1-70B: a 2.1-GB embedding of 141 GB) ~3%.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

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
    peaks = [s["publish_peak_bytes"] for s in steps]
    if None in peaks:
        pytest.skip("this kernel does not let a process reset its resident high-water mark (/proc/self/clear_refs)")
    # two buckets of the largest tensor, a 16-MiB block, and 32 MiB for the allocator and gloo (seen: 9-13 MiB); a
    # copy of the model (49 MiB) kept for late serves, as before, took the first publish to 2.3x the update
    bound = 2 * largest_tensor_bytes("tiny-moe", steps[0]["publish_bytes"]) + (16 << 20) + (32 << 20)
    assert all(peak <= bound for peak in peaks), (peaks, bound)


def largest_tensor_bytes(model: str, update_bytes: int) -> int:
    """The largest tensor of `model`, in the update's bytes per element."""
    from safetensors import safe_open

    from inflight.models import resolve_model

    model_dir = Path(resolve_model(model))
    with safe_open(str(next(model_dir.glob("*.safetensors"))), "pt") as f:
        sizes = [math.prod(f.get_slice(name).get_shape()) for name in f.keys()]  # noqa: SIM118 (no iteration protocol)
    return max(sizes) * update_bytes // sum(sizes)
