"""`--reward math` with the real math-verify, scored the way the serve scores: in worker threads, never raising."""

from __future__ import annotations

import asyncio
import time

import pytest

from inflight.tasks.base import Problem
from inflight.tasks.rewards import load_rewards, score_group

pytest.importorskip("math_verify", reason="the envs extra: pip install 'inflight[envs]'")


def scores(answer: str, completions: list[str]) -> list[float]:
    """Each completion's `--reward math` score against `answer`, through the serve's scoring path."""
    rewards = load_rewards("math")
    return asyncio.run(score_group(rewards, Problem("p0", "q", answer), completions)).total


@pytest.mark.parametrize(
    ("answer", "completion"),
    [
        (r"\frac{1}{2}", "0.5"),
        ("0.5", r"So the probability is $\frac{1}{2}$."),
        ("42", r"Adding them up gives \boxed{42}"),
        (r"\boxed{42}", "42"),
        ("42", "The answer is 42."),
        ("1000", "1,000"),
        ("-7", "x = -7"),
        (r"\sqrt{2}", r"\boxed{2^{1/2}}"),
    ],
)
def test_equal_answers_in_latex_or_plain_score_1(answer, completion):
    assert scores(answer, [completion]) == [1.0]


@pytest.mark.parametrize(
    ("answer", "completion"),
    [
        ("42", "41"),
        ("42", r"\boxed{43}"),
        (r"\frac{1}{2}", "0.25"),
        ("42", "!!@@ ##"),  # nothing parseable
        ("42", ""),
    ],
)
def test_wrong_or_garbage_answers_score_0(answer, completion):
    assert scores(answer, [completion]) == [0.0]


def test_the_boxed_answer_wins_over_a_later_number():
    assert scores("4", [r"I guess \boxed{4}, not 3"]) == [1.0]
    assert scores("3", [r"I guess \boxed{4}, not 3"]) == [0.0]


def test_the_builtin_name_keys_the_metrics_and_a_group_is_scored_from_worker_threads():
    rewards = load_rewards("math")
    assert [(r.name, r.convention) for r in rewards] == [("math", "sample")]
    result = asyncio.run(score_group(rewards, Problem("p1", "q", "0.5"), [r"$\frac{1}{2}$", "1/2", "0.4", "zzz"] * 4))
    assert result.each["math"] == [1.0, 1.0, 0.0, 0.0] * 4 and result.errors == 0


def test_a_check_too_slow_for_its_alarm_scores_0_and_the_reward_goes_on():
    start = time.monotonic()
    assert scores("9", [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{9}"]) == [0.0, 1.0]
    assert time.monotonic() - start < 20


def test_a_stuck_checker_is_killed_its_sample_scores_0_counted_and_the_next_check_works(monkeypatch):
    from inflight.tasks import math_reward

    monkeypatch.setattr(math_reward, "HARD_LIMIT_S", 0.5)
    verifier = math_reward.VERIFIER
    verifier.check("1", "1")  # a child is running
    child = verifier._child
    child.send_signal(19)  # SIGSTOP: a child that never answers, as one stuck in C code
    result = asyncio.run(score_group(load_rewards("math"), Problem("p2", "q", "2"), ["2"]))
    assert result.total == [0.0] and result.errors == 1
    assert child.poll() is not None  # killed, not left behind
    assert scores("2", ["2"]) == [1.0]  # a new child answers


def test_a_missing_math_verify_is_refused_with_the_install_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ValueError, match=r"--reward 'math' needs the math_verify package: pip install 'inflight\[envs"):
        load_rewards("math")
