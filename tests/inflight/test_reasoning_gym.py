"""`--task reasoning-gym:<dataset>[,...]` with the real reasoning-gym package: loading, seeds, options, scoring."""

from __future__ import annotations

import asyncio
import json
from itertools import islice

import pytest
from serve_support import TEST_KV_GIB, ServeProcess

from inflight.tasks.loading import load_reward, load_task
from inflight.tasks.reasoning_gym import TaskFileError, extract_answer, reward_fn

pytest.importorskip("reasoning_gym", reason="the envs extra: pip install 'inflight[envs]'")

TWO = "reasoning-gym:basic_arithmetic,chain_sum"


def first(spec: str, seed: int, n: int = 32, **kw) -> list:
    task, _ = load_task(spec, seed=seed, **kw)
    return list(islice(task, n))


def test_one_dataset_loads_its_problems_with_the_dataset_score_as_the_default_reward():
    task, default = load_task("reasoning-gym:basic_arithmetic", seed=0, task_args='{"size": 50}')
    problems = list(islice(task, 50))
    assert default == "inflight.tasks.reasoning_gym:reward_fn"
    assert len({p.id for p in problems}) == 50  # one pass: every index once
    assert all(p.columns["metadata"]["source_dataset"] == "basic_arithmetic" for p in problems)
    assert all(p.question.startswith("Calculate") and isinstance(p.answer, str) for p in problems)
    assert {p.id for p in islice(task, 50, 100)} == {p.id for p in problems}  # the next pass: the same problems


def test_two_datasets_are_mixed_and_each_problem_is_scored_by_its_own_dataset():
    problems = first(TWO, seed=3, n=60, task_args='{"size": 60, "weights": {"chain_sum": 2}}')
    sources = [p.columns["metadata"]["source_dataset"] for p in problems]
    assert {"basic_arithmetic", "chain_sum"} == set(sources)
    assert sources.count("chain_sum") > sources.count("basic_arithmetic")  # weight 2 against 1
    for p in problems[:10]:
        assert reward_fn(p.answer, p) == 1.0


def test_the_same_seed_gives_the_same_problems_in_the_same_order_and_another_seed_other_problems():
    a, b, c = first(TWO, seed=7), first(TWO, seed=7), first(TWO, seed=8)
    assert [(p.id, p.question, p.answer) for p in a] == [(p.id, p.question, p.answer) for p in b]
    assert not {p.question for p in a} & {p.question for p in c}


def test_the_eval_seed_draws_held_out_problems():
    # The serve loads --eval-task at task seed + 1000, unshuffled (inflight/serve/eval.py:load_eval_problems).
    train = first("reasoning-gym:basic_arithmetic", seed=0, n=500, task_args='{"size": 500}')
    held_out = first("reasoning-gym:basic_arithmetic", seed=1000, n=64, shuffle=False)
    assert [p.id for p in held_out] == [f"rg-basic_arithmetic-1000-{i}" for i in range(64)]  # its first ones, in order
    assert not {p.question for p in train} & {p.question for p in held_out}
    nearest = first("reasoning-gym:basic_arithmetic", seed=1, n=64, shuffle=False)  # even the next seed
    assert not {p.question for p in train} & {p.question for p in nearest}


def test_a_right_answer_scores_1_and_wrong_ones_less_through_the_loaded_reward():
    problem = first("reasoning-gym:chain_sum", seed=0, n=1)[0]
    score = load_reward("inflight.tasks.reasoning_gym:reward_fn")
    right = asyncio.run(score(f"Let me add. <answer>{problem.answer}</answer>", problem))
    wordy = asyncio.run(score(f"The total is {problem.answer}", problem))
    off_by_one = asyncio.run(score(f"<answer>{int(problem.answer) + 1}</answer>", problem))
    none = asyncio.run(score("<answer>no idea</answer>", problem))
    assert right == 1.0 and 0.0 < wordy < 1.0 and off_by_one < 1.0 and none == 0.0


def test_the_answer_is_the_last_answer_tag_else_the_whole_completion():
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer("  7\n") == "7"
    assert extract_answer("<answer>unclosed 3") == "<answer>unclosed 3"


def test_a_dataset_config_shapes_the_problems():
    config = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"], "allow_parentheses": False}
    args = json.dumps({"size": 40, "datasets": {"basic_arithmetic": config}})
    for p in first("reasoning-gym:basic_arithmetic", seed=0, n=40, task_args=args):
        left, right = p.question.removeprefix("Calculate ").rstrip(".").split(" + ")
        assert int(p.answer) == int(left) + int(right) and abs(int(left)) <= 10


def test_the_serve_hands_task_args_to_its_training_problems_and_its_held_out_eval():
    from inflight.serve.app import load_work
    from inflight.serve.config import ServeConfig

    config = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"], "allow_parentheses": False}
    args = json.dumps({"size": 40, "datasets": {"basic_arithmetic": config}})
    spec = "reasoning-gym:basic_arithmetic"
    cfg = ServeConfig(task=spec, task_args=args, eval_task=spec, eval_every=1, eval_problems=20)
    work = load_work(cfg)
    for problem in [*islice(work.problems, 20), *work.held_out]:
        assert " + " in problem.question and "-" not in problem.question.removeprefix("Calculate ")


@pytest.mark.parametrize(
    ("spec", "args", "match"),
    [
        ("reasoning-gym:no_such_set", "", "unknown: \\['no_such_set'\\]"),
        ("reasoning-gym:", "", "expected reasoning-gym:<dataset>"),
        ("reasoning-gym:chain_sum", '{"sizes": 3}', "keys from"),
        ("reasoning-gym:chain_sum", '{"size": 70000}', "size is 70000"),
        ("reasoning-gym:chain_sum", '{"datasets": {"chain_sum": {"seed": 1}}}', "without seed or size"),
        ("reasoning-gym:chain_sum", '{"datasets": {"chain_sum": {"no_field": 1}}}', "refused the config"),
        ("reasoning-gym:chain_sum", '{"weights": {"gcd": 1}}', "keyed by the --task datasets"),
        ("reasoning-gym:chain_sum", "{size: 1}", "not JSON"),
        ("arithmetic", '{"size": 1}', "takes no options"),
    ],
)
def test_bad_specs_and_options_are_refused_naming_the_flag(spec, args, match):
    with pytest.raises(TaskFileError, match=match):
        load_task(spec, seed=0, task_args=args)


def test_a_missing_reasoning_gym_is_refused_with_the_install_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an environment without the package imports
    with pytest.raises(TaskFileError, match=r"--task reasoning-gym:chain_sum needs .*pip install 'inflight\[envs\]'"):
        load_task("reasoning-gym:chain_sum", seed=0)


@pytest.mark.engine
def test_a_reasoning_gym_task_trains_end_to_end_through_inflight_run_scored_by_its_dataset_and_math(tmp_path):
    # SmolLM2 on chain_sum, two steps of one group: rollouts through the real serve, rewards, sockets and loss. Two
    # rewards (the dataset's own score and --reward math, both in the serve's worker threads), and a held-out eval.
    run_dir = tmp_path / "rg"
    serve_args = (
        f"--progress-s 1 --kv-cache-gib {TEST_KV_GIB} --eval-task reasoning-gym:chain_sum --eval-every 1 "
        "--eval-problems 4"
    )
    flags = f"--run-dir {run_dir} --steps 2 --model smollm2 --task reasoning-gym:chain_sum --group-size 4"
    flags += " --groups-per-step 1 --max-tokens 12 --reward inflight.tasks.reasoning_gym:reward_fn,math"
    launcher = ServeProcess([*flags.split(), "--serve-args", serve_args], module="inflight.run")
    try:
        launcher.proc.wait(600)
    finally:
        launcher.stop()
    assert launcher.proc.returncode == 0, launcher.tail()
    assert json.loads((run_dir / "serve-config.json").read_text())["task"] == "reasoning-gym:chain_sum"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["tokens"] > 0 for s in steps)
    events = [json.loads(line) for line in (run_dir / "serve-metrics.jsonl").read_text().splitlines()]
    last = [e for e in events if e["event"] == "progress"][-1]
    assert set(last["reward_means"]) == {"reward_fn", "math"} and last.get("reward_errors", 0) == 0
    assert all(0.0 <= m <= 1.0 for m in last["reward_means"].values())
    evals = [e for e in events if e["event"] == "eval"]
    assert evals and evals[0]["task"] == "reasoning-gym:chain_sum" and evals[0]["n"] == 4
