"""Serve's task, reward and tool-latency flags: what loads, and the errors that name the flag."""

from __future__ import annotations

import asyncio
import json
import statistics

import pytest

from inflight.serve.latency import parse_latency
from inflight.tasks.jsonl import JsonlTask, TaskFileError, reward_fn
from inflight.tasks.loading import load_reward, load_task


def test_jsonl_task_cycles_and_default_reward_handles_numbers_and_text(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a?", "answer": 12}) + "\n" + json.dumps({"prompt": "b?", "answer": "yes"}))
    task, default = load_task(f"jsonl:{path}", seed=0)
    problems = [p for _, p in zip(range(4), task, strict=False)]
    assert sorted({p.question for p in problems}) == ["a?", "b?"] and default == "inflight.tasks.jsonl:reward_fn"
    assert reward_fn("it is 12", problems[[p.answer for p in problems].index(12)]) == 1.0
    assert reward_fn(" yes ", next(p for p in problems if p.answer == "yes")) == 1.0


def test_bad_prompt_files_and_specs_are_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(TaskFileError, match="answer"):
        JsonlTask(bad)
    with pytest.raises(TaskFileError, match="does not exist"):
        JsonlTask(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="--task"):
        load_task("gsm8k", seed=0)
    with pytest.raises(ValueError, match="--reward"):
        load_reward("no_colon")
    with pytest.raises(ValueError, match="could not be imported"):
        load_reward("inflight.tasks.arithmetic:nope")


def test_sync_and_async_rewards_load_as_coroutines():
    task, default = load_task("arithmetic", seed=3)
    problem = next(iter(task))
    score = load_reward(default)
    assert asyncio.run(score(f"The answer is {problem.answer}", problem)) == 1.0


def test_tool_latency_is_long_tailed_and_seeded():
    draw = parse_latency("lognormal:0.5,1.0", seed=1)
    xs = [draw() for _ in range(4000)]
    assert statistics.median(xs) == pytest.approx(0.5, rel=0.1)
    assert max(xs) > 10 * statistics.median(xs)  # the tail that stalls synchronous RL
    again = parse_latency("lognormal:0.5,1.0", seed=1)
    assert [again() for _ in range(5)] == xs[:5]
    assert min(parse_latency("pareto:0.2,1.5")() for _ in range(100)) >= 0.2
    for spec in ("lognormal:0.5", "weibull:1,2", "pareto:-1,2"):
        with pytest.raises(ValueError, match="--tool-latency"):
            parse_latency(spec)
