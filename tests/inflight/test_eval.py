"""Held-out eval between groups (`--eval-task`, `--eval-every`): on the real engine, with weight versions pushed as
the learner pushes them, each eval is scored by the version it names and by no other."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from inflight.serve.config import ServeConfig
from inflight.wire.records import EvalResult, read_serve_events


class Outbox:
    """The rollout stream's surface the driver uses; records are kept, never sent."""

    def __init__(self):
        self.outbox, self.retained_records, self.sent, self.resent, self.records = [], 0, 0, 0, []

    def offer(self, record: bytes, group_id: str) -> None:
        self.records.append(record)


@pytest.mark.engine
def test_eval_every_2_scores_the_held_out_split_at_versions_2_and_4_each_by_the_version_it_names(model_dirs, tmp_path):
    from support import Sender, start_engine, stop_engine
    from transformers import AutoTokenizer

    from inflight.serve.driver import RolloutDriver
    from inflight.serve.eval import Evaluation, load_eval_problems
    from inflight.serve.progress import ProgressReporter
    from inflight.tasks.rewards import load_rewards

    held_out = tmp_path / "test.jsonl"
    held_out.write_text("".join(json.dumps({"question": f"What is {a} + 1?", "answer": a + 1}) + "\n"
                                for a in range(3)))  # fmt: skip
    model = model_dirs["tiny-qwen2"]
    cfg = ServeConfig(model=str(model), wait_for_learner=False, group_size=2, max_groups=1, max_tokens=6,
                      admit_lag=-1, eval_task=f"jsonl:{held_out}", eval_every=2, prompt_key="question")  # fmt: skip
    cfg.validate()
    rewards = load_rewards("serve_rewards:text_length,inflight.tasks.jsonl:reward_fn", "1.0,1.0")
    loop = asyncio.new_event_loop()
    engine = start_engine(loop, model)
    sender = Sender()
    try:
        loop.run_until_complete(sender.connect(engine))
        tokenizer = AutoTokenizer.from_pretrained(model)
        driver = RolloutDriver(engine, cfg, [], rewards, Outbox(), tokenizer)
        driver._problems = iter(load_eval_problems(cfg) * 10)  # training problems: any will do
        reporter = ProgressReporter(driver, str(tmp_path / "serve-metrics.jsonl"), 1.0)
        driver.evaluation = Evaluation(engine, cfg, load_eval_problems(cfg), rewards, tokenizer, driver.server_id,
                                       reporter.eval_result)  # fmt: skip
        loop.run_until_complete(_push_versions(loop, driver, engine, sender, model, tmp_path))
    finally:
        stop_engine(loop, engine)
        loop.close()
    evals = [e for e in read_serve_events(tmp_path / "serve-metrics.jsonl") if isinstance(e, EvalResult)]
    assert [e.version for e in evals] == [2, 4]
    for e in evals:
        assert e.versions == [e.version] and e.n == 3 and e.temperature == 0.0  # greedy, one version's tokens only
        assert set(e.reward_means) == {"text_length", "reward_fn"} and e.reward_errors == 0
        assert e.mean_reward == pytest.approx(sum(e.reward_means.values()))  # weights 1 + 1, no None
        assert 0.0 <= e.accuracy <= 1.0 and e.task == f"jsonl:{held_out}"


async def _push_versions(loop, driver, engine, sender, model, tmp_path) -> None:
    """Versions 1..4 as a learner publishes them; after each even one, wait for its eval before the next push."""
    from support import perturbed_checkpoint

    run = asyncio.create_task(driver.run())
    try:
        for version in range(1, 5):
            state = perturbed_checkpoint(model, tmp_path / f"v{version}", seed=version)
            await sender.push(engine, state, version)
            driver.notify()  # what the control client does after a commit
            if version % 2 == 0:
                deadline = time.monotonic() + 120
                while len(driver.evaluation.results) < version // 2:
                    assert time.monotonic() < deadline and not run.done(), "no eval after the commit"
                    await asyncio.sleep(0.1)
            else:
                await asyncio.sleep(0.5)
                assert len(driver.evaluation.results) == version // 2  # nothing due at an odd version
    finally:
        await driver.stop()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


def test_eval_flags_are_checked_together():
    with pytest.raises(ValueError, match="--eval-every"):
        ServeConfig(eval_every=2).validate()
    with pytest.raises(ValueError, match="--eval-every"):
        ServeConfig(eval_task="jsonl:x.jsonl").validate()


class VersionBumpingEngine:
    """Commits version 3 in the middle of the first eval's generation: its tokens then carry two versions."""

    def __init__(self):
        self.version, self.calls = 2, 0
        self.generation = self  # the evaluation samples from the engine's generation

    async def generate(self, prompt_ids, params, request_id):
        from types import SimpleNamespace

        self.calls += 1
        start = self.version
        if self.calls == 2:
            self.version = 3
        assert params.temperature == 0.0
        return SimpleNamespace(text="7", token_ids=[1, 2], versions=[start, self.version])


class ChatTokenizer:
    def apply_chat_template(self, messages, **kw):
        return [len(m["content"]) for m in messages]


def test_an_eval_an_update_committed_into_is_thrown_away_and_scored_again_at_the_new_version(tmp_path):
    from inflight.serve.eval import Evaluation
    from inflight.tasks.base import Problem
    from inflight.tasks.rewards import load_rewards

    cfg = ServeConfig(eval_task="arithmetic", eval_every=2)
    problems = [Problem("a", "What is 3 + 4?", 7), Problem("b", "What is 1 + 1?", 2)]
    results = []
    evaluation = Evaluation(VersionBumpingEngine(), cfg, problems, load_rewards("inflight.tasks.arithmetic:reward_fn"),
                            ChatTokenizer(), "s@1", results.append)  # fmt: skip
    assert evaluation.due()
    result = asyncio.run(evaluation.run())
    assert results == [result] and result.version == 3 and result.versions == [3]
    assert result.n == 2 and result.mean_reward == 0.5 and result.accuracy == 0.5
    assert evaluation.next_version == 4 and not evaluation.due()
