"""Two hosts: learner and serve in separate network namespaces joined by a veth pair, made by the test.

The learner binds 10.231.0.1 in its namespace, the serve reaches it over the veth link from 10.231.0.2: rollouts,
control and the weights group all cross the link (the serve's gloo device binds its own address on the route). Cutting
the link in the middle of a weight transfer behaves like a killed serve — the learner's broadcast times out, the serve
is dropped — and restoring it lets the serve rejoin and catch up. Needs root and `ip netns`; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid

import pytest
from serve_support import ServeProcess

pytestmark = pytest.mark.engine

LEARN_IP, SERVE_IP = "10.231.0.1", "10.231.0.2"


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"inflight-probe-{uuid.uuid4().hex[:6]}"
    try:
        sh("ip", "netns", "add", probe)
    except subprocess.CalledProcessError:
        return False
    sh("ip", "netns", "del", probe)
    return True


@pytest.fixture
def two_hosts():
    if not netns_available():
        pytest.skip("needs root and `ip netns` (network namespaces) to build two hosts")
    tag = uuid.uuid4().hex[:6]
    learn_ns, serve_ns, veth_l, veth_s = f"inf-l-{tag}", f"inf-s-{tag}", f"vl{tag}", f"vs{tag}"
    sh("ip", "netns", "add", learn_ns)
    sh("ip", "netns", "add", serve_ns)
    try:
        sh("ip", "link", "add", veth_l, "type", "veth", "peer", "name", veth_s)
        sh("ip", "link", "set", veth_l, "netns", learn_ns)
        sh("ip", "link", "set", veth_s, "netns", serve_ns)
        for ns, dev, ip in ((learn_ns, veth_l, LEARN_IP), (serve_ns, veth_s, SERVE_IP)):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield {"learn": learn_ns, "serve": serve_ns, "link": (learn_ns, veth_l)}
    finally:
        for ns in (learn_ns, serve_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_cutting_the_link_mid_transfer_drops_the_serve_and_restoring_it_lets_it_rejoin(two_hosts, model_dirs,
                                                                                      tmp_path):  # fmt: skip
    model = str(model_dirs["tiny-llama"])
    learn = ServeProcess.in_netns(two_hosts["learn"], [
        "--model", model, "--host", LEARN_IP, "--rollouts-port", "15555", "--control-port", "15556",
        "--weights-port", "15557", "--groups-per-step", "2", "--run-dir", str(tmp_path), "--timeout-s", "10",
        "--bucket-mb", "1", "--lr", "1e-3", "--group-size", "4"], module="inflight.learn")  # fmt: skip
    serve = None
    try:
        learn.wait_for("inflight.learn ready", 120)
        serve = ServeProcess.in_netns(two_hosts["serve"], [
            "--model", model, "--rollouts", f"tcp://{LEARN_IP}:15555", "--control", f"tcp://{LEARN_IP}:15556",
            "--group-size", "4", "--groups-per-step", "2", "--max-tokens", "8", "--server-id", "far-serve",
            "--metrics", str(tmp_path / "serve.jsonl")], module="inflight.serve",
            env={"INFLIGHT_FAULT_RECEIVE_STALL": "0:12:3"})  # fmt: skip
        serve.wait_for("weights v2 committed", 300)  # rollouts, control and weights all crossed the link
        serve.wait_for("inflight fault injection: stalling the receive of v3", 120)
        ns, dev = two_hosts["link"]
        sh("ip", "-n", ns, "link", "set", dev, "down")
        cut_at = time.monotonic()
        learn.wait_for("publishing v3 failed", 60)
        assert time.monotonic() - cut_at < 10 + 15  # the group timeout plus the quiet probe
        sh("ip", "-n", ns, "link", "set", dev, "up")
        learn.wait_for("step 5 v5", 300)  # the serve rejoined, was caught up, and its rollouts train again
        serve.wait_for("committed", 120, count=4)
        assert learn.stop() == 0, learn.tail()
    finally:
        if serve is not None:
            serve.stop()
        learn.stop()
    failure = next(line for line in learn.lines if "publishing v3 failed" in line)
    assert "far-serve" in failure
    versions = [e["version"] for e in read_jsonl(tmp_path / "serve.jsonl") if e["event"] == "update" and e["ok"]]
    assert versions[:2] == [1, 2] and max(versions) >= 4
