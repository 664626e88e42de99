"""Rewards: both conventions told apart by signature, weighted combination with None as "not applicable", failures
counted and never raised, the constant-reward warning, and per-reward means in a real serve's progress lines."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from serve_support import ServeProcess

from inflight.tasks.arithmetic import ArithmeticTask
from inflight.tasks.base import Problem
from inflight.tasks.rewards import (
    ConstantRewardWatch,
    GroupScores,
    Reward,
    RewardMeans,
    convention_of,
    load_rewards,
    score_group,
)
from inflight.wire.records import ServeProgress, read_serve_events

PROBLEM = Problem("p0", "What is 2 + 2?", 4, columns={"question": "What is 2 + 2?", "answer": 4, "source": "mine"})


def legacy(completion_text, problem):
    return 1.0


def trl(prompts, completions, **kwargs):
    return [1.0] * len(completions)


def trl_kwargs_only(*args, **kwargs):
    return [1.0] * len(args[1])


def three_required(a, b, c):
    return 1.0


def test_the_convention_is_told_by_signature_and_an_unclear_one_names_the_override():
    assert convention_of(legacy, "m:legacy") == "sample"
    assert convention_of(trl, "m:trl") == "group" and convention_of(trl_kwargs_only, "m:k") == "group"
    assert convention_of(lambda text, problem, strict=True: 1.0, "m:l") == "sample"
    with pytest.raises(ValueError, match="--reward-convention group|sample"):
        convention_of(three_required, "m:three_required")
    assert [r.convention for r in load_rewards("test_rewards:three_required", convention="sample")] == ["sample"]


def test_weights_must_match_the_rewards_one_for_one():
    rewards = load_rewards("test_rewards:legacy,test_rewards:trl", "1.0,0.5")
    assert [(r.name, r.convention, r.weight) for r in rewards] == [("legacy", "sample", 1.0), ("trl", "group", 0.5)]
    for weights in ("1.0", "1,2,3", "1,x", "1,nan"):
        with pytest.raises(ValueError, match="--reward-weights"):
            load_rewards("test_rewards:legacy,test_rewards:trl", weights)
    assert [r.name for r in load_rewards("test_rewards:legacy,serve_rewards:text_length")] == ["legacy", "text_length"]


def test_none_is_left_out_of_the_weighted_sum_and_of_that_rewards_mean():
    def half(prompts, completions, **kw):
        return [0.5, None, 1.0]

    def answer_seen(text, problem):
        return float(problem.columns["source"] == "mine")

    scores = asyncio.run(score_group([Reward("half", half, "group", 2.0), Reward("seen", answer_seen, "sample", 0.5)],
                                     PROBLEM, ["a", "b", "c"]))  # fmt: skip
    assert scores.total == [2.0 * 0.5 + 0.5, 0.5, 2.0 * 1.0 + 0.5] and scores.errors == 0
    means = RewardMeans()
    means.add(scores)
    assert means.means() == {"half": 0.75, "seen": 1.0}


@pytest.mark.parametrize("bad", [
    lambda prompts, completions, **kw: [1.0],  # wrong length
    lambda prompts, completions, **kw: None,
    lambda prompts, completions, **kw: [1.0, "1.0"],
    lambda prompts, completions, **kw: [1.0, math.nan],
    lambda prompts, completions, **kw: 1 / 0,
])  # fmt: skip
def test_a_group_reward_that_fails_scores_its_group_zero_and_is_counted_never_raised(bad, caplog):
    good = Reward("good", lambda text, problem: 1.0, "sample", 1.0)
    scores = asyncio.run(score_group([good, Reward("bad", bad, "group")], PROBLEM, ["a", "b"]))
    assert scores.total == [1.0, 1.0] and scores.each["bad"] == [0.0, 0.0] and scores.errors == 1
    assert "reward bad failed" in caplog.text


def test_a_sample_reward_that_raises_or_returns_none_scores_zero_and_is_counted():
    values = iter([RuntimeError("boom"), None, 0.25])

    def flaky(text, problem):
        value = next(values)
        if isinstance(value, Exception):
            raise value
        return value

    scores = asyncio.run(score_group([Reward("flaky", flaky, "sample")], PROBLEM, ["a", "b", "c"]))
    assert sorted(scores.total) == [0.0, 0.0, 0.25] and scores.errors == 2


def test_a_reward_constant_for_n_steps_warns_once_naming_the_likely_cause():
    watch = ConstantRewardWatch(groups_per_step=2, steps=3)
    zero = GroupScores(total=[0.0, 0.0], each={"gsm": [0.0, 0.0], "fmt": [1.0, 0.0]})
    warnings = [w for _ in range(2 * 3) for w in watch.add(zero)]
    assert len(warnings) == 1 and "reward gsm was 0.0" in warnings[0] and "####" in warnings[0]
    assert [w for _ in range(20) for w in watch.add(zero)] == []  # once
    ones = ConstantRewardWatch(groups_per_step=1, steps=2)
    out = [w for s in (1.0, 1.0) for w in ones.add(GroupScores([s], {"r": [s]}))]
    assert len(out) == 1 and "zero advantage" in out[0]
    varied = ConstantRewardWatch(groups_per_step=1, steps=2)
    assert [w for s in (0.0, 1.0, 0.0) for w in varied.add(GroupScores([s], {"r": [s]}))] == []


GROUP, GROUPS, MAX_TOKENS = 4, 3, 8


@pytest.mark.engine
def test_two_weighted_rewards_give_the_records_and_progress_means_a_hand_computation_gives(model_dirs, tmp_path):
    from inflight.wire.control import Agreed, Ask, ControlServer
    from inflight.wire.rollouts import RolloutReceiver

    rx, ctl, metrics = RolloutReceiver(hwm=1), ControlServer(), tmp_path / "serve-metrics.jsonl"
    serve = ServeProcess([
        "--model", str(model_dirs["tiny-qwen2"]), "--rollouts", rx.address, "--control", ctl.address,
        "--wait-for-learner", "false", "--group-size", str(GROUP), "--admit-lag", "0", "--groups-per-step", str(GROUPS),
        "--max-tokens", str(MAX_TOKENS), "--reward", "serve_rewards:answer_tenth,serve_rewards:share_if_odd_answer",
        "--reward-weights", "1.0,0.5", "--metrics", str(metrics),
    ])  # fmt: skip
    try:
        rollouts, deadline = [], time.monotonic() + 240
        while len(rollouts) < GROUP * GROUPS:
            assert time.monotonic() < deadline and serve.proc.poll() is None, serve.tail()
            rollouts += rx.receive(timeout_s=0.2)
            for identity, message in ctl.poll(0):  # heartbeats: this learner answers only the serve's Ask
                if isinstance(message, Ask):
                    ctl.send(identity, Agreed())
        # Nothing is consumed, so the learner gate stops admission after GROUPS groups and the serve keeps reporting.
        serve.wait_for("| sent 12 |", timeout_s=30)  # a progress line after every rollout was made
    finally:
        assert serve.stop() == 0, serve.tail()
    answers = {p.id: p.answer for p in ArithmeticTask(0, max_operand=20).take(GROUPS)}
    tenth = [answers[r.problem_id] / 10 for r in rollouts]
    share = [len(r.completion) / 8 if answers[r.problem_id] % 2 else None for r in rollouts]
    for r, a, b in zip(rollouts, tenth, share, strict=True):
        assert r.reward == pytest.approx(a + 0.5 * (b or 0.0))
    last = [e for e in read_serve_events(metrics) if isinstance(e, ServeProgress)][-1]
    assert last.rollouts_sent == GROUP * GROUPS and last.reward_errors == 0
    assert last.mean_reward == pytest.approx(sum(r.reward for r in rollouts) / len(rollouts))
    odd = [b for b in share if b is not None]  # answers 25, 24, 21: the second group is "not applicable"
    assert 0 < len(odd) < len(share)
    expected = {"answer_tenth": sum(tenth) / len(tenth), "share_if_odd_answer": sum(odd) / len(odd)}
    assert last.reward_means == pytest.approx(expected)
    shown = f"(answer_tenth {expected['answer_tenth']:.3f}, share_if_odd_answer {expected['share_if_odd_answer']:.3f})"
    assert any(shown in line for line in serve.lines), serve.tail()  # the means on the stderr progress line too


def test_a_broken_reward_logs_its_first_failure_with_the_traceback_then_only_the_10th_and_100th(caplog):
    def broken(text, problem):
        raise KeyError("no such column")

    reward = Reward("broken", broken, "sample")
    for _ in range(25):  # 25 groups of 4: 100 failures, each scored 0 and counted
        scores = asyncio.run(score_group([reward], PROBLEM, ["a", "b", "c", "d"]))
        assert scores.total == [0.0] * 4 and scores.errors == 4
    lines = [r for r in caplog.records if r.name == "inflight.rewards"]
    assert [r.getMessage().split(" (")[0].split(",")[0] for r in lines] == [
        f"reward broken failed on {PROBLEM.id}",
        "reward broken has failed 10 times",
        "reward broken has failed 100 times",
    ]
    assert lines[0].exc_info is not None and "KeyError" in caplog.text and reward.failures == 100
