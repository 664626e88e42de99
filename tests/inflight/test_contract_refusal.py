"""Real `python -m inflight.learn` and `python -m inflight.serve` processes on tiny-llama: a serve started with another
temperature than the learner is refused naming the field before its engine starts (it asks first:
inflight/serve/control.py:ask_learner), exits, and nothing is trained (inflight/wire/contract.py). Every contract
field's refusal (dtype, group size, temperature) over real sockets, without an engine, is
tests/inflight/test_publisher_contract.py: one real serve proves the path end to end."""

from __future__ import annotations

import json

import pytest
from serve_support import ServeProcess
from test_serve import free_port

pytestmark = pytest.mark.engine

# server id -> (its flags that differ from the learner's, what the refusal must name)
WRONG = {
    "wrong-temperature": (["--group-size", "4", "--temperature", "0.5"],
                          "temperature 0.5, but this learner computes logprobs at temperature 1.0"),
}  # fmt: skip


def test_a_serve_of_another_temperature_is_refused_before_its_engine_starts_naming_it_and_nothing_is_trained(
    model_dirs, tmp_path
):
    """The serve starts against a learner of group size 4, temperature 1.0: it must exit 1 with the learner's
    reason without starting vLLM; the learner logs the refusal once, forms no weights group and makes no step."""
    model, ports = model_dirs["tiny-llama"], [free_port() for _ in range(3)]
    learn = ServeProcess(["--model", str(model), "--group-size", "4", "--groups-per-step", "1", "--run-dir",
                          str(tmp_path), "--rollouts-port", str(ports[0]), "--control-port", str(ports[1]),
                          "--weights-port", str(ports[2]), "--timeout-s", "20"], module="inflight.learn")  # fmt: skip
    serves = {}
    try:
        learn.wait_for("inflight.learn ready", 120)
        for server_id, (flags, _) in WRONG.items():
            serves[server_id] = ServeProcess(["--model", str(model), "--rollouts", f"tcp://127.0.0.1:{ports[0]}",
                                              "--control", f"tcp://127.0.0.1:{ports[1]}", "--groups-per-step", "1",
                                              "--max-tokens", "8", "--server-id", server_id, "--metrics",
                                              str(tmp_path / f"{server_id}.jsonl"), *flags])  # fmt: skip
        for serve in serves.values():
            assert serve.proc.wait(400) == 1, serve.tail()
    finally:
        for serve in serves.values():
            serve.stop()
        learn.stop()
    for server_id, (_, named) in WRONG.items():
        refusals = [line for line in learn.lines if "refused serve" in line and f"serve {server_id} " in line]
        assert len(refusals) == 1 and "before any weights were sent" in refusals[0], learn.tail()
        assert named in refusals[0], refusals[0]
        assert any("the learner refused this serve" in line and named in line for line in serves[server_id].lines)
        assert serves[server_id].count("Initializing a V1 LLM engine") == 0, serves[server_id].tail()
        metrics = tmp_path / f"{server_id}.jsonl"
        events = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        assert all(e["groups_admitted"] == 0 for e in events if e["event"] == "progress")
    assert learn.count("weights group") == 0 and learn.count("step 1") == 0
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip()
