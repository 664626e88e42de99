"""`--env verifiers:<taskset>` with the real verifiers 0.4 package: loading refuses what a serve cannot honour; on the
real engine (tiny-qwen2), a verifiers environment defined the way its docs show (tests/inflight/vf_counting.py) runs
multi-turn episodes whose rollouts are exactly what the engine sampled and what the environment appended, versioned
across a commit in the middle of an episode, rewarded by the environment; a reward or harness that raises or hangs
ends its episode with reward 0, counted, and the serve goes on; verifiers' built-in harnesses (`null`, and `bash`,
which offers tools: rendered by the model's chat template, its calls parsed by vLLM's hermes parser) run their own
program, and a model whose template cannot render tools is refused at start for `bash`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from serve_support import Outbox, Recording
from tool_model import tool_model

from inflight.envs.loading import load_env
from inflight.envs.verifiers_env import INSTALL, VerifiersEnv
from inflight.serve.config import ServeConfig

ENV = "verifiers:vf_counting"  # tests/inflight/vf_counting.py, importable as the other test helpers are


@pytest.mark.parametrize(("args", "message"), [
    ({"agent": {"runtime": {"type": "docker"}}}, "agent.runtime.type is 'docker'"),
    ({"agent": {"harness": {"id": "codex"}}}, "'codex' needs a container runtime"),
    ({"agent": {"client": {"type": "eval", "base_url": "http://127.0.0.1:9/v1"}}}, "agent.client is set"),
    ({"taskset": {"colour": 1}}, "taskset.colour"),
    ({"taskset": 3}, "expected a JSON object"),
    ({"taskset": {"kinds": []}}, "its taskset has no tasks"),
    ({"taskset": {"kinds": ["load-raises"]}}, "its taskset failed to load: RuntimeError: the taskset crashed"),
])  # fmt: skip
def test_what_a_serve_cannot_honour_is_refused_at_load_naming_the_field(args, message):
    with pytest.raises(ValueError, match=message):
        load_env(ENV, json.dumps(args))


def test_an_unknown_taskset_or_a_missing_verifiers_is_refused_with_the_fix(monkeypatch):
    with pytest.raises(ValueError, match="no_such_taskset_xyz"):
        load_env("verifiers:no_such_taskset_xyz")
    with pytest.raises(ValueError, match="verifiers:<taskset id>"):
        load_env("verifiers:")
    monkeypatch.setitem(sys.modules, "verifiers", None)  # as if not installed
    with pytest.raises(ValueError, match=f"needs the verifiers package.*{re.escape(INSTALL)}"):
        load_env(ENV)


def test_the_taskset_is_the_problem_stream_and_an_unnamed_runtime_is_the_local_subprocess():
    env = load_env(ENV, '{"taskset": {"kinds": ["behaves", "pause"]}}')
    assert isinstance(env, VerifiersEnv) and env.env.config.agent.runtime.type == "subprocess"
    stream = env.problems()
    first, second, again = next(stream), next(stream), next(stream)
    assert [first.question, second.question, again.question] == ["Count to 2.", "Count to 3.", "Count to 2."]
    assert first.answer == "2" and again.id == f"{first.id}#1" and env.task_of(second.id).data.kind == "pause"
    env.cap_turns(2)
    assert env.env.config.agent.max_turns == 2, "--max-turns caps a role that sets none"
    own = load_env(ENV, '{"agent": {"max_turns": 5}}')
    own.cap_turns(2)
    assert own.env.config.agent.max_turns == 5, "a role's own max_turns stays"


ONLY = "verifiers:vf_taskset_only"  # tests/inflight/vf_taskset_only.py: a taskset and a reward, no harness of its own
NULL = '{"agent": {"harness": {"id": "null"}}}'


def test_the_default_bash_harness_loads_and_a_model_whose_template_renders_no_tools_is_refused_at_start_in_one_line(
    model_dirs, tmp_path
):
    from transformers import AutoTokenizer

    from inflight.serve.app import _start_episodes
    from inflight.serve.verifiers_runner import check_tools

    env = load_env(ONLY)
    assert env.harness_config.id == "bash", "verifiers' default harness"
    plain = AutoTokenizer.from_pretrained(model_dirs["tiny-qwen2"])  # SmolLM2's template: no tools

    class Runner:  # the check as VerifiersRunner's start makes it (inflight/serve/verifiers_runner.py:_serve)
        async def start(self):
            check_tools(env, plain, "tiny-qwen2")

    with pytest.raises(SystemExit) as ended:
        asyncio.run(_start_episodes(SimpleNamespace(episodes=Runner())))
    message = str(ended.value.code)
    assert message.startswith(
        "inflight.serve: env verifiers:vf_taskset_only: harness 'bash' offers the model its "
        "bash and edit tools, and model tiny-qwen2's chat template renders no tool definitions"
    )
    assert "vLLM's 'hermes' parser" in message and NULL in message and "\n" not in message
    check_tools(env, AutoTokenizer.from_pretrained(tool_model(model_dirs["tiny-qwen2"], tmp_path / "m")), "m")
    check_tools(load_env(ONLY, NULL), plain, "tiny-qwen2")  # the null harness offers no tools: any template runs it


def test_tool_definitions_reach_the_prompt_ids_and_a_hermes_tool_call_becomes_the_openai_tool_call_the_harness_runs(
    model_dirs, tmp_path
):
    from renderers.base import load_tokenizer
    from verifiers.v1.clients.train import response_from_generate, serialize_completion

    from inflight.serve.verifiers_renderer import AppendingRenderer

    tokenizer = load_tokenizer(str(tool_model(model_dirs["tiny-qwen2"], tmp_path / "m")))
    renderer = AppendingRenderer(tokenizer)
    tools = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]  # fmt: skip
    chat = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "What is 2 + 2?"}]
    prompt = renderer.render(chat, tools=tools, add_generation_prompt=True).token_ids
    assert '"name": "bash", "description": "Run a shell command"' in tokenizer.decode(prompt), "the template's tools"
    assert renderer.render(chat, add_generation_prompt=True).token_ids != prompt, "and only where tools are offered"
    call = 'Let me run it.<tool_call>\n{"name": "bash", "arguments": {"command": "echo 4"}}\n</tool_call>'
    completion = [*tokenizer.encode(call, add_special_tokens=False), tokenizer.eos_token_id]
    parsed = renderer.parse_response(completion, tools=tools, prompt_ids=prompt)
    result = {"finish_reason": "tool_calls", "content": parsed.content, "tool_calls": parsed.tool_calls,
              "prompt_ids": prompt, "completion_ids": completion}  # fmt: skip
    message = serialize_completion(response_from_generate(result, "m"), "m")["choices"][0]["message"]
    ((wire,),) = [message["tool_calls"]]
    assert wire["type"] == "function" and wire["id"] and message["content"] == "Let me run it."
    assert wire["function"] == {"name": "bash", "arguments": '{"command": "echo 4"}'}
    assert renderer.parse_response(completion, prompt_ids=prompt).tool_calls == [], "no tools offered: plain text"
    results = [{"role": "tool", "tool_call_id": wire["id"], "content": "4"}, {"role": "tool", "content": "done"}]
    bridged = renderer.bridge_to_next_turn(prompt, completion, results, tools=tools)
    assert bridged.token_ids[: len(prompt) + len(completion)] == prompt + completion, "every sampled id kept verbatim"
    tail = bridged.token_ids[len(prompt) + len(completion) :]
    assert (
        tokenizer.decode(tail) == "\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\ndone"
        "\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n"
    ), "the results as the template groups them"
    spans = bridged.message_token_spans()
    assert [tokenizer.decode(tail[a - len(prompt) - len(completion) : b - len(prompt) - len(completion)])
            for a, b in spans] == ["<|im_start|>user\n<tool_response>\n4\n</tool_response>\n",
                                   "<tool_response>\ndone\n</tool_response>\n<|im_end|>\n"]  # fmt: skip


def test_a_harness_that_prepares_a_uv_script_is_refused_at_load_when_no_uv_is_found_and_found_beside_python(
    monkeypatch, tmp_path
):
    from inflight.envs import verifiers_harness

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(verifiers_harness.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ValueError, match=r"harness 'null' prepares its program with uv .*`make setup` installs it"):
        load_env(ONLY, NULL)
    (tmp_path / "uv").write_text("#!/bin/sh\n")
    (tmp_path / "uv").chmod(0o755)
    assert load_env(ONLY, NULL).harness_config.id == "null", "the uv beside the interpreter is found"
    assert os.environ["PATH"].split(os.pathsep)[0] == str(tmp_path), "and put on PATH for the harness's programs"
    assert load_env(ENV).harness_config.id == "vf_counting", "a harness of the environment's own needs no uv"


def test_a_harness_program_that_cannot_be_prepared_ends_the_serve_at_start_in_one_line_naming_harness_and_fix(
    monkeypatch, tmp_path
):
    from verifiers.v1.runtimes import SubprocessRuntime

    from inflight.envs.verifiers_harness import prepare_program
    from inflight.serve.app import _start_episodes

    env = load_env(ONLY, NULL)
    monkeypatch.setattr(SubprocessRuntime, "_interpreters", {})  # nothing prepared yet in this process
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "cache"))  # nor in uv's cache
    (tmp_path / "index").mkdir()
    monkeypatch.setenv("UV_DEFAULT_INDEX", (tmp_path / "index").as_uri())  # an index without the program's packages

    class Runner:  # the runner's start as VerifiersRunner's prepares (inflight/serve/verifiers_runner.py:_serve)
        async def start(self):
            await prepare_program(env.name, env.harness_config)

    with pytest.raises(SystemExit) as ended:
        asyncio.run(_start_episodes(SimpleNamespace(episodes=Runner())))
    message = str(ended.value.code)
    assert message.startswith("inflight.serve: env verifiers:vf_taskset_only: harness 'null' could not prepare")
    assert "No solution found" in message and "UV_DEFAULT_INDEX" in message and "\n" not in message


@pytest.mark.parametrize(("failure", "error", "kind"), [
    ("HarnessError: harness 'null' exited 1: Traceback (most recent call last):\n  File \"x.py\"\n  a\nKeyError: 'k'\n",
     "harness 'null' exited 1, its last stderr lines: File \"x.py\" | a | KeyError: 'k'", "harness null exited 1"),
    ("HarnessError: harness setup: RuntimeError: failed to prepare uv script: error: No solution found\n  hint: x",
     "a uv script failed to prepare, its last stderr lines: error: No solution found | hint: x",
     "uv script preparation failed"),
    ("TaskError: task setup: RuntimeError: boom", "TaskError: task setup: RuntimeError: boom", "TaskError"),
])  # fmt: skip
def test_an_episodes_failure_names_the_harness_exit_code_and_last_stderr_lines_and_is_counted_by_kind(
    failure, error, kind
):
    from inflight.serve.verifiers_runner import HeldControl, RecordedFailure, describe_failure

    recorded = RecordedFailure(*failure.split(": ", 1))
    assert describe_failure(recorded) == (error, kind)
    message, held = describe_failure(HeldControl(31.0, 30.0, 0))
    assert held == "timeout before the first model call" and "in its harness's setup or its program's start" in message
    assert describe_failure(HeldControl(31.0, 30.0, 2))[1] == "timeout after a model call"


def _trace(ids: list[int], mask: list[bool], branches: int = 1):
    """The two fields of a verifiers trace's branch the record is made from (a narrow fake: its shape only)."""
    from types import SimpleNamespace

    branch = SimpleNamespace(trainable=True, token_ids=ids, sampled_mask=mask)
    return SimpleNamespace(branches=[branch] * branches)


def _turn(prompt: list[int], ids: list[int], version: int):
    from inflight.serve.verifiers_runner import ModelTurn
    from vllm_patches.generation import Completion

    done = Completion("r", prompt, ids, [-0.5] * len(ids), [version] * len(ids), "stop", [version] * len(ids))
    return ModelTurn(prompt, done)


def test_a_trace_becomes_a_record_only_where_its_sampled_spans_are_exactly_what_the_engine_sampled():
    from inflight.serve.episodes import Episode
    from inflight.serve.verifiers_runner import TraceError, trace_into_episode

    ids = [1, 2, 3, 10, 11, 4, 5, 12]  # prompt 1 2 3, turn 10 11, environment 4 5, turn 12
    mask = [False] * 3 + [True] * 2 + [False] * 2 + [True]
    turns = [_turn([1, 2, 3], [10, 11], 7), _turn([1, 2, 3, 10, 11, 4, 5], [12], 8)]
    ep = Episode()
    trace_into_episode(ep, _trace(ids, mask), turns)
    assert ep.prompt_ids == [1, 2, 3] and ep.token_ids == [10, 11, 4, 5, 12] and ep.turns == 2
    assert ep.versions == [7, 7, -1, -1, 8] and ep.env == [False, False, True, True, False]
    assert ep.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    retokenised = [_turn([1, 2, 3], [10, 11], 7), _turn([1, 2, 3, 99, 4, 5], [12], 8)]  # turn 1 re-rendered
    with pytest.raises(TraceError, match="not what the engine sampled"):
        trace_into_episode(Episode(), _trace(ids, mask), retokenised)
    with pytest.raises(TraceError, match="2 trainable branches"):
        trace_into_episode(Episode(), _trace(ids, mask, branches=2), turns)


def test_the_endpoint_answers_what_verifiers_client_parses_where_vllms_own_tokens_response_is_refused():
    from renderers.client import MalformedGenerateResponseError, _parse_completion_logprobs
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateLogProbs,
        GenerateLogProbsContent,
        GenerateTokensChoice,
    )

    from inflight.serve.verifiers_runner import generate_response
    from vllm_patches.generation import Completion

    entries = [GenerateLogProbsContent(token_id=t, logprob=-0.25) for t in (5, 6, 7)]
    vllms = GenerateTokensChoice(index=0, token_ids=[5, 6, 7], logprobs=GenerateLogProbs(content=entries))
    with pytest.raises(MalformedGenerateResponseError):  # vLLM 0.32's tokens mode sends token_id, not "token_id:N"
        _parse_completion_logprobs(vllms.model_dump(), [5, 6, 7])
    done = Completion("r-1", [1, 2], [5, 6, 7], [-0.25, -0.5, -1.0], [3, 3, 4], "length", [3, 3, 4])
    ours = generate_response(done, [1, 2])
    (choice,) = ours["choices"]
    assert _parse_completion_logprobs(choice, [5, 6, 7]) == [-0.25, -0.5, -1.0] and choice["token_ids"] == [5, 6, 7]
    assert choice["weight_versions"] == [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    assert ours["prompt_token_ids"] == [1, 2] and ours["usage"]["total_tokens"] == 5


def test_the_endpoint_answers_only_its_key_a_running_episode_and_a_text_generate_request():
    import httpx

    from inflight.serve.verifiers_runner import KEY_HEADER, SESSION_HEADER, EpisodeWatch, TokenEndpoint
    from vllm_patches.generation import Completion

    async def sample(watch, body):  # the engine's place: echoes the prompt's last token
        return Completion("r", body.token_ids, body.token_ids[-1:], [-0.5], [2], "stop", [2])

    async def go():
        async with TokenEndpoint(sample, "m", 64) as endpoint, httpx.AsyncClient() as client:
            endpoint.watches["trace-1"] = EpisodeWatch("r")
            url, good = endpoint.base_url.removesuffix("/v1") + "/inference/v1/generate", {"token_ids": [4, 5]}
            keyed = {KEY_HEADER: endpoint.key, SESSION_HEADER: "trace-1"}

            async def post(body, headers=keyed):
                return await client.post(url, content=json.dumps(body) if isinstance(body, dict) else body,
                                         headers=headers)  # fmt: skip

            codes = [
                (await post(good, {SESSION_HEADER: "trace-1"})).status_code,
                (await post(good, {**keyed, SESSION_HEADER: "other"})).status_code,
                (await post(b"{not json")).status_code,
                (await post({**good, "content_parts": [{"type": "image_url"}]})).status_code,
                (await post({**good, "stream": True})).status_code,
            ]
            answer = (await post(good)).json()
            return codes, answer

    codes, answer = asyncio.run(go())
    assert codes == [401, 404, 400, 400, 400]
    assert answer["choices"][0]["token_ids"] == [5] and answer["choices"][0]["weight_versions"][0]["version"] == "2"


# --- on the real engine ---------------------------------------------------------------------------------------------


def run_groups(loop, engine, model_dirs, kinds, during=None, env=ENV, model=None, **overrides):
    """A driver over a verifiers env of `kinds` tasks (or `env` with `kinds` as its env_args), run until its groups
    finished: (driver, records). `model`: the directory the serve's tokenizer and chat template come from (the engine's
    tiny-qwen2 by default)."""
    from transformers import AutoTokenizer

    from inflight.serve.driver import RolloutDriver

    model = model or model_dirs["tiny-qwen2"]
    args = json.dumps({"taskset": {"kinds": kinds}}) if env == ENV else kinds
    cfg = ServeConfig(model=str(model), env=env, env_args=args, wait_for_learner=False, max_tokens=5,
                      **{"admit_lag": -1, "group_size": 2, "max_groups": 1, **overrides})  # fmt: skip
    cfg.validate()
    tokenizer = AutoTokenizer.from_pretrained(model)
    driver = RolloutDriver(engine, cfg, [], [], Outbox(), tokenizer, env=load_env(env, args))

    async def go():
        run = asyncio.create_task(driver.run())
        try:
            if during is not None:
                await during()
            deadline = time.monotonic() + 300
            while driver.stats.groups_finished < cfg.max_groups:
                assert time.monotonic() < deadline and not run.done(), "the groups did not finish"
                await asyncio.sleep(0.05)
        finally:
            await driver.stop()
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await driver.episodes.close()

    loop.run_until_complete(go())
    return driver, driver.stream.records


@pytest.mark.engine
def test_a_verifiers_episode_is_what_the_engine_sampled_and_the_environment_appended(loop, engine, model_dirs):
    recording = Recording(engine)
    driver, records = run_groups(loop, recording, model_dirs, ["behaves"])
    assert len(records) == 2 and len(recording.calls) == 6
    tokenizer = driver.episodes.turns.tokenizer
    for record in records:
        turns = [(rid, prompt, done) for rid, prompt, done in recording.calls if rid.startswith(record.rollout_id)]
        assert [rid.removeprefix(record.rollout_id) for rid, _, _ in turns] == ["", "-t1", "-t2"]
        ids, roles, at = record.prompt.tolist() + record.completion.tolist(), ~record.policy_mask, len(record.prompt)
        for k, (_, prompt, done) in enumerate(turns):
            assert prompt == ids[:at], "each turn's prompt is exactly the ids before it: nothing re-tokenised"
            got = slice(at - len(record.prompt), at - len(record.prompt) + len(done.token_ids))
            assert ids[at : at + len(done.token_ids)] == done.token_ids and not roles[got].any()
            assert record.logprobs[got].tolist() == pytest.approx(done.logprobs, abs=0)
            assert record.versions[got].tolist() == done.versions == [engine.version] * len(done.token_ids)
            at += len(done.token_ids)
            env_end = at
            while env_end < len(ids) and roles[env_end - len(record.prompt)]:
                env_end += 1
            if k < 2:  # the harness's tool message, then the next assistant header: environment tokens
                text = tokenizer.decode(ids[at:env_end])
                assert f"tool output {k + 1}: {len(done.text)} chars" in text and text.endswith("assistant\n")
            at = env_end
        assert at == len(ids)
        assert np.array_equal(record.versions == -1, roles) and (record.logprobs[roles] == 0.0).all()
        assert record.turns == 3 and record.reward == pytest.approx(1.5)  # the environment's 1.0 + 0.5 x 1.0
    means = driver.stats.reward_means.means()
    assert means == {"all_turns_taken": 1.0, "replied": 1.0} and driver.stats.env_errors == 0


@pytest.mark.engine
def test_max_turns_ends_a_verifiers_episode_normally_after_that_many_turns(loop, engine, model_dirs):
    _, (record,) = run_groups(loop, engine, model_dirs, ["behaves"], group_size=1, max_turns=2)
    assert record.turns == 2 and record.finish_reason == "max_turns"
    assert record.reward == pytest.approx(0.5), "all_turns_taken 0 (2 of 3 turns), replied 0.5 x 1"


@pytest.mark.engine
def test_a_commit_in_the_middle_of_a_verifiers_episode_versions_each_turn_by_the_weights_that_sampled_it(
    loop, engine, model_dirs, tmp_path
):
    import vf_counting
    from support import Sender, perturbed_checkpoint

    vf_counting.GATE.update(paused=asyncio.Event(), go=asyncio.Event())
    sender, before = Sender(), engine.version

    async def commit_while_paused():
        await sender.connect(engine)
        await asyncio.wait_for(vf_counting.GATE["paused"].wait(), 120)
        state = perturbed_checkpoint(model_dirs["tiny-qwen2"], tmp_path / "v", seed=before + 1)
        await sender.push(engine, state, before + 1)
        vf_counting.GATE["go"].set()

    try:
        _, (record,) = run_groups(loop, engine, model_dirs, ["pause"], commit_while_paused, group_size=1,
                                  env_timeout_s=120.0)  # fmt: skip
    finally:
        vf_counting.GATE.clear()
    policy, versions = record.policy_mask, record.versions
    first_env = int(np.argmin(policy))
    assert record.turns == 3 and (versions[:first_env] == before).all(), "the first turn was sampled before"
    later = versions[first_env:][policy[first_env:]]
    assert len(later) and (later == before + 1).all(), "the later turns were sampled after the commit"
    assert (versions[~policy] == -1).all() and record.reward == pytest.approx(1.5)


@pytest.mark.engine
def test_a_reward_harness_or_task_that_raises_or_hangs_ends_its_episode_with_reward_0_counted_and_the_serve_goes_on(
    loop, engine, model_dirs, caplog
):
    kinds = ["reward-raises", "harness-raises", "harness-hangs", "task-raises", "task-hangs", "harness-exits",
             "behaves"]  # fmt: skip
    driver, records = run_groups(loop, engine, model_dirs, kinds, group_size=1, max_groups=len(kinds),
                                 env_timeout_s=8.0, max_inflight=1)  # fmt: skip
    by_kind = {driver.env.task_of(r.problem_id).data.kind: r for r in records}
    untrained = {"harness-raises", "task-raises", "task-hangs", "harness-exits"}  # failed before the first model call
    assert set(by_kind) == set(kinds) - untrained, "every episode with a sampled token is a rollout, no other"
    for kind in ("reward-raises", "harness-hangs"):
        assert by_kind[kind].finish_reason == "env_error" and by_kind[kind].reward == 0.0, kind
    assert by_kind["reward-raises"].turns == 3 and by_kind["harness-hangs"].turns == 1, "their tokens are kept"
    assert by_kind["behaves"].finish_reason != "env_error" and by_kind["behaves"].reward == pytest.approx(1.5)
    stats = driver.stats
    assert stats.env_errors == len(kinds) - 1 and stats.groups_finished == len(kinds)
    assert (stats.groups_dropped, stats.untrained_episodes) == (len(untrained), len(untrained))
    assert stats.env_error_kinds["timeout before the first model call"] == 1  # task-hangs
    assert stats.env_error_kinds["timeout after a model call"] == 1  # harness-hangs
    assert stats.env_error_kinds["harness vf_counting exited 1"] == 1, stats.env_error_kinds
    assert all(f"the {who} crashed" in caplog.text for who in ("reward", "harness", "task's setup"))
    assert "longer than --env-timeout-s" in caplog.text and "before its first model call" in caplog.text
    stderr = 'Traceback (most recent call last): | File "chat.py", line 1 | RuntimeError: no tool renderer'
    assert f"harness 'vf_counting' exited 1, its last stderr lines: {stderr}" in caplog.text


@pytest.mark.engine
@pytest.mark.parametrize("harness", ["null", "bash"])
def test_a_taskset_only_environment_on_a_built_in_harness_runs_verifiers_own_program_rewarded_with_no_error(
    loop, engine, model_dirs, tmp_path, harness
):
    """verifiers' built-in harnesses: their PEP 723 chat program prepared by uv once, before the first episode, then
    run per episode as a subprocess that calls the serve's token endpoint. `bash` (verifiers' default) offers the model
    its tools: on a model whose chat template renders them (tests/inflight/tool_model.py), they are in every prompt."""
    args = NULL if harness == "null" else ""
    model = tool_model(model_dirs["tiny-qwen2"], tmp_path / "m")
    driver, records = run_groups(loop, engine, model_dirs, args, env=ONLY, group_size=2, env_timeout_s=60.0,
                                 model=model)  # fmt: skip
    assert driver.env.harness_config.id == harness
    assert len(records) == 2 and driver.stats.env_errors == 0, driver.stats.env_error_kinds
    tokenizer = driver.episodes.turns.tokenizer
    for record in records:
        assert record.turns >= 1 and record.policy_mask.any() and record.finish_reason != "env_error"
        assert 0.0 <= record.reward <= 1.0
        prompt = tokenizer.decode(record.prompt.tolist())
        assert ('"name": "bash"' in prompt and '"name": "edit"' in prompt) == (harness == "bash"), prompt
    assert set(driver.stats.reward_means.means()) == {"replied"}


class ToolCallFirst(Recording):
    """The real engine, except that each episode's first turn is a scripted tool call in the template's format: a
    narrow stand-in for a model that calls its tool (the random tiny model rarely writes one)."""

    def __init__(self, engine, script: list[int]):
        super().__init__(engine)
        self.script = script

    async def generate(self, prompt_ids, params, request_id):
        from vllm_patches.generation import Completion

        if re.search(r"-t\d+$", request_id):  # a later turn: the engine's
            return await super().generate(prompt_ids, params, request_id)
        n, version = len(self.script), self.engine.version
        done = Completion(request_id, list(prompt_ids), self.script, [-1.0] * n, [version] * n, "stop", [version] * n)
        self.calls.append((request_id, list(prompt_ids), done))
        return done


@pytest.mark.engine
def test_a_tool_call_in_the_models_format_runs_the_bash_harness_tool_and_its_result_is_appended_after_the_call_verbatim(
    loop, engine, model_dirs, tmp_path
):
    """verifiers' bash harness program receives the parsed call as OpenAI-style tool_calls, runs it in bash, and the
    result comes back as the template's tool turn after exactly the ids of the call; one trace, no environment error."""
    from transformers import AutoTokenizer

    model = tool_model(model_dirs["tiny-qwen2"], tmp_path / "m")
    tokenizer = AutoTokenizer.from_pretrained(model)
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "echo inflight-$((6 * 7))"}}\n</tool_call>'
    script = [*tokenizer.encode(call, add_special_tokens=False), tokenizer.eos_token_id]
    recording = ToolCallFirst(engine, script)
    driver, (record,) = run_groups(loop, recording, model_dirs, "", env=ONLY, group_size=1, env_timeout_s=60.0,
                                   model=model)  # fmt: skip
    assert driver.stats.env_errors == 0, driver.stats.env_error_kinds
    (first, second) = [(prompt, done) for _, prompt, done in recording.calls]
    ids = record.prompt.tolist() + record.completion.tolist()
    assert first[0] == record.prompt.tolist() and ids[len(first[0]) : len(first[0]) + len(script)] == script
    assert second[0] == ids[: len(second[0])] and second[0][: len(first[0]) + len(script)] == first[0] + script
    between = tokenizer.decode(second[0][len(first[0]) + len(script) :])
    assert "<tool_response>\ninflight-42\n" in between, "bash ran the call: 6 * 7 came back"
    assert between.endswith("<|im_start|>assistant\n") and record.turns == 2 and record.finish_reason != "env_error"
    assert ids[len(second[0]) :] == second[1].token_ids, "the second turn is the engine's, verbatim, to the end"
