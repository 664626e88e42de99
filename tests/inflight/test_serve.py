"""inflight.serve as a real process: rollouts over real ZeroMQ sockets to the learner's real receiving classes."""

from __future__ import annotations

import json
import pickle
import time
from collections import defaultdict

import msgspec
import pytest
from serve_support import ServeProcess

from inflight.run.launch import free_ports
from inflight.wire.control import CONTROL_SCHEMA, Agreed, Ask, ControlServer, Hello, Progress, Status
from inflight.wire.rollouts import RolloutReceiver

pytestmark = pytest.mark.engine
GROUP = 4
MAX_TOKENS = 12
ANSWERS = {"q-a": 3, "q-b": 7, "q-c": 11}
API_KEY = "serve-test-key"  # VLLM_API_KEY of the serve: its OpenAI API is bound beyond loopback


class LearnerSide:
    """What a learner sees: rollouts grouped by group_id, and the control messages of one serve."""

    def __init__(self):
        self.rx, self.ctl = RolloutReceiver(hwm=1), ControlServer()
        self.rollouts, self.control, self.identity = [], [], None
        self.acked: set[str] = set()

    def pump(self, seconds: float, read_rollouts: bool = True) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if read_rollouts:
                self.rollouts += self.rx.receive(timeout_s=0.05)
                # Like the real learner: acknowledge complete groups, so the serve may forget them.
                fresh = sorted(set(self.complete_groups()) - self.acked)
                if fresh and self.identity is not None:
                    self.ctl.send(self.identity, Progress(version=0, acked=fresh))
                    self.acked |= set(fresh)
            for identity, message in self.ctl.poll(0.05):
                self.control.append(message)
                if isinstance(message, Ask):
                    self.ctl.send(identity, Agreed())  # like the real learner, before the serve starts its engine
                if isinstance(message, Hello):
                    self.identity = identity
                    self.ctl.send(identity, Progress(version=0, published=0))  # what a fresh learner says

    def groups(self) -> dict[str, list]:
        out = defaultdict(list)
        for r in self.rollouts:
            out[r.group_id].append(r)
        return out

    def complete_groups(self) -> dict[str, list]:
        return {g: rs for g, rs in self.groups().items() if len(rs) == rs[0].group_size}

    def statuses(self) -> list[Status]:
        return [m for m in self.control if isinstance(m, Status)]

    def pump_until(self, cond, timeout_s: float = 120.0) -> None:
        end = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < end, "timed out waiting for serve"
            self.pump(0.2)


def free_port() -> int:
    return free_ports(1, "127.0.0.1")[0]  # the run's own draw: below the ports bind(0) and connections take again


@pytest.fixture(scope="module")
def running(model_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "prompt": f"Say {v}.", "answer": v}) + "\n"
                               for k, v in ANSWERS.items()))  # fmt: skip
    side, port = LearnerSide(), free_port()
    serve = ServeProcess([
        "--model", str(model_dirs["tiny-llama"]), "--rollouts", side.rx.address, "--control", side.ctl.address,
        "--task", f"jsonl:{prompts}", "--reward", "serve_rewards:answer_tenth", "--group-size", str(GROUP),
        "--max-tokens", str(MAX_TOKENS), "--admit-lag", "-1", "--max-inflight", "8", "--max-outstanding", "16",
        "--http-port", str(port), "--http-host", "0.0.0.0", "--metrics", str(tmp / "metrics.jsonl"),
    ], env={"VLLM_API_KEY": API_KEY})  # fmt: skip
    serve.wait_for("inflight.serve ready")
    yield side, serve, port, tmp
    assert serve.stop() == 0, serve.tail()


def test_groups_arrive_complete_with_per_token_logprobs_versions_and_rewards(running, model_dirs):
    from transformers import AutoTokenizer

    side, serve, _, _ = running
    side.pump_until(lambda: len(side.complete_groups()) >= 6)
    tok = AutoTokenizer.from_pretrained(model_dirs["tiny-llama"])
    prompts = {k: f"Say {v}." for k, v in ANSWERS.items()}
    for group_id, records in side.complete_groups().items():
        assert sorted(r.index for r in records) == list(range(GROUP)), group_id
        assert len({r.problem_id for r in records}) == 1 and len({r.prompt_ids for r in records}) == 1
        for r in records:
            n = len(r.completion)
            assert 1 <= n <= MAX_TOKENS and len(r.logprobs) == n and len(r.versions) == n
            assert (r.versions == 0).all() and (r.logprobs <= 0).all()
            assert r.finish_reason in ("length", "stop") and (r.finish_reason == "stop" or n == MAX_TOKENS)
            assert r.reward == pytest.approx(ANSWERS[r.problem_id] / 10)
            assert r.sampling.temperature == 1.0 and r.sampling.max_tokens == MAX_TOKENS
            assert r.times.submitted <= r.times.first_token <= r.times.finished
            messages = [{"role": "user", "content": prompts[r.problem_id]}]
            expected_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
            assert r.prompt.tolist() == list(expected_prompt)
    assert sum(side.rx.rejected.values()) == 0


def test_hello_announces_every_checkpoint_tensor(running, model_dirs):
    from safetensors import safe_open

    side, _, _, _ = running
    side.pump_until(lambda: side.identity is not None)
    hello = next(m for m in side.control if isinstance(m, Hello))
    with safe_open(str(model_dirs["tiny-llama"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())  # noqa: SIM118
    assert {t.name for t in hello.tensors} == names and hello.version == 0 and hello.mode == "never-stop"


def test_malformed_and_unknown_schema_control_messages_are_logged_and_serve_keeps_running(running):
    side, serve, _, _ = running
    side.pump_until(lambda: side.identity is not None)
    before = serve.count("rejected control message")
    bad = [
        b"\x00not msgpack at all",
        msgspec.msgpack.encode({"type": "self_destruct", "schema": CONTROL_SCHEMA}),
        msgspec.msgpack.encode({"type": "progress", "schema": 99, "version": 1, "groups_consumed": 5}),
        msgspec.msgpack.encode({"type": "progress", "schema": CONTROL_SCHEMA, "groups_consumed": "many"}),
        pickle.dumps({"type": "progress"}),
    ]
    for data in bad:
        side.ctl.send_raw(side.identity, data)
    serve.wait_for("rejected control message", timeout_s=30, count=before + len(bad))
    assert f"schema is 99, expected {CONTROL_SCHEMA}" in serve.tail(200)
    got, statuses = len(side.rollouts), len(side.statuses())
    side.pump_until(lambda: len(side.rollouts) > got + GROUP and len(side.statuses()) > statuses + 1)
    assert serve.proc.poll() is None
    side.ctl.send(side.identity, Progress(version=0, groups_consumed=1))  # a good one after the bad ones still works
    side.pump(1.0)


def test_openai_client_gets_a_chat_completion_while_rollouts_stream(running):
    """The API is bound to every interface, as a served model is, so only a client with the serve's key is answered."""
    import openai

    side, serve, port, _ = running
    stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-the-key", timeout=120)
    with pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, timeout=120)
    got = len(side.rollouts)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=8
    )
    completion = raw.parse()
    assert completion.choices[0].message.content is not None and completion.usage.completion_tokens >= 1
    assert raw.headers["x-inflight-weight-version"] == "0" and raw.headers["x-inflight-weight-version-start"] == "0"
    side.pump_until(lambda: len(side.rollouts) > got + GROUP)
    busy = [s for s in side.statuses()[-5:] if s.inflight > 0]
    assert busy, "the rollout driver was idle while the API answered"


def test_progress_metrics_are_written(running):
    _, _, _, tmp = running
    time.sleep(1.5)
    lines = [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()]
    progress = [x for x in lines if x["event"] == "progress"]
    assert len(progress) >= 2 and any(x["tokens_per_s"] > 0 for x in progress)
    assert progress[-1]["rollouts_sent"] >= progress[0]["rollouts_sent"]


def test_backpressure_bounds_outstanding_work_and_delivers_every_rollout_once(model_dirs):
    side, max_groups, per_step = LearnerSide(), 10, 2
    serve = ServeProcess([
        "--model", str(model_dirs["tiny-llama"]), "--rollouts", side.rx.address, "--control", side.ctl.address,
        "--group-size", str(GROUP), "--max-tokens", "8", "--admit-lag", "0", "--groups-per-step", str(per_step),
        "--max-groups", str(max_groups), "--max-outstanding", "8",
    ])  # fmt: skip
    try:
        serve.wait_for("inflight.serve ready")
        consumed = 0

        def consume():
            nonlocal consumed
            side.pump(0.2)
            if len(side.complete_groups()) > consumed:
                consumed = len(side.complete_groups())
                acked = sorted(side.complete_groups())  # what a learner has journaled: the serve may forget it
                side.ctl.send(side.identity, Progress(version=0, groups_consumed=consumed, acked=acked))

        side.pump_until(lambda: side.identity is not None)
        while consumed < 3:
            consume()
        # The learner stalls: it reads no rollouts and reports no progress for 12 s.
        rss_start = serve.rss_bytes()
        side.pump(12.0, read_rollouts=False)
        stalled = [s for s in side.statuses()[-10:]]
        assert max(s.groups_admitted for s in stalled) <= consumed + per_step, stalled
        assert max(s.inflight + s.outbox for s in stalled) <= 8
        assert stalled[-1].inflight == 0, "generation should have stopped while the learner stalls"
        assert serve.rss_bytes() < rss_start * 1.10
        # It resumes: everything arrives, each rollout exactly once, and serve exits after --max-groups.
        deadline = time.monotonic() + 180
        while serve.proc.poll() is None and time.monotonic() < deadline:
            consume()
        side.pump(1.0)
        ids = [r.rollout_id for r in side.rollouts]
        assert len(ids) == len(set(ids)) == max_groups * GROUP
        assert serve.proc.returncode == 0, serve.tail()
    finally:
        serve.stop()


def test_a_serve_whose_engine_core_dies_exits_1_saying_so_instead_of_failing_every_group(model_dirs):
    import psutil

    side = LearnerSide()
    serve = ServeProcess([
        "--model", str(model_dirs["tiny-llama"]), "--rollouts", side.rx.address, "--control", side.ctl.address,
        "--group-size", str(GROUP), "--max-tokens", "8", "--admit-lag", "-1",
    ])  # fmt: skip
    try:
        serve.wait_for("inflight.serve ready")
        side.pump_until(lambda: len(side.complete_groups()) >= 1)
        engine = psutil.Process(serve.proc.pid).children(recursive=True)
        (core,) = [p for p in engine if "EngineCore" in " ".join(p.cmdline())]
        core.kill()
        deadline = time.monotonic() + 60
        while serve.proc.poll() is None and time.monotonic() < deadline:
            side.pump(0.5)
    finally:
        serve.stop()
    assert serve.proc.returncode == 1, serve.tail()
    assert serve.count("vLLM's EngineCore died") == 1, serve.tail()


def test_a_serve_that_never_hears_from_its_learner_says_what_to_check_on_its_progress_line(model_dirs, tmp_path):
    """A serve given a --secret-file that its learner was not given (or another one) gets no message through, and
    CURVE drops the handshakes without a word to either side: the serve used to print '0.0 tok/s' forever. After
    30 s without one answer its progress line names the learner's address and the secret."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    side = LearnerSide()  # plain ZeroMQ: no secret
    serve = ServeProcess(["--model", str(model_dirs["tiny-llama"]), "--rollouts", side.rx.address, "--control",
                          side.ctl.address, "--secret-file", str(secret), "--progress-s", "2"])  # fmt: skip
    try:
        serve.wait_for("inflight.serve ready", timeout_s=180)
        serve.wait_for(f"no word from the learner at {side.ctl.address} in", timeout_s=60)
        assert "with the same --secret-file or --socket-secret-file as this serve (or neither)?" in serve.tail(5)
        side.pump(0.5)
        assert side.control == [] and side.rollouts == []  # nothing got through either way
    finally:
        assert serve.stop() == 0, serve.tail()
