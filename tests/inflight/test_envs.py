"""Environments without an engine: the calculator's whitelist, loading `--env`, the shape checks on what an
environment answers, and the chat turns rendered as the tokens a conversation appends."""

from __future__ import annotations

from fractions import Fraction

import pytest

from inflight.envs.base import EnvError, EpisodeState, Feedback, check_feedback, check_messages
from inflight.envs.calculator import CalcError, Calculator, evaluate, show
from inflight.envs.loading import SingleTurn, load_env
from inflight.tasks.arithmetic import ArithmeticTask
from inflight.tasks.base import Problem


@pytest.mark.parametrize(("expression", "value"), [
    ("1 + 2 * 3", "7"), ("(4 + 5) / 2", "4.5"), ("0.1 + 0.2", "0.3"), ("2 ** 10", "1024"), ("-(3 - 10)", "7"),
    ("7 // 2", "3"), ("3 × 4 ÷ 6", "2"), ("2^3", "8"), ("1 / 3", "0.333333"),
])  # fmt: skip
def test_the_calculator_computes_arithmetic_exactly(expression: str, value: str):
    assert show(evaluate(expression)) == value


@pytest.mark.parametrize(("expression", "reason"), [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("(1).real", "Attribute is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("'a' * 3", "Constant is not allowed"),
    ("[1, 2]", "List is not allowed"),
    ("9 ** 9 ** 9", "exponents must be whole numbers"),
    ("10 ** 16 * 10", "larger than"),
    ("99999 ** 16", "larger than"),
    ("1e999", "larger than"),
    ("1 / 0", "division by zero"),
    ("1 +", "not an arithmetic expression"),
    ("1" + "+1" * 100, "longer than"),
    ("1+" * 40 + "1", "more than"),
])  # fmt: skip
def test_the_calculator_refuses_everything_but_bounded_arithmetic(expression: str, reason: str):
    with pytest.raises(CalcError, match=reason):
        evaluate(expression)


def test_a_huge_power_is_refused_before_it_is_computed():
    import time

    start = time.perf_counter()
    with pytest.raises(CalcError):
        evaluate("999999999 ** 16")
    assert time.perf_counter() - start < 0.1
    assert evaluate("10 ** 15") == Fraction(10**15)


def test_the_calculator_environment_answers_a_call_with_its_result_and_a_final_answer_ends_the_episode():
    env = Calculator(max_calls=1)
    problem = Problem("p", "What is 2 * 21?", 42)
    messages = env.reset(problem)
    assert messages[0]["role"] == "system" and "<calc>" in messages[0]["content"] and messages[1]["role"] == "user"
    state = EpisodeState(problem, messages)
    first = env.step(state, "Let me compute. <calc>2 * 21</calc>")
    assert first == Feedback([{"role": "user", "content": "<result>42</result>"}])
    refused = env.step(state, "<calc>1 + 1</calc>")  # a second call with max_calls=1
    assert "no calls left" in refused.messages[0]["content"] and refused.tool_errors == 1 and not refused.done
    bad = Calculator().step(EpisodeState(problem, messages), "<calc>__import__('os')</calc>")
    assert bad.messages[0]["content"].startswith("<result>error: Call is not allowed") and bad.tool_errors == 1
    assert env.step(state, "The answer is 42.").done


def test_the_calculator_puts_its_instructions_into_the_tasks_own_system_message():
    problem = Problem(
        "p", "q", 1, messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"})
    )
    messages = Calculator().reset(problem)
    assert [m["role"] for m in messages] == ["system", "user"] and messages[0]["content"].endswith("Be brief.")


def test_single_turn_is_the_tasks_prompt_and_one_turn():
    problem = Problem("p", "What is 1 + 1?", 2)
    assert SingleTurn().reset(problem) == problem.chat()
    assert SingleTurn().step(EpisodeState(problem, []), "2").done


@pytest.mark.parametrize(("spec", "args", "message"), [
    ("nope", "", "expected one of"),
    ("no_such_module_xyz:Env", "", "could not be loaded"),
    ("calculator", "{bad json", "not JSON"),
    ("calculator", "[1]", "JSON object"),
    ("calculator", '{"max_calls": 0}', "max_calls is 0"),
    ("calculator", '{"colour": 1}', "refused env_args"),
    ("inflight.tasks.base:Problem", "", "refused env_args"),
])  # fmt: skip
def test_a_bad_env_or_env_args_is_refused_naming_the_flag(spec: str, args: str, message: str):
    with pytest.raises(ValueError, match=message):
        load_env(spec, args)


def test_a_serve_config_with_a_bad_env_is_refused_before_the_engine_starts():
    from inflight.serve.config import ServeConfig

    with pytest.raises(ValueError, match="env is 'calc'"):
        ServeConfig(env="calc").validate()


@pytest.mark.parametrize(("value", "message"), [
    ("text", "expected inflight.envs.base.Feedback"),
    (Feedback([{"role": "robot", "content": "x"}]), "message 0"),
    (Feedback([{"role": "user", "content": 3}]), "message 0"),
    (Feedback(reward=float("nan")), "finite number"),
    (Feedback(reward=True), "finite number"),
])  # fmt: skip
def test_feedback_an_episode_cannot_use_is_refused_naming_what_is_wrong(value, message: str):
    with pytest.raises(EnvError, match=message):
        check_feedback(value)
    with pytest.raises(EnvError, match="expected a list"):
        check_messages("hello", "reset")


def test_multi_step_arithmetic_follows_precedence_and_two_terms_draw_the_old_stream():
    old = [(p.question, p.answer) for p in ArithmeticTask(3, 20).take(5)]
    assert old == [(p.question, p.answer) for p in ArithmeticTask(3, 20, terms=2).take(5)]
    for p in ArithmeticTask(1, 20, ops=("+", "-", "*"), terms=4).take(50):
        expression = p.question.removeprefix("What is ").split("?")[0]
        assert evaluate(expression) == p.answer


def test_environment_messages_become_exactly_the_ids_the_chat_template_appends(model_dirs):
    from transformers import AutoTokenizer

    from inflight.serve.episodes import TurnTokens

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["tiny-qwen2"])
    turns = TurnTokens(tokenizer)
    first = [{"role": "user", "content": "What is 2 + 3?"}]
    tool = [{"role": "user", "content": "<result>5</result>"}]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = tokenizer.encode("<calc>2+3</calc>", add_special_tokens=False)
    for turn in (call + [end], call):  # ended on the end-of-turn token, or on the stop string (no end token)
        appended = turns.env_ids(turn, tool)
        whole = turns.prompt_ids([*first, {"role": "assistant", "content": "<calc>2+3</calc>"}, *tool])
        if turn[-1] == end:
            assert turns.prompt_ids(first) + turn + appended == whole
        assert tokenizer.decode(appended).startswith("<|im_end|>" if turn[-1] != end else "\n<|im_start|>user")
        assert tokenizer.decode(appended).endswith("<|im_start|>assistant\n")


def test_with_retries_a_wrong_final_answer_is_told_to_try_again_and_a_right_one_ends_the_episode():
    env = Calculator(retries=1)
    problem = Problem("p", "What is 2 * 21?", 42)
    state = EpisodeState(problem, env.reset(problem))
    again = env.step(state, "41")
    assert not again.done and "not right" in again.messages[0]["content"]
    assert env.step(state, "40").done  # its one retry used
    assert Calculator(retries=1).step(EpisodeState(problem, []), "It is 42.").done


def test_the_environments_guide_example_loads_with_env_args_and_runs_an_episode(tmp_path, monkeypatch):
    import asyncio
    import re
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    (code,) = re.findall(r"```python\n(# my_envs\.py\n.*?)```", guide, re.DOTALL)
    assert len(code.splitlines()) <= 32, "the environments guide promises a complete example of about 30 lines"
    (tmp_path / "my_envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_env("my_envs:Lookup", '{"table": {"Paris": "France"}}')
    problem = Problem("p", "Which country is Paris in?", "France")
    state = EpisodeState(problem, env.reset(problem))
    found = asyncio.run(env.step(state, "<lookup>paris</lookup>"))
    assert found.messages == [{"role": "user", "content": "<value>France</value>"}] and found.tool_errors == 0
    assert asyncio.run(env.step(state, "<lookup>Rome</lookup>")).tool_errors == 1
    assert asyncio.run(env.step(state, "France")).done
