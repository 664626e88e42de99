"""Multi-turn episodes on the real engine (tiny-qwen2): token in, token out; environment tokens carry version -1 and
never train; a commit between two turns shows inside the episode; a misbehaving environment ends its episode, counted,
and the serve goes on."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest
from serve_support import Outbox, Recording

from inflight.envs.base import Feedback
from inflight.serve.config import ServeConfig
from inflight.tasks.base import Problem

pytestmark = pytest.mark.engine


class ThreeTurns:
    """Answers the first two turns with a message naming the turn, ends after the third; 0.25 + 0.25 + 0.5 reward."""

    stop = ()

    def reset(self, problem: Problem):
        return [{"role": "user", "content": f"Count with me: {problem.question}"}]

    def step(self, state, completion: str) -> Feedback:
        if state.turn >= 3:
            return Feedback(reward=0.5, done=True)
        return Feedback(
            [{"role": "user", "content": f"tool output {state.turn}: {len(completion)} chars"}], reward=0.25
        )


class PausesAfterTheFirstTurn:
    """Holds the episode between its two turns until the test has committed an update."""

    stop = ()

    def __init__(self):
        self.paused, self.go = asyncio.Event(), asyncio.Event()

    def reset(self, problem: Problem):
        return problem.chat()

    async def step(self, state, completion: str) -> Feedback:
        if state.turn == 1:
            self.paused.set()
            await self.go.wait()
            return Feedback([{"role": "user", "content": "And once more?"}])
        return Feedback(done=True)


class Misbehaves:
    """By the problem's question: fails at reset, raises, hangs, answers garbage or bad messages, or behaves."""

    stop = ()

    def reset(self, problem: Problem):
        if problem.question == "reset-raises":
            raise RuntimeError("no such task")
        return problem.chat()

    def step(self, state, completion: str):
        kind = state.problem.question
        if kind == "raises":
            raise RuntimeError("the tool crashed")
        if kind == "hangs":
            time.sleep(3)  # past --env-timeout-s, in its own thread: the serve must not wait for it
        if kind == "garbage":
            return "not a Feedback"
        if kind == "bad-messages":
            return Feedback([{"role": "robot", "content": 1}])
        return Feedback(done=True) if state.turn >= 2 else Feedback([{"role": "user", "content": "go on"}])


class MisbehavesAsync(Misbehaves):
    async def step(self, state, completion: str):
        if state.problem.question == "hangs":
            await asyncio.Event().wait()  # never returns: cancelled by the timeout
        return super().step(state, completion)


def make_driver(engine, model_dirs, env, problems, **overrides):
    from transformers import AutoTokenizer

    from inflight.serve.driver import RolloutDriver

    model = model_dirs["tiny-qwen2"]
    cfg = ServeConfig(model=str(model), wait_for_learner=False, max_tokens=5,
                      **{"admit_lag": -1, "group_size": 2, "max_groups": 1, "max_turns": 3, **overrides})  # fmt: skip
    cfg.validate()
    return RolloutDriver(engine, cfg, problems, [], Outbox(), AutoTokenizer.from_pretrained(model), env=env)


async def run_until_finished(driver, during=None, timeout_s: float = 120.0) -> None:
    run = asyncio.create_task(driver.run())
    try:
        if during is not None:
            await during()
        deadline = time.monotonic() + timeout_s
        while driver.stats.groups_finished < driver.cfg.max_groups:
            assert time.monotonic() < deadline and not run.done(), "the groups did not finish"
            await asyncio.sleep(0.05)
    finally:
        await driver.stop()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


@pytest.fixture(scope="module")
def three_turns(loop, engine, model_dirs):
    """One group of two 3-turn episodes: (records, the engine's requests, tokenizer)."""
    recording = Recording(engine)
    driver = make_driver(recording, model_dirs, ThreeTurns(), iter([Problem("p0", "one, two", 3)] * 2))
    loop.run_until_complete(run_until_finished(driver))
    return driver.stream.records, recording.calls, driver.episodes.turns.tokenizer, driver.stats


def test_a_three_turn_rollout_is_what_vllm_generated_and_the_environment_appended_nothing_re_tokenised(
    three_turns,
):
    records, calls, tokenizer, stats = three_turns
    assert len(records) == 2
    for record in records:
        turns = [(prompt, done) for rid, prompt, done in calls if rid.startswith(record.rollout_id)]
        assert [rid.removeprefix(record.rollout_id) for rid, _, _ in calls if rid.startswith(record.rollout_id)] == [
            "", "-t1", "-t2"]  # fmt: skip
        ids = record.prompt.tolist() + record.completion.tolist()
        roles = ~record.policy_mask
        at = len(record.prompt)
        for k, (prompt, done) in enumerate(turns):
            assert prompt == ids[:at], "a turn's prompt must be exactly the ids before it: nothing re-tokenised"
            n = len(done.token_ids)
            assert ids[at : at + n] == done.token_ids and not roles[at - len(record.prompt) :][:n].any()
            got = slice(at - len(record.prompt), at - len(record.prompt) + n)
            assert record.logprobs[got].tolist() == pytest.approx(done.logprobs, abs=0)
            assert record.versions[got].tolist() == done.versions == [0] * n
            at += n
            if k < 2:  # the environment's message follows, then the next assistant header
                env_end = at
                while env_end < len(ids) and roles[env_end - len(record.prompt)]:
                    env_end += 1
                text = tokenizer.decode(ids[at:env_end])
                assert f"tool output {k + 1}: {len(done.text)} chars" in text and text.endswith("assistant\n")
                at = env_end
        assert at == len(ids)
        assert np.array_equal(record.versions == -1, roles) and (record.logprobs[roles] == 0.0).all()
        assert record.turns == 3 and record.reward == pytest.approx(1.0)  # the environment's 0.25 + 0.25 + 0.5
    assert stats.turns == 6 and stats.env_tokens == sum(int((~r.policy_mask).sum()) for r in records)


def test_the_learner_never_trains_environment_tokens_their_content_and_placeholders_change_no_earlier_term(
    three_turns, model_dirs
):
    import torch

    from inflight.learn.samples import build_samples
    from learner.losses import LossConfig, policy_loss
    from learner.model import load_policy
    from learner.step import Sample, make_batch

    records, _, tokenizer, _ = three_turns
    samples, stats = build_samples([records], version=0, max_lag=0)
    assert stats.env_tokens > 0 and stats.gated == 0
    model = load_policy(model_dirs["tiny-qwen2"])

    def terms(sample_list):
        """Per position: the loss term of each completion token (the loss with only that token kept) and the
        gradient of the whole loss w.r.t. every position's logprob."""
        batch = make_batch([Sample(s.prompt_ids, s.completion_ids, s.behaviour_logprobs, 1.0, s.token_mask)
                            for s in sample_list], pad_id=0)  # fmt: skip
        logp = model(batch.input_ids, batch.targets, 1.0).logp.detach().requires_grad_(True)
        flat = [t.reshape(-1) for t in (batch.behaviour_logp, batch.advantages, batch.mask, batch.seq_ids)]
        loss, _ = policy_loss(logp.reshape(-1), *flat[:2], flat[2], flat[3], LossConfig(), normalizer=100.0)
        loss.backward()
        each = torch.zeros(batch.mask.numel())
        for i in torch.nonzero(flat[2]).flatten():
            one = torch.zeros_like(flat[2]).index_fill_(0, i, True)
            each[i] = policy_loss(
                logp.reshape(-1).detach(), *flat[:2], one, flat[3], LossConfig(), normalizer=100.0
            ).loss
        return each.view_as(batch.mask), logp.grad, batch.mask, loss.detach()

    base_terms, base_grad, mask, base_loss = terms(samples)
    for row, s in enumerate(samples):
        env = [not p for p in s.policy]
        positions = [len(s.prompt_ids) - 1 + j for j, e in enumerate(env) if e]
        assert not mask[row, positions].any() and (base_terms[row, positions] == 0).all()
        assert (base_grad[row, positions] == 0).all(), "an environment token must receive no gradient"
        assert mask[row].sum() == sum(s.policy)  # every policy token trains (lag 0)
    # The environment's tokens replaced by others, the policy's kept: every policy term before them is unchanged
    changed = [_replace_env(s, lambda ids: [(t + 17) % 1000 + 100 for t in ids]) for s in samples]
    new_terms, new_grad, new_mask, _ = terms(changed)
    assert torch.equal(new_mask, mask)
    for row, s in enumerate(samples):
        first_env = len(s.prompt_ids) - 1 + s.policy.index(False)
        assert torch.allclose(new_terms[row, :first_env], base_terms[row, :first_env], rtol=0, atol=1e-6)
        assert (new_grad[row][~new_mask[row]] == 0).all()
    # Their placeholders (logprob, lag) changed: nothing at all changes
    placeholders = [_replace_env(s, None, logprob=-3.0) for s in samples]
    assert torch.equal(terms(placeholders)[3], base_loss)


def _replace_env(sample, new_ids, logprob: float | None = None):
    from dataclasses import replace

    env = [not p for p in sample.policy]
    ids, lps = list(sample.completion_ids), list(sample.behaviour_logprobs)
    replaced = iter(new_ids([t for t, e in zip(ids, env, strict=True) if e])) if new_ids else None
    for j, e in enumerate(env):
        if e:
            ids[j] = next(replaced) if replaced else ids[j]
            lps[j] = lps[j] if logprob is None else logprob
    return replace(sample, completion_ids=ids, behaviour_logprobs=lps)


def test_a_commit_between_two_turns_gives_the_second_turn_the_new_version_and_the_first_the_old(
    loop, engine, model_dirs, tmp_path
):
    from support import Sender, perturbed_checkpoint

    env = PausesAfterTheFirstTurn()
    driver = make_driver(engine, model_dirs, env, iter([Problem("p", "What is 1 + 1?", 2)]), group_size=1,
                         max_turns=2, env_timeout_s=120.0)  # fmt: skip
    sender = Sender()
    before = engine.version

    async def commit_while_paused():
        await sender.connect(engine)
        await asyncio.wait_for(env.paused.wait(), 60)
        state = perturbed_checkpoint(model_dirs["tiny-qwen2"], tmp_path / "v", seed=before + 1)
        await sender.push(engine, state, before + 1)
        env.go.set()

    loop.run_until_complete(run_until_finished(driver, commit_while_paused))
    (record,) = driver.stream.records
    policy = record.policy_mask
    versions = record.versions
    first_env = int(np.argmin(policy))
    assert record.turns == 2 and not policy.all()
    assert (versions[:first_env] == before).all(), "the first turn was sampled before the commit"
    after = versions[first_env:][policy[first_env:]]
    assert len(after) and (after == before + 1).all(), "the second turn was sampled after it"
    assert (versions[~policy] == -1).all()


@pytest.mark.parametrize("env_class", [Misbehaves, MisbehavesAsync])
def test_an_environment_that_raises_hangs_or_answers_garbage_ends_its_episode_counted_and_the_serve_goes_on(
    loop, engine, model_dirs, env_class, caplog
):
    caplog.set_level(logging.WARNING, logger="inflight.serve")  # another test of this process may have raised it
    kinds = ["reset-raises", "raises", "hangs", "garbage", "bad-messages", "behaves"]
    problems = iter([Problem(f"p-{k}", k, 0) for k in kinds])
    driver = make_driver(engine, model_dirs, env_class(), problems, group_size=1, max_groups=len(kinds),
                         env_timeout_s=0.5, max_inflight=1)  # fmt: skip
    loop.run_until_complete(run_until_finished(driver))
    by_kind = {r.problem_id.removeprefix("p-"): r for r in driver.stream.records}
    assert set(by_kind) == set(kinds) - {"reset-raises"}, "every episode with a sampled token is a rollout"
    for kind in kinds[1:-1]:
        assert by_kind[kind].finish_reason == "env_error" and by_kind[kind].reward == 0.0, kind
    assert by_kind["raises"].turns == 1 and by_kind["behaves"].turns == 2
    assert by_kind["behaves"].finish_reason != "env_error"
    stats = driver.stats
    assert stats.env_errors == len(kinds) - 1 and stats.groups_finished == len(kinds)
    assert (stats.groups_dropped, stats.untrained_episodes, stats.rollouts_made) == (1, 1, len(kinds) - 1)
    assert stats.env_error_kinds["RuntimeError before the first model call"] == 1
    assert stats.env_error_kinds["TimeoutError in step"] == 1 and stats.env_error_kinds["RuntimeError in step"] == 1
    assert "took longer than --env-timeout-s" in caplog.text and "expected inflight.envs.base.Feedback" in caplog.text
    assert "dropped: 1 of its 1 episodes ended with no sampled token (nothing to train): no such task" in caplog.text


class RejectsTheFirstGroup(Recording):
    """The real engine, handed a token id outside the vocabulary for the first group's requests: vLLM rejects them."""

    async def generate(self, prompt_ids, params, request_id):
        if "-g0-" in request_id:
            prompt_ids = [*prompt_ids, 10**9]
        return await super().generate(prompt_ids, params, request_id)


def test_a_group_the_engine_fails_is_counted_shown_and_frees_its_admission_slot_for_the_next(
    loop, engine, model_dirs, caplog
):
    from record_factories import a_progress

    from inflight.serve.progress import _failed

    caplog.set_level(logging.ERROR, logger="inflight.serve")
    problems = iter([Problem("p0", "one, two", 3), Problem("p1", "three, four", 7)])
    # admit_lag 0: the second group waits until the first is consumed, which a failed group never is
    driver = make_driver(RejectsTheFirstGroup(engine), model_dirs, ThreeTurns(), problems, max_groups=2,
                         admit_lag=0, groups_per_step=1, max_turns=1)  # fmt: skip
    loop.run_until_complete(run_until_finished(driver))
    stats = driver.stats
    assert (stats.groups_failed, stats.groups_finished, stats.groups_dropped) == (1, 2, 0)
    assert [r.problem_id for r in driver.stream.records] == ["p1", "p1"], "the next group ran and was sent"
    assert "vocab" in stats.last_failure.lower(), stats.last_failure
    assert "failed (never sent)" in caplog.text and "Traceback" in caplog.text
    line = _failed(a_progress(groups_failed=1, last_failure=stats.last_failure))
    assert line.startswith(" | failed 1 groups (last: ") and _failed(a_progress()) == ""
