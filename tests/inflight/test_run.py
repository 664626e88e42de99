"""`python -m inflight.run`: a real serve and a real learner launched on split cores, one run directory.

Each test starts the launcher as a subprocess on tiny-llama (a real vLLM engine, real sockets, real weight updates)
and checks what a user sees: the exit code, the children's CPU affinity, the run directory, Ctrl-C and a dying side.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from serve_support import TEST_KV_GIB, ServeProcess
from tool_model import tool_model

pytestmark = pytest.mark.engine
STEPS = 6  # enough that the last steps train on rollouts sampled after a commit, however late it lands

# A continuous reward (text length) so that a random tiny model's groups have non-zero advantages and real gradients.
SERVE_ARGS = f"--progress-s 1 --max-inflight 16 --kv-cache-gib {TEST_KV_GIB} --reward serve_rewards:text_length"
FAST = ["--model", "tiny-llama", "--group-size", "4", "--groups-per-step", "2", "--max-tokens", "8",
        "--serve-args", SERVE_ARGS]  # fmt: skip


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def children(launcher: ServeProcess) -> dict[str, psutil.Process]:
    """The launcher's two direct children, by side."""
    found = {}
    for child in psutil.Process(launcher.proc.pid).children():
        cmd = " ".join(child.cmdline())
        for side in ("serve", "learn"):
            if f"inflight.{side}" in cmd:
                found[side] = child
    return found


def assert_engine_stopped_in_order(run_dir) -> None:
    """The serve stopped its engine itself: signalled as a process group (the serve, its EngineCore and its worker at
    once), the worker exited in the middle of an engine step, which vLLM reports as the EngineCore's fatal error."""
    serve_log = (run_dir / "serve.log").read_text()
    assert "EngineCore encountered a fatal error" not in serve_log and "died unexpectedly" not in serve_log
    assert "EngineCore: exiting busy loop" in serve_log  # its shutdown ran to the end


def test_run_trains_on_split_cores_every_update_reaches_the_serve_and_fills_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    # --fused-loss on: the learner trains through learner/fused_loss.py (its torch row pass here; Triton on CUDA), and
    # the lag-0 mismatch below checks those logprobs against the serve's behaviour logprobs. --full-every 10: updates
    # 2.. go as deltas, which the serve must commit bitwise like full ones
    launcher = ServeProcess(["--run-dir", str(run_dir), "--steps", str(STEPS), *FAST, "--report-to", "tensorboard",
                             "--learn-args", "--fused-loss on --full-every 10"], module="inflight.run")  # fmt: skip
    try:
        launcher.wait_for("inflight.serve ready", 240)
        sides = children(launcher)
        assert set(sides) == {"serve", "learn"}
        assert sides["serve"].cpu_affinity() == [0]
        assert sides["learn"].cpu_affinity() == [1]
        assert sides["serve"].environ().get("VLLM_CPU_OMP_THREADS_BIND") == "0"
        assert sides["learn"].environ().get("OMP_NUM_THREADS") == "1"
        launcher.proc.wait(300)
    finally:
        launcher.stop()
    assert launcher.proc.returncode == 0, launcher.tail()
    for name in ("run-config.json", "config.toml", "serve-config.json", "learn-config.json", "learn.log", "serve.log",
                 "metrics.jsonl", "serve-metrics.jsonl", "summary.json", "summary.md", "reward.png", "lag.png",
                 "throughput.png", "hf-final/model.safetensors", "learn.cmd", "serve.cmd"):  # fmt: skip
        assert (run_dir / name).exists(), name
    assert any((run_dir / "checkpoints").iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["updates"] >= 1
    assert json.loads((run_dir / "serve-config.json").read_text())["model"] == "tiny-llama"
    assert json.loads((run_dir / "learn-config.json").read_text())["fused_loss"] == "on"
    assert f"step {STEPS} v{STEPS}" in (run_dir / "learn.log").read_text()  # the learner's whole log is kept
    assert "| mode |" in launcher.tail(60)  # the final table is printed
    assert_engine_stopped_in_order(run_dir)

    # Every step trained on real tokens, published one version to the one serve, and the serve committed each in order.
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == [s["version"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["publish_serves"] == 1 and s["publish_bytes"] > 0 and not s["publish_failed"] for s in steps)
    assert all(s["tokens"] > 0 and s["grad_norm"] > 0 for s in steps)
    updates = [e for e in read_jsonl(run_dir / "serve-metrics.jsonl") if e["event"] == "update"]
    # (the launcher stops the serve after the learner: the last update is committed before it goes)
    assert [u["version"] for u in updates if u["ok"]] == list(range(1, STEPS + 1)), updates
    # --full-every 10: the first update went in full, every later one as a delta on the one before
    assert [s["publish_delta"] for s in steps] == [False] + [True] * (STEPS - 1)
    # rollouts sampled after the first commit carry the new versions: lags below the oldest possible one show up
    assert any(int(lag) < s["version"] - 1 for s in steps[1:] for lag in s["lag_histogram"]), steps
    assert all(s.get("mismatch_lag0", 0.0) < 0.05 for s in steps)

    # --report-to tensorboard: the learner mirrored every step and the serve's own lines (see also test_tracking.py)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [p.step for p in events.Scalars("train/reward")] == list(range(1, STEPS + 1))
    assert [p.value for p in events.Scalars("train/reward")] == pytest.approx([s["reward"] for s in steps])
    assert events.Scalars("serve/tokens") and events.Scalars("update/stall_s")


def test_run_with_the_calculator_environment_on_smollm2_trains_on_multi_turn_episodes_and_reports_them(tmp_path):
    # SmolLM2-135M does not call the tool; retries make its episodes multi-turn all the same (a wrong answer is told
    # to try again), so environment tokens reach the learner through the real serve, sockets and loss.
    run_dir = tmp_path / "calc"
    serve_args = (f"--progress-s 1 --kv-cache-gib {TEST_KV_GIB} --max-turns 2 --arithmetic-terms 3 "
                  """--arithmetic-ops +-* --env-args '{"retries": 1}'""")  # fmt: skip
    launcher = ServeProcess(["--run-dir", str(run_dir), "--steps", "2", "--model", "smollm2", "--env", "calculator",
                             "--group-size", "4", "--groups-per-step", "1", "--max-tokens", "12",
                             "--serve-args", serve_args], module="inflight.run")  # fmt: skip
    try:
        launcher.proc.wait(600)
    finally:
        launcher.stop()
    assert launcher.proc.returncode == 0, launcher.tail()
    episodes = json.loads((run_dir / "summary.json").read_text())["episodes"]
    assert episodes["turns_per_episode"] > 1 and 0 < episodes["env_token_share"] < 1 and episodes["env_errors"] == 0
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:  # environment tokens reached the learner, out of the lag histogram and the trained tokens
        assert s["env_tokens"] > 0 and s["turns_mean"] > 1 and s["tokens"] == sum(s["lag_histogram"].values())
    last = [e for e in read_jsonl(run_dir / "serve-metrics.jsonl") if e["event"] == "progress"][-1]
    assert last["turns"] > last["rollouts_made"] and last["env_tokens"] > 0 and last["policy_tokens"] > 0
    assert json.loads((run_dir / "serve-config.json").read_text())["env"] == "calculator"


@pytest.mark.parametrize("harness", ["null", "bash"])
def test_run_with_a_taskset_only_verifiers_environment_on_a_built_in_harness_trains_with_rewards_and_no_env_error(
    tmp_path, model_dirs, harness
):
    # tests/inflight/vf_taskset_only.py: a vf.Taskset and one @vf.reward, run by verifiers' own `null` harness or its
    # default, `bash` (its chat program prepared by uv once per serve, then one subprocess per episode calling the
    # serve's endpoint). bash offers the model its bash and edit tools: the model is tiny-qwen2 with a chat template
    # that renders tools (tests/inflight/tool_model.py); the random model rarely calls one: the harness runs regardless
    run_dir, model = tmp_path / "vf", tool_model(model_dirs["tiny-qwen2"], tmp_path / "model")
    null = """ --env-args '{"agent": {"harness": {"id": "null"}}}'""" if harness == "null" else ""
    serve_args = f"--progress-s 1 --kv-cache-gib {TEST_KV_GIB} --env-timeout-s 120{null}"
    launcher = ServeProcess(["--run-dir", str(run_dir), "--steps", "2", "--model", str(model), "--env",
                             "verifiers:vf_taskset_only", "--group-size", "2", "--groups-per-step", "1",
                             "--max-tokens", "8", "--serve-args", serve_args], module="inflight.run")  # fmt: skip
    try:
        launcher.proc.wait(600)
    finally:
        launcher.stop()
    assert launcher.proc.returncode == 0, launcher.tail()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and "no_step_trained" not in summary
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2] and all(s["rejected"] == {} for s in steps)
    last = [e for e in read_jsonl(run_dir / "serve-metrics.jsonl") if e["event"] == "progress"][-1]
    assert set(last["reward_means"]) == {"replied"} and last["rollouts_made"] >= 4, "the environment's reward"
    assert last.get("env_errors", 0) == 0 and last.get("groups_dropped", 0) == 0, last
    if harness == "bash":
        assert "harness 'bash' executes model-written code" in (run_dir / "serve.log").read_text()
    assert_engine_stopped_in_order(run_dir)  # episodes still ran when the run stopped the serve


def test_ctrl_c_stops_the_learner_first_then_the_serve_and_keeps_the_run(tmp_path):
    run_dir = tmp_path / "run"
    launcher = ServeProcess(["--run-dir", str(run_dir), *FAST], module="inflight.run")
    try:
        launcher.wait_for("step 2 v2", 300)
        sides = children(launcher)
        launcher.proc.send_signal(signal.SIGINT)
        launcher.proc.wait(240)
    finally:
        launcher.stop()
    assert launcher.proc.returncode == 130, launcher.tail()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in sides.values())
    # The learner stopped cleanly: a final checkpoint and the HF export exist, and the summary was written.
    assert (run_dir / "hf-final" / "model.safetensors").exists()
    assert any((run_dir / "checkpoints").iterdir())
    assert json.loads((run_dir / "summary.json").read_text())["steps"] >= 2


def test_a_dying_serve_fails_the_run_with_its_last_lines(tmp_path):
    run_dir = tmp_path / "run"
    launcher = ServeProcess(["--run-dir", str(run_dir), *FAST], module="inflight.run")
    try:
        launcher.wait_for("inflight.serve ready", 240)
        serve = children(launcher)["serve"]
        engine = serve.children(recursive=True)  # vLLM's EngineCore and worker
        assert any("EngineCore" in " ".join(p.cmdline()) for p in engine), [p.cmdline() for p in engine]
        os.kill(serve.pid, signal.SIGKILL)
        launcher.proc.wait(240)
        # The orphaned engine processes stop by themselves (vllm_patches.plugin's parent watch), not holding their
        # weights and KV cache for ever.
        gone, alive = psutil.wait_procs(engine, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        launcher.stop()
    assert launcher.proc.returncode == 1
    out = launcher.tail(80)
    assert "serve exited with code -9" in out
    # The serve's last lines follow the reason. (The orphaned engine's shutdown lines may land in serve.log after the
    # report, so the quoted lines are compared with the log, not with its end.)
    quoted = out.split("serve exited with code -9; its last lines:\n", 1)[1].splitlines()
    logged = set((run_dir / "serve.log").read_text().splitlines())
    assert quoted[0].strip() and quoted[0] in logged, quoted[:3]


def test_bad_side_flags_fail_before_anything_starts(tmp_path):
    start = time.monotonic()
    bad = ServeProcess(["--run-dir", str(tmp_path / "run"), *FAST[:-2], "--serve-args", "--max-tokenz 3"],
                       module="inflight.run")  # fmt: skip
    assert bad.proc.wait(60) == 2
    assert "--max-tokenz" in bad.tail() and "unrecognized arguments" in bad.tail()
    assert time.monotonic() - start < 30  # no engine was started
    worse = ServeProcess(["--run-dir", str(tmp_path / "run"), "--serve-cores", "0-x", *FAST], module="inflight.run")
    assert worse.proc.wait(60) == 2
    assert "--serve-cores" in worse.tail() and "'0-x'" in worse.tail()
