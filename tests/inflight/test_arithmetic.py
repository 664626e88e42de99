"""The arithmetic task: seeded determinism and exactly what the reward counts as correct. No engine."""

from __future__ import annotations

import pytest

from inflight.tasks.arithmetic import ArithmeticTask, last_number, reward, reward_fn
from inflight.tasks.base import Problem


def test_same_seed_yields_the_same_problems():
    assert ArithmeticTask(seed=3).take(50) == ArithmeticTask(seed=3).take(50)


def test_iterating_twice_restarts_the_stream():
    task = ArithmeticTask(seed=3, ops=("+", "-", "*"))
    assert task.take(20) == task.take(20)


def test_different_seeds_yield_different_problems():
    assert ArithmeticTask(seed=0).take(20) != ArithmeticTask(seed=1).take(20)


def test_problem_ids_are_unique_and_name_seed_and_position():
    problems = ArithmeticTask(seed=7).take(100)
    assert len({p.id for p in problems}) == 100
    assert problems[4].id == "arith-7-4"


@pytest.mark.parametrize("ops", [("+",), ("-",), ("*",), ("+", "-", "*")])
def test_answers_match_the_question_and_operands_stay_in_range(ops):
    for p in ArithmeticTask(seed=5, max_operand=12, ops=ops).take(200):
        expr = p.question.removeprefix("What is ").removesuffix("? Reply with only the number.")
        a, op, b = expr.split(" ")
        assert op in ops and 0 <= int(a) <= 12 and 0 <= int(b) <= 12
        assert p.answer == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_all_requested_ops_are_drawn():
    assert {p.question.split(" ")[3] for p in ArithmeticTask(seed=0, ops=("+", "-", "*")).take(100)} == {"+", "-", "*"}


@pytest.mark.parametrize("kwargs", [{"max_operand": 0}, {"ops": ()}, {"ops": ("/",)}, {"ops": ("+", "**")}])
def test_bad_config_is_refused_naming_the_field(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ArithmeticTask(seed=0, **kwargs)


@pytest.mark.parametrize(
    "text, answer",
    [
        ("7", 7),
        ("7.", 7),
        ("The answer is 7", 7),
        ("The answer is 7.", 7),
        ("3 + 4 = 7", 7),  # the last number wins, the operands in an echoed question do not count
        ("I think 5, no wait, 7", 7),
        ("-4", -4),
        ("3 - 7 = -4", -4),
        ("The result is -12.", -12),
        ("1,234", 1234),
        ("That makes 1,000,000 exactly.", 1000000),
        ("7.0", 7),
        ("  \n 7\n", 7),
        ("Answer: **7**", 7),
        ("x=-3", -3),
    ],
)
def test_reward_is_one_when_the_last_number_equals_the_answer(text, answer):
    assert reward(text, answer) == 1.0


@pytest.mark.parametrize(
    "text, answer",
    [
        ("", 7),
        ("seven", 7),
        ("I don't know.", 0),
        ("8", 7),
        ("7 is wrong, it is 8", 7),  # the right number earlier does not count
        ("7 apples, 2 pears", 7),
        ("4", -4),  # the sign matters
        ("10-3", -3),  # a minus directly after a digit is an operator, not a sign
        ("7.5", 7),  # a decimal is one number, not 7 followed by 5
        ("7.5", 5),
        ("3,4", 34),  # a comma not grouping thousands separates two numbers
        ("12,34", 1234),
        ("١٢", 12),  # only ASCII digits are numbers
    ],
)
def test_reward_is_zero_otherwise(text, answer):
    assert reward(text, answer) == 0.0


def test_comma_not_in_thousands_groups_separates_numbers():
    assert last_number("3,4") == 4
    assert last_number("1,2345") == 2345
    assert last_number("no digits") is None


def test_reward_fn_scores_against_the_problem_answer():
    problem = Problem("arith-0-0", "What is 3 + 4? Reply with only the number.", 7)
    assert reward_fn("7", problem) == 1.0
    assert reward_fn("6", problem) == 0.0
