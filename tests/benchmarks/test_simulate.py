"""The scale simulator (benchmarks/simulate.py) against closed-form answers on scenarios simple enough to have one."""

from __future__ import annotations

import json

import pytest
from record_factories import a_step, an_update, write_lines

from benchmarks.simulate import MODES, Calibration, Scenario, calibrate, simulate


def cal(**kw) -> Calibration:
    base = dict(d0=0.01, d1=0.0, train_t0=2.0, train_t1=0.0, publish_s=0.5, receive_s=0.2, lengths=[20],
                group_size=4, groups_per_step=2, max_inflight=64, admit_lag=1)  # fmt: skip
    base.update(kw)
    c = Calibration(**base)
    c.commit_s = dict.fromkeys(MODES, 0.1)
    return c


def test_blocking_step_is_generation_plus_training_plus_update():
    # 8 samples of 20 tokens at 0.01 s per decode step: 0.2 s generation; + 2.0 train + 0.5 publish + 0.1 commit.
    r = simulate(cal(), "blocking", Scenario(workers=1, learners=1, samples_per_worker=8), steps=30)
    assert r["steps_per_s"] == pytest.approx(1 / (0.2 + 2.0 + 0.5 + 0.1), rel=0.02)


def test_never_stop_is_bound_by_the_learner_when_generation_is_cheap():
    r = simulate(cal(), "never-stop", Scenario(workers=1, learners=1, samples_per_worker=8), steps=30)
    assert r["steps_per_s"] == pytest.approx(1 / (2.0 + 0.5), rel=0.02)
    assert r["learner_wait"] < 0.05


def test_synchronous_step_waits_for_the_slowest_worker():
    # Same mean work, but one sample in eight is 8x longer: the blocking step is set by the straggler.
    even = simulate(cal(lengths=[20]), "blocking", Scenario(1, 1, 8), steps=20)
    tail = simulate(cal(lengths=[160]), "blocking", Scenario(1, 1, 8), steps=20)
    assert 1 / tail["steps_per_s"] - 1 / even["steps_per_s"] == pytest.approx(140 * 0.01, rel=0.05)


def test_long_tail_makes_async_speedup_grow_with_scale():
    c = cal(d0=0.02, d1=0.0005, train_t0=0.5, train_t1=0.001, publish_s=0.2)
    speedups = []
    for n in (8, 64):
        sc = Scenario(workers=3 * n // 4, learners=n // 4, samples_per_worker=32, lengths="lognormal:40,1.0,2048")
        r = {m: simulate(c, m, sc, steps=12) for m in ("blocking", "never-stop")}
        speedups.append(r["never-stop"]["samples_per_s"] / r["blocking"]["samples_per_s"])
    assert speedups[0] > 1.0 and speedups[1] > speedups[0]


def test_calibration_recovers_a_linear_train_cost_and_the_measured_stalls(tmp_path):
    for mode, stall in (("never-stop", 0.3), ("blocking", 0.5)):
        run = tmp_path / mode
        run.mkdir()
        (run / "run-config.json").write_text(json.dumps({"group_size": 8, "groups_per_step": 4, "admit_lag": 1}))
        steps = [a_step(i + 1, tokens=n, train_s=1.5 + 0.01 * n, publish_s=0.7, lengths=[n // 32] * 32, time=i)
                 for i, n in enumerate((320, 640, 960, 1280, 1600))]  # fmt: skip
        write_lines(run / "metrics.jsonl", steps)
        write_lines(run / "serve-metrics.jsonl", [an_update(commit_s=stall, receive_s=0.4)])
    c = calibrate(tmp_path, None)
    assert c.train_t0 == pytest.approx(1.5) and c.train_t1 == pytest.approx(0.01)
    assert c.publish_s == pytest.approx(0.7) and c.receive_s == pytest.approx(0.4)
    assert c.commit_s["never-stop"] == pytest.approx(0.3) and c.commit_s["blocking"] == pytest.approx(0.5)
    assert c.group_size == 8 and c.groups_per_step == 4


def test_a_multi_turn_sample_decodes_its_turns_in_sequence_with_the_tool_latency_after_each():
    # 3 turns of 10 tokens (30 policy tokens) and ~1 s of tool after every turn: 3 x (0.1 s decode + 1 s tool), then
    # train + publish + commit; a one-turn sample of the same 30 tokens pays the tool once.
    tool = "lognormal:1.0,0.0001"
    three = simulate(cal(lengths=[30], turns=[3]), "blocking", Scenario(1, 1, 8, tool=tool), steps=20)
    assert 1 / three["steps_per_s"] == pytest.approx(3 * (0.1 + 1.0) + 2.0 + 0.5 + 0.1, rel=0.02)
    one = simulate(cal(lengths=[30], turns=[1]), "blocking", Scenario(1, 1, 8, tool=tool), steps=20)
    assert 1 / three["steps_per_s"] - 1 / one["steps_per_s"] == pytest.approx(2 * 1.0, rel=0.02)


def test_calibration_reads_policy_tokens_turns_and_the_tool_latency_of_an_episode_run(tmp_path):
    run = tmp_path / "never-stop"
    run.mkdir()
    steps = [a_step(step=i, lengths=[50, 30], turns=[3, 1], env_lengths=[20, 0], env_tokens=20) for i in (1, 2, 3)]
    write_lines(run / "metrics.jsonl", steps)
    write_lines(run / "serve-metrics.jsonl", [an_update()])
    (run / "run-config.json").write_text(
        json.dumps(
            {
                "group_size": 2,
                "groups_per_step": 1,
                "admit_lag": 1,
                "serve_args": "--tool-latency lognormal:1.0,1.0 --max-turns 3",
            }
        )
    )
    c = calibrate(tmp_path, None)
    assert c.lengths[:2] == [30, 30] and c.turns[:2] == [3, 1] and c.tool == "lognormal:1.0,1.0"
