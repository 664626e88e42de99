"""Faults with real processes: a learner killed with -9 under a live serve, bad rollouts and a serve of another model.

tiny-llama, real vLLM engine, real sockets, real weights group; faults are real signals and real bytes on the wire.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import time

import msgspec
import psutil
import pytest
import zmq
from serve_support import ServeProcess
from test_serve import free_port

from inflight.wire.rollouts import Sampling, Times, encode_rollout, make_rollout

pytestmark = pytest.mark.engine

GROUP, PER_STEP, GROUPS = 4, 2, 20  # 20 groups = 10 learner steps
TIMEOUT_S = 10  # --timeout-s: how long a collective waits on a dead peer (tests/inflight/test_two_hosts.py's too)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def learner_args(model_dir, run_dir, ports, *extra):
    return ["--model", str(model_dir), "--groups-per-step", str(PER_STEP), "--run-dir", str(run_dir),
            "--rollouts-port", str(ports[0]), "--control-port", str(ports[1]), "--weights-port", str(ports[2]),
            "--bucket-mb", "1", "--timeout-s", str(TIMEOUT_S), "--lr", "1e-3", "--group-size", str(GROUP),
            *extra]  # fmt: skip


def test_learner_killed_mid_run_resumes_and_every_group_is_trained_exactly_once(model_dirs, tmp_path):
    model, ports = model_dirs["tiny-llama"], [free_port() for _ in range(3)]
    first = ServeProcess(learner_args(model, tmp_path, ports, "--checkpoint-every", "2"), module="inflight.learn")
    first.wait_for("inflight.learn ready", 120)
    serve = ServeProcess(["--model", str(model), "--rollouts", f"tcp://127.0.0.1:{ports[0]}", "--control",
                          f"tcp://127.0.0.1:{ports[1]}", "--group-size", str(GROUP), "--groups-per-step",
                          str(PER_STEP), "--admit-lag", "1", "--max-tokens", "8", "--max-groups", str(GROUPS),
                          "--metrics", str(tmp_path / "serve.jsonl")])  # fmt: skip
    second = None
    try:
        first.wait_for("step 3 v3", 240)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
        life1 = read_jsonl(tmp_path / "metrics.jsonl")
        assert len(life1) >= 3

        # The serve keeps generating up to its lag limit, then waits with bounded memory.
        time.sleep(8)
        rss = serve.rss_bytes()
        time.sleep(6)
        stalled = [e for e in read_jsonl(tmp_path / "serve.jsonl") if e["event"] == "progress"][-3:]
        assert all(e["inflight"] == 0 for e in stalled), stalled
        assert stalled[-1]["groups_admitted"] == stalled[0]["groups_admitted"] < GROUPS
        assert stalled[-1]["groups_admitted"] - stalled[-1]["groups_consumed"] <= 2 * PER_STEP
        assert serve.rss_bytes() < rss * 1.05

        second = ServeProcess(learner_args(model, tmp_path, ports, "--checkpoint-every", "2", "--resume", "true",
                                           "--steps", str(GROUPS // PER_STEP)), module="inflight.learn")  # fmt: skip
        assert second.proc.wait(300) == 0, second.tail()
        serve.proc.wait(120)
    finally:
        for p in (first, second, serve):
            if p is not None:
                p.stop()
    assert serve.proc.returncode == 0, serve.tail()
    steps = read_jsonl(tmp_path / "metrics.jsonl")
    resumed_from = steps[len(life1)]["step"] - 1  # the checkpoint the second life started from
    assert resumed_from == 2
    lineage = [g for s in life1[:resumed_from] for g in s["groups"]] + [g for s in steps[len(life1):] for g in
                                                                         s["groups"]]  # fmt: skip
    # Every group the serve made is trained exactly once by the model that survives: nothing acknowledged was lost
    # (journal replay + the serve's re-send), nothing was trained twice (checkpointed consumed set).
    assert sorted(lineage) == sorted(set(lineage)) and len(lineage) == GROUPS
    assert {g.rsplit("-g", 1)[1] for g in lineage} == {str(i) for i in range(GROUPS)}
    # Steps and versions go on from the checkpoint: the versions the dead learner published after it are re-used by
    # the weights the surviving model publishes.
    assert [s["step"] for s in steps[len(life1) :]] == list(range(resumed_from + 1, GROUPS // PER_STEP + 1))
    assert [s["version"] for s in steps[len(life1) :]] == [s["step"] for s in steps[len(life1) :]]
    assert "replayed" in second.tail(200) or any("resent" in e and e["resent"] for e in read_jsonl(
        tmp_path / "serve.jsonl"))  # fmt: skip
    assert (tmp_path / "hf-final" / "model.safetensors").exists()


def rollout_bytes(**over) -> bytes:
    fields = dict(prompt_ids=[1, 2, 3], completion_ids=[4, 5], logprobs=[-1.0, -2.0], versions=[0, 0],
                  rollout_id="bad-0", group_id="bad", group_size=1, index=0, server_id="intruder", model="tiny-llama",
                  reward=1.0, finish_reason="length", sampling=Sampling(1.0), times=Times(0.0, 0.0, 0.0))  # fmt: skip
    fields.update(over)
    return encode_rollout(make_rollout(**fields))


def test_bad_rollouts_are_rejected_counted_and_logged_and_the_learner_keeps_training(model_dirs, tmp_path):
    """Garbage, a pickle, an unknown schema, another model's rollout and an oversized message hit the learner's
    real PULL socket between good groups: each is refused, counted by reason in metrics.jsonl, and training goes on."""
    model, ports = model_dirs["tiny-llama"], [free_port() for _ in range(3)]
    learn = ServeProcess(learner_args(model, tmp_path, ports, "--steps", "2", "--wait-for-serves", "0"),
                         module="inflight.learn")  # fmt: skip
    learn.wait_for("inflight.learn ready", 120)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{ports[0]}")
    good = [rollout_bytes(rollout_id=f"g{g}-{i}", group_id=f"g{g}", group_size=GROUP, index=i, reward=float(i % 2))
            for g in range(2 * PER_STEP) for i in range(GROUP)]  # fmt: skip
    bad = [
        b"\x00garbage",
        pickle.dumps({"prompt_ids": [1], "__reduce__": "os.system"}),
        msgspec.msgpack.encode({**msgspec.msgpack.decode(good[0]), "schema": 99}),
        rollout_bytes(model="other-model", rollout_id="other-0", group_id="other"),
        b"\x00" * (65 << 20),
    ]
    try:
        for payload in [*good[:5], *bad, *good[5:]]:
            push.send(payload)
        # Every socket the learner listens on (rollouts, control, the weights store) is bound to loopback only.
        listening = [c.laddr for c in psutil.Process(learn.proc.pid).net_connections("tcp") if c.status == "LISTEN"]
        assert {a.port for a in listening} >= set(ports) and {a.ip for a in listening} == {"127.0.0.1"}, listening
        assert learn.proc.wait(120) == 0, learn.tail()
    finally:
        push.close(linger=0)
        learn.stop()
    assert learn.count("rejected rollout") == 5
    steps = read_jsonl(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2]
    assert sorted(g for s in steps for g in s["groups"]) == [f"g{g}" for g in range(2 * PER_STEP)]
    rejected = steps[-1]["rejected"]
    assert sum(rejected.values()) == 5, rejected
    assert any("other-model" in k for k in rejected)
    assert sum(v for k, v in rejected.items() if k.startswith("wire:")) == 4


def test_a_serve_of_another_model_is_refused_before_any_bucket_naming_the_first_mismatch(model_dirs, tmp_path):
    """tiny-qwen2 (q/k/v biases, untied head) joins a learner of tiny-llama: refused at Hello with the first
    mismatching tensor named, no weights group is formed and nothing is sent; the serve stops with that reason and
    generated nothing."""
    ports = [free_port() for _ in range(3)]
    learn = ServeProcess(learner_args(model_dirs["tiny-llama"], tmp_path, ports), module="inflight.learn")
    serve = None
    try:
        learn.wait_for("inflight.learn ready", 120)
        serve = ServeProcess(["--model", str(model_dirs["tiny-qwen2"]), "--rollouts", f"tcp://127.0.0.1:{ports[0]}",
                              "--control", f"tcp://127.0.0.1:{ports[1]}", "--group-size", str(GROUP),
                              "--max-tokens", "8", "--metrics", str(tmp_path / "serve.jsonl")])  # fmt: skip
        assert serve.proc.wait(180) == 1, serve.tail()
        time.sleep(2)
    finally:
        if serve is not None:
            serve.stop()
        learn.stop()
    refusal = next(line for line in learn.lines if "refused serve" in line)
    assert "before any weights were sent" in refusal and "tensor" in refusal
    assert learn.count("refused serve") == 1  # logged once, however often the serve retried
    assert learn.count("weights group") == 0 and learn.count("step 1") == 0
    assert any("the learner refused this serve" in line and "tensor" in line for line in serve.lines)
    progress = [e for e in read_jsonl(tmp_path / "serve.jsonl") if e["event"] == "progress"]
    assert all(e["groups_admitted"] == 0 for e in progress)


def kill_tree(proc) -> None:
    """kill -9 a serve with its engine processes, as a host dying would."""
    parent = psutil.Process(proc.pid)
    for p in [*parent.children(recursive=True), parent]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait(30)


def stream_id(serve) -> str:
    """The id a serve's records carry: its --server-id plus this start's incarnation."""
    ready = next(line for line in serve.lines if "inflight.serve ready: server " in line)
    return ready.split("inflight.serve ready: server ", 1)[1].split(",")[0]


def serve_args(model_dir, ports, server_id, metrics):
    return ["--model", str(model_dir), "--rollouts", f"tcp://127.0.0.1:{ports[0]}", "--control",
            f"tcp://127.0.0.1:{ports[1]}", "--group-size", str(GROUP), "--groups-per-step", str(PER_STEP),
            "--max-tokens", "8", "--server-id", server_id, "--metrics", str(metrics)]  # fmt: skip


def test_serve_killed_mid_transfer_is_dropped_the_other_keeps_updating_and_a_restart_catches_up(model_dirs, tmp_path):
    model, ports = model_dirs["tiny-llama"], [free_port() for _ in range(3)]
    learn = ServeProcess(learner_args(model, tmp_path, ports, "--wait-for-serves", "2"), module="inflight.learn")
    # Serve A holds the transfer after the first bucket (fault injection), so it can be killed mid-transfer on cue.
    a = ServeProcess(serve_args(model, ports, "serve-a", tmp_path / "a.jsonl"),
                     env={"INFLIGHT_FAULT_RECEIVE_STALL": "0:60"})  # fmt: skip
    b = ServeProcess(serve_args(model, ports, "serve-b", tmp_path / "b.jsonl"))
    a2 = None
    try:
        learn.wait_for("inflight.learn ready", 120)
        a.wait_for("inflight fault injection: stalling the receive", 300)
        killed_at = time.monotonic()
        kill_tree(a.proc)
        learn.wait_for("publishing v1 failed", 60)
        assert time.monotonic() - killed_at < TIMEOUT_S + 15  # within --timeout-s (plus the quiet probe)
        learn.wait_for("step 3 v3", 240)  # training and publishing go on with serve B alone
        # Restarted under the same name, as a supervisor would: a new stream, never mistaken for the dead one.
        a2 = ServeProcess(serve_args(model, ports, "serve-a", tmp_path / "a2.jsonl"))
        a2.wait_for("committed", 240)
        first, second = stream_id(a), stream_id(a2)
        assert first.startswith("serve-a@") and second.startswith("serve-a@") and first != second
        deadline = time.monotonic() + 180
        while not any(g.startswith(second + "-g") for s in read_jsonl(tmp_path / "metrics.jsonl") for g in s["groups"]):
            assert time.monotonic() < deadline, "the restarted serve's rollouts were never trained on"
            time.sleep(1)
        assert learn.stop() == 0, learn.tail()
    finally:
        for p in (a2, b, learn):
            if p is not None:
                p.stop()
    failure = next(line for line in learn.lines if "publishing v1 failed" in line)
    assert "serve-a" in failure and "serve-b" not in failure.split("went quiet")[1]
    b_updates = [e["version"] for e in read_jsonl(tmp_path / "b.jsonl") if e["event"] == "update" and e["ok"]]
    steps = read_jsonl(tmp_path / "metrics.jsonl")
    assert b_updates[:1] == [1] and b_updates[-1] >= steps[-1]["version"] - 1
    # The restarted serve got the learner's latest weights before generating anything.
    events = read_jsonl(tmp_path / "a2.jsonl")
    first_update = next(i for i, e in enumerate(events) if e["event"] == "update" and e["ok"])
    caught_up = events[first_update]["version"]
    assert caught_up >= 3
    assert all(e["groups_admitted"] == 0 for e in events[:first_update] if e["event"] == "progress")
    # Its admission gate counts only its own groups (the dead incarnation's consumed groups are not credited to it),
    # and none of its rollouts was refused as a group trained before.
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and all(e["groups_consumed"] <= e["groups_admitted"] for e in progress)
    assert not any("already trained" in reason for reason in steps[-1]["rejected"])
