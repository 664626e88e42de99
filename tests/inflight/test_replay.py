"""`inflight.learn --replay DIR`: a learner trains on a recorded rollout journal and reaches the weights of the live run
that recorded it, bit for bit (inflight/learn/replay.py).

The unit tests check the argument the replay rests on — the groups of each step are a function of the journal's record
order alone, whatever the live run's timing — and the journal and flag handling. The process tests record a live
learner run (one fed by a real PUSH socket playing the serve, quick; one behind a real vLLM serve, `engine`), then
replay its run directory in a second learner process with the same flags and seed, and compare the exported weights
with `torch.equal`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from serve_support import ServeProcess
from test_learn import start_pair, wait_exit
from test_serve import free_port

from inflight.learn.config import LearnConfig
from inflight.learn.replay import JournalReplay, check_replay, journal_dir
from inflight.learn.store import RolloutBuffer, RolloutJournal
from inflight.wire.rollouts import Sampling, Times, decode_rollout, encode_rollout, make_rollout

GROUP, PER_STEP = 4, 2
TRAINING = ["--groups-per-step", str(PER_STEP), "--group-size", str(GROUP), "--lr", "1e-3", "--max-lag", "1",
            "--seed", "3", "--checkpoint-every", "2", "--bucket-mb", "1", "--timeout-s", "30"]  # fmt: skip


def record(group: int, index: int, rng: np.random.Generator, prompt: list[int], stream: str = "s@1") -> bytes:
    """One sample of group `group`: random completion, behaviour logprobs and token versions 0..2 (so the gate at
    --max-lag 1 masks some tokens and lets others train, depending on the step)."""
    n = int(rng.integers(3, 9))
    return encode_rollout(make_rollout(
        prompt_ids=prompt, completion_ids=rng.integers(10, 1000, size=n).tolist(),
        logprobs=(-rng.uniform(4, 9, size=n)).tolist(), versions=rng.integers(0, 3, size=n).tolist(),
        rollout_id=f"{stream}-g{group}-{index}", group_id=f"{stream}-g{group}", group_size=GROUP, index=index,
        server_id=stream, model="tiny-llama", reward=float(rng.integers(0, 2)) + 0.1 * index, finish_reason="length",
        sampling=Sampling(1.0), times=Times(0.0, 0.0, 0.0)))  # fmt: skip


def interleaved_records(groups: int, seed: int = 0, partial: int = 2) -> list[bytes]:
    """Samples of `groups` whole groups and one group of `partial` samples, in a shuffled arrival order: groups
    complete out of id order, as they do from a serve with stragglers."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, 1000, size=int(rng.integers(4, 9))).tolist() for _ in range(groups + 1)]
    samples = [(g, i) for g in range(groups) for i in range(GROUP)] + [(groups, i) for i in range(partial)]
    order = rng.permutation(len(samples))
    return [record(g, i, rng, prompts[g]) for g, i in (samples[k] for k in order)]


# -- the argument: step groups depend on the record order only -----------------------------------------------------


def live_steps(records: list[bytes], take_after: list[int]) -> list[list[str]]:
    """A live learner: records arrive one by one, and a step takes its groups whenever the loop gets to it (after
    the arrivals in `take_after`, or at the end)."""
    buffer, steps = RolloutBuffer("tiny-llama"), []
    for k, raw in enumerate(records):
        buffer.add(decode_rollout(raw))
        while k in take_after and (groups := buffer.take(PER_STEP)) is not None:
            steps.append([g[0].group_id for g in groups])
    while (groups := buffer.take(PER_STEP)) is not None:
        steps.append([g[0].group_id for g in groups])
    return steps


def replayed_steps(journal, consumed=()) -> list[list[str]]:
    replay, buffer, steps = JournalReplay(journal), RolloutBuffer("tiny-llama", consumed), []
    while True:
        replay.fill(buffer, PER_STEP)
        groups = buffer.take(PER_STEP)
        if groups is None:
            assert replay.done
            return steps
        steps.append([g[0].group_id for g in groups])


def test_a_replayed_journal_gives_every_step_the_groups_the_live_learner_took_whatever_its_timing(tmp_path):
    records = interleaved_records(groups=7)
    journal = RolloutJournal(tmp_path / "run" / "journal", keep_segments=True)
    journal.append(records[:10])
    journal.rotate(records[3:6])  # a checkpoint copies untrained records into a new segment: repeats, skipped
    journal.append(records[10:])
    journal.close()
    eager = live_steps(records, take_after=list(range(len(records))))  # a fast learner: takes as soon as it can
    late = live_steps(records, take_after=[])  # a slow one: everything arrived before its first step
    assert eager == late == replayed_steps(tmp_path / "run")
    assert len(eager) == 3  # 7 whole groups make 3 steps; the 7th group and the partial one wait


def test_a_resumed_replay_skips_the_groups_its_checkpoint_trained(tmp_path):
    journal = RolloutJournal(tmp_path / "journal", keep_segments=True)
    journal.append(interleaved_records(groups=6))
    journal.close()
    steps = replayed_steps(tmp_path / "journal")
    assert replayed_steps(tmp_path / "journal", consumed=steps[0]) == steps[1:]


def test_keep_journal_rotation_deletes_no_segment_and_reading_a_journal_creates_none(tmp_path):
    records = interleaved_records(groups=2)
    journal = RolloutJournal(tmp_path, keep_segments=True)
    journal.append(records[:5])
    journal.rotate(records[4:5])
    journal.append(records[5:])
    journal.close()
    before = sorted(p.name for p in tmp_path.iterdir())
    assert before == ["segment-000000.log", "segment-000001.log"]
    replay = JournalReplay(tmp_path)
    replay.fill(RolloutBuffer("tiny-llama"), 99)
    assert replay.done and replay.read == len(records) + 1  # the copy is read and skipped
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_replay_takes_a_run_directory_or_its_journal_and_refuses_anything_else(tmp_path):
    RolloutJournal(tmp_path / "rec" / "journal").append(interleaved_records(groups=1))
    assert journal_dir(tmp_path / "rec") == journal_dir(tmp_path / "rec" / "journal") == tmp_path / "rec" / "journal"
    with pytest.raises(ValueError, match=r"--replay is .*nothing.*--keep-journal"):
        journal_dir(tmp_path / "nothing")
    with pytest.raises(ValueError, match="give the replay its own --run-dir"):
        check_replay(str(tmp_path / "rec"), str(tmp_path / "rec"))
    check_replay(str(tmp_path / "rec"), str(tmp_path / "replay"))


def test_wait_for_serves_defaults_to_one_live_and_zero_in_a_replay(tmp_path):
    assert LearnConfig().serves_to_wait_for() == 1
    assert LearnConfig(replay=str(tmp_path)).serves_to_wait_for() == 0
    assert LearnConfig(replay=str(tmp_path), wait_for_serves=1).serves_to_wait_for() == 1


def test_a_replay_warns_about_training_settings_that_differ_from_the_recording(tmp_path):
    RolloutJournal(tmp_path / "journal").append(interleaved_records(groups=1))
    (tmp_path / "learn-config.json").write_text(json.dumps({"lr": 1e-3, "seed": 3, "run_dir": "a", "rollouts_port": 1}))
    differences = JournalReplay(tmp_path).recorded_differences({"lr": 1e-4, "seed": 3, "run_dir": "b",
                                                                "rollouts_port": 2})  # fmt: skip
    assert differences == ["lr 0.001 -> 0.0001"]


# -- real learner processes ------------------------------------------------------------------------------------------


def learner(model_dir, run_dir, *extra: str, env: dict | None = None) -> tuple[ServeProcess, int]:
    """An `inflight.learn` process on free ports; (the process, its rollouts port)."""
    ports = [free_port() for _ in range(3)]
    args = ["--model", str(model_dir), "--run-dir", str(run_dir), "--rollouts-port", str(ports[0]), "--control-port",
            str(ports[1]), "--weights-port", str(ports[2]), *extra]  # fmt: skip
    return ServeProcess(args, env=env, module="inflight.learn"), ports[0]


def assert_same_training(live_dir, replay_dir) -> list[dict]:
    """The replay's exported weights equal the live run's bit for bit, and every step trained the same groups with
    the same loss; the live run's metrics lines."""
    live = load_file(str(live_dir / "hf-final" / "model.safetensors"))
    replayed = load_file(str(replay_dir / "hf-final" / "model.safetensors"))
    assert live.keys() == replayed.keys()
    different = [name for name in live if not torch.equal(live[name], replayed[name])]
    assert not different, f"tensors that differ after the replay: {different}"
    versions = []
    for run in (live_dir, replay_dir):
        with safe_open(str(run / "hf-final" / "model.safetensors"), "pt") as f:
            versions.append(f.metadata()["inflight_version"])
    assert versions[0] == versions[1]
    steps = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
             for run in (live_dir, replay_dir)]  # fmt: skip
    fields = ("step", "version", "groups", "loss", "grad_norm", "gated_fraction", "lag_histogram", "tokens")
    assert [[s[f] for f in fields] for s in steps[0]] == [[s[f] for f in fields] for s in steps[1]]
    return steps[0]


def test_replaying_a_recorded_learner_run_reaches_its_weights_bit_for_bit_and_stops_when_the_journal_runs_out(
    model_dirs, tmp_path
):
    """The live learner gets 7 whole groups and a partial one over a real PUSH socket in a shuffled order, trains 3
    steps (a checkpoint after step 2 rotates its kept journal) and stops at --steps; the replay, given no --steps,
    trains the same 3 steps and stops because the 7th group alone makes no step."""
    import zmq

    model, live_dir, replay_dir = model_dirs["tiny-llama"], tmp_path / "live", tmp_path / "replay"
    # Bitwise equality needs the same reduction order in both processes: both run one OpenMP thread.
    one_thread = {"OMP_NUM_THREADS": "1"}
    live, port = learner(model, live_dir, "--steps", "3", "--keep-journal", "--wait-for-serves", "0", *TRAINING,
                         env=one_thread)  # fmt: skip
    try:
        live.wait_for("inflight.learn ready", timeout_s=120)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        for raw in interleaved_records(groups=7):
            push.send(raw)
        assert wait_exit(live, 300) == 0, live.tail()
        push.close(linger=0)
    finally:
        live.stop()
    assert len(sorted((live_dir / "journal").glob("segment-*.log"))) == 3  # start, step-2 and final checkpoints
    replay, _ = learner(model, replay_dir, "--replay", str(live_dir), *TRAINING, env=one_thread)
    try:
        assert wait_exit(replay, 300) == 0, replay.tail()
    finally:
        replay.stop()
    assert replay.count("inflight.learn ready: replaying") == 1 and replay.count("differs from the recording") == 1
    steps = assert_same_training(live_dir, replay_dir)
    assert len(steps) == 3 and all(0 < s["gated_fraction"] < 1 for s in steps)  # the gate mattered, and some trained
    base = load_file(str(model / "model.safetensors"))
    trained = load_file(str(live_dir / "hf-final" / "model.safetensors"))
    assert any(not torch.equal(base[name], trained[name]) for name in base)  # the steps moved the weights
    assert not (replay_dir / "journal").exists()  # the recording is the journal: a replay writes none
    assert (replay_dir / "checkpoints" / "step-00000002").is_dir()


@pytest.mark.engine
def test_replaying_a_live_serve_and_learner_run_reaches_the_learners_weights_bit_for_bit(model_dirs, tmp_path):
    """A real vLLM serve and learner on tiny-llama for 2 steps (rollouts of several versions, never-stop updates),
    recorded with --keep-journal; a second learner replays the run directory with the same flags, no serve."""
    model, live_dir, replay_dir = model_dirs["tiny-llama"], tmp_path / "live", tmp_path / "replay"
    learn, serve = start_pair(model, live_dir, 2, extra_learn=["--keep-journal"])
    try:
        assert wait_exit(learn) == 0, learn.tail()
    finally:
        serve.stop()
        learn.stop()
    recorded = json.loads((live_dir / "learn-config.json").read_text())
    flags = ["--groups-per-step", "2", "--group-size", "4", "--lr", str(recorded["lr"]), "--steps", "2"]
    replay, _ = learner(model, replay_dir, "--replay", str(live_dir), *flags)  # the live learner's environment
    try:
        assert wait_exit(replay, 300) == 0, replay.tail()
    finally:
        replay.stop()
    assert replay.count("differs from the recording") == 0, replay.tail()
    assert_same_training(live_dir, replay_dir)


def test_a_learner_that_fails_after_training_is_quoted_by_its_error_not_by_tritons_exit_report(model_dirs, tmp_path):
    """A side's last lines, which a failed run prints, end with its traceback: the ~30 lines nanobind prints at exit
    about Triton objects (a process that ran torch's kernels) stay in the log only. Here a replay learner trains a step,
    then cannot export, since its run directory holds a file named hf-final."""
    import os
    import sys

    from inflight.run.launch import Side

    RolloutJournal(tmp_path / "rec" / "journal").append(interleaved_records(groups=2))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "hf-final").write_text("in the way")
    argv = [sys.executable, "-m", "inflight.learn", "--model", str(model_dirs["tiny-llama"]), "--run-dir",
            str(run_dir), "--replay", str(tmp_path / "rec"), "--steps", "1", *TRAINING]  # fmt: skip
    side = Side("learn", argv, dict(os.environ), None, tmp_path / "learn.log", "none")
    assert side.proc.wait(300) == 1
    side.reader.join(10)
    log = (tmp_path / "learn.log").read_text()
    assert "step 1 v1" in log and "nanobind: leaked" in log.split("FileExistsError")[-1], log[-3000:]
    quoted = side.last_lines()
    assert "FileExistsError" in quoted.splitlines()[-1] and "leaked" not in quoted, quoted
