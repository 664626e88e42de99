"""VerifiersRunner: a verifiers environment's episodes (inflight/envs/verifiers_env.py) sampled by the serve's engine.

The driver (inflight/serve/driver.py) runs one `VerifiersRunner.run` per sample, as it runs `EpisodeRunner.run` for
the serve's own environments. The episode is the environment's: its taskset's task, its harness driving the
conversation, its rewards scoring the trace. Every model call of the harness reaches verifiers' own train client
(`TrainClient`: it renders the chat to token ids itself and bridges each turn onto the previous turn's ids), which
posts the ids to a token-in/token-out endpoint `/inference/v1/generate`; here that endpoint is the serve's own
(`TokenEndpoint`, on 127.0.0.1, a random key per serve), answering with the engine's `VersionedGeneration.generate`.

Why an endpoint of our own rather than vLLM's (which 0.32 has, behind the serve's `--http-port`): vLLM's router calls
AsyncLLM directly, past `VersionedGeneration.generate`, so its requests carry no version salt for the prefix cache,
are not resubmitted after an abort-resume update and record no KV ages; and verifiers 0.4's client (renderers 0.1.12)
reads each logprob entry's `token` as `"token_id:N"`, which vLLM 0.32's tokens-mode response does not send (it sends
`token_id`), so that pairing fails on its first call. The endpoint here answers vLLM 0.32's response schema with both
spellings and vLLM's own `weight_versions` spans; an in-process client would have needed verifiers' private
interception internals. The loopback hop costs a JSON round trip per turn (verifiers' harness already reaches its
interception server that way).

Tools: a harness's tool definitions reach the prompt through the model's own chat template, and the completion's tool
calls are parsed by vLLM's hermes parser (inflight/serve/verifiers_renderer.py); a harness that offers tools (`bash`)
on a model whose template cannot do both is refused at start, in one line (`check_tools`).

Each episode's model turns are kept by the endpoint, keyed by the trace id verifiers sends as `X-Session-ID`. When
the episode ends, its trace's branch (the token ids verifiers concatenated, its per-token sampled mask) becomes the
rollout: every sampled span must equal exactly the tokens one of the engine's turns sampled, after exactly the prompt
that turn was sent, or the episode is refused as an environment error. Sampled tokens keep the engine's logprobs and
versions; everything else (the environment's messages, the chat template's scaffold) becomes environment tokens
(version -1, logprob 0, no loss). The reward is the trace's (its weighted `@vf.reward`s), each reward's own score
goes to the serve's per-reward means.

The serve samples with its own sampler (`--temperature`, `--top-p`, ...: the learner's importance ratios assume it);
an environment's `max_tokens` is honoured up to `--max-tokens`, its stop token ids are added. An episode whose
trace failed (a reward, the harness or the task raised: verifiers records it on the trace) or whose environment held
control longer than `--env-timeout-s` between two model calls ends with reward 0, counted as an environment error;
the serve goes on. `--max-turns` caps a role that sets no `max_turns` of its own (`VerifiersEnv.cap_turns`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from inflight.envs.verifiers_env import VerifiersEnv
from inflight.envs.verifiers_harness import NULL_HARNESS, offered_tools, prepare_program
from inflight.models import resolve_model
from inflight.serve.episodes import Episode, RunnerContext, TurnTokens
from inflight.serve.verifiers_renderer import TOOL_CALL_PARSER, tool_template_gap
from inflight.tasks.base import Problem
from inflight.tasks.rewards import GroupScores
from vllm_patches.generation import Completion

log = logging.getLogger("inflight.serve")
KEY_HEADER = "X-Inflight-Key"
SESSION_HEADER = "X-Session-ID"  # verifiers' per-rollout header: the trace id
WATCH_S = 0.2  # how often a running episode checks how long its environment has held control
SAMPLER_KEYS = ("temperature", "top_p", "top_k", "min_p")
RENDERER = "inflight.serve.verifiers_renderer.AppendingRenderer"  # turns append to the engine's ids: see that module


class TraceError(ValueError):
    """A finished trace is not one token stream the engine sampled; the message says where it differs."""


class GenerateBody(msgspec.Struct):
    """The fields of vLLM 0.32's `GenerateRequest` a text-only client sends; unknown ones are ignored."""

    token_ids: list[int]
    sampling_params: dict[str, Any] = {}
    model: str | None = None
    cache_salt: str | None = None
    features: Any = None
    content_parts: Any = None
    stream: bool | None = False


@dataclass
class ModelTurn:
    prompt_ids: list[int]
    done: Completion


@dataclass
class EpisodeWatch:
    """One episode as the endpoint and its runner share it: its model turns, whether one is generating, when the
    environment last got control back, and whether it is counted in the driver's `requests_inflight`."""

    request_id: str
    turns: list[ModelTurn] = field(default_factory=list)
    calls: int = 0
    generating: int = 0
    since: float = field(default_factory=time.monotonic)
    generate_s: float = 0.0
    counted: bool = True  # the first turn is counted by the driver at admission
    engine_error: BaseException | None = None
    trace: Any = None  # the episode's verifiers Trace once minted: its tokens so far, even when the episode is ended

    def env_held_s(self) -> float:
        """Seconds the environment has held control without a model call in flight."""
        return 0.0 if self.generating else time.monotonic() - self.since


class TokenEndpoint:
    """`POST /inference/v1/generate` and `GET /v1/models` on 127.0.0.1 for verifiers' train client (module docstring).
    `sample(watch, body)` generates one turn; `watches` maps a trace id to its episode's watch."""

    def __init__(
        self, sample: Callable[[EpisodeWatch, GenerateBody], Awaitable[Completion]], model: str, max_model_len: int
    ):
        self.sample, self.model, self.max_model_len = sample, model, max_model_len
        self.key = secrets.token_urlsafe(24)
        self.watches: dict[str, EpisodeWatch] = {}
        self.base_url = ""
        self._runner: web.AppRunner | None = None
        self._encode = msgspec.json.Encoder().encode
        self._decode = msgspec.json.Decoder(GenerateBody).decode

    async def __aenter__(self) -> TokenEndpoint:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _json(self, value: Any, status: int = 200) -> web.Response:
        return web.Response(body=self._encode(value), status=status, content_type="application/json")

    def _error(self, status: int, message: str) -> web.Response:
        return self._json({"error": {"message": message, "type": "BadRequestError", "code": status}}, status)

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
        return self._json({"object": "list", "data": [card]})

    async def _generate(self, request: web.Request) -> web.Response:
        if not secrets.compare_digest(request.headers.get(KEY_HEADER, ""), self.key):
            return self._error(401, f"missing or wrong {KEY_HEADER}")
        watch = self.watches.get(request.headers.get(SESSION_HEADER, ""))
        if watch is None:
            return self._error(404, f"{SESSION_HEADER} names no running episode")
        try:
            body = self._decode(await request.read())
        except msgspec.DecodeError as exc:
            return self._error(400, f"not a generate request: {exc}")
        if body.features is not None or body.content_parts is not None:
            return self._error(400, "multimodal inputs (features, content_parts) are not supported: text only")
        if body.stream:
            return self._error(400, "stream is true: this endpoint answers whole responses only")
        try:
            done = await self.sample(watch, body)
        except ValueError as exc:
            return self._error(400, str(exc))
        except Exception as exc:  # the engine's failure: the episode's runner re-raises it, not the environment's
            watch.engine_error = exc
            return self._error(500, f"the engine failed: {exc!r}")
        return self._json(generate_response(done, body.token_ids))


def generate_response(done: Completion, prompt_ids: list[int]) -> dict[str, Any]:
    """vLLM 0.32's tokens-mode `GenerateResponse`, each logprob entry also with renderers' `token` spelling."""
    entries = [
        {"token": f"token_id:{t}", "token_id": t, "logprob": lp}
        for t, lp in zip(done.token_ids, done.logprobs, strict=True)
    ]
    spans, start = [], 0
    for i in range(1, len(done.versions) + 1):
        if i == len(done.versions) or done.versions[i] != done.versions[start]:
            spans.append({"version": str(done.versions[start]), "start": start, "end": i})
            start = i
    choice = {
        "index": 0,
        "finish_reason": done.finish_reason,
        "token_ids": list(done.token_ids),
        "logprobs": {"content": entries},
        "weight_versions": spans,
    }
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(done.token_ids)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {"request_id": done.request_id, "prompt_token_ids": list(prompt_ids), "choices": [choice], "usage": usage}


def sampled_spans(mask: list[bool]) -> list[tuple[int, int]]:
    """The [start, end) runs of True in `mask`."""
    spans, start = [], None
    for i, sampled in enumerate([*mask, False]):
        if sampled and start is None:
            start = i
        elif not sampled and start is not None:
            spans.append((start, i))
            start = None
    return spans


def trace_into_episode(ep: Episode, trace, turns: list[ModelTurn]) -> None:
    """`ep`'s tokens from the trace's one branch, each sampled span matched exactly to an engine turn (module
    docstring); TraceError where they differ."""
    branches = [b for b in trace.branches if b.trainable]
    if len(branches) != 1:
        raise TraceError(
            f"the trace has {len(branches)} trainable branches (a re-rendered history, compaction or subagents): "
            "one rollout needs one token stream"
        )
    ids, spans = branches[0].token_ids, sampled_spans(branches[0].sampled_mask)
    if not spans:
        raise TraceError("the trace has no sampled tokens: the harness never called the model")
    ep.prompt_ids, at, k = ids[: spans[0][0]], spans[0][0], 0
    for start, end in spans:
        ep.add_env(ids[at:start])
        while k < len(turns) and not (turns[k].prompt_ids == ids[:start] and turns[k].done.token_ids == ids[start:end]):
            k += 1  # a call the harness discarded (retried, or a branch not taken)
        if k == len(turns):
            raise TraceError(
                f"the trace's sampled tokens {start}..{end} are not what the engine sampled after exactly that "
                f"prompt ({len(turns)} engine turns in this episode)"
            )
        ep.add_policy(turns[k].done)
        at, k = end, k + 1
    ep.add_env(ids[at:])


class VerifiersRunner:
    """Runs episodes of a `VerifiersEnv` on the serve's engine; the constructor is `EpisodeRunner`'s, so the driver
    picks either by the environment (the context's `tool_latency` does not apply)."""

    def __init__(self, env: VerifiersEnv, context: RunnerContext):
        self.env, self.sampler, self.cfg, self.stats = env, context.sampler, context.cfg, context.stats
        self.notify, self.sampling, self.turns = context.notify, context.sampling, TurnTokens(context.tokenizer)
        cfg = self.cfg
        env.cap_turns(cfg.max_turns)
        model = str(resolve_model(cfg.model))
        self.endpoint = TokenEndpoint(self._sample, model, cfg.max_model_len)
        self._model, self._ready, self._started, self._ctx = model, None, None, None
        self._closing = asyncio.Event()
        self._warned: set[str] = set()

    async def run(self, problem: Problem, request_id: str) -> Episode:
        """The whole episode; its first turn is already counted in `stats.requests_inflight` by the driver."""
        ep, watch = Episode(submitted=time.time()), EpisodeWatch(request_id)
        trace = None
        try:
            episode = await self._episode(self.env.task_of(problem.id), watch)
            trace = next((t for t in episode.traces if t.agent.trainable), None)
            _raise_failure(episode, trace)
            filled = Episode(submitted=ep.submitted)  # left untouched by a trace that is not the engine's
            trace_into_episode(filled, trace, watch.turns)
            ep = filled
            ep.env_reward = trace.reward
            if trace.stop_condition == "max_turns":
                ep.finish_reason = "max_turns"
            account_rewards(self.stats, trace)
        except Exception as exc:
            if watch.engine_error is not None:
                raise watch.engine_error from exc  # the engine's failure: the group fails, as for any environment
            ep = self._failed(ep, problem, request_id, trace or watch.trace, watch, exc)
        finally:
            if watch.counted:
                self.stats.requests_inflight -= 1
                self.notify()
        ep.finished = time.time()
        ep.env_s = max(0.0, ep.finished - ep.submitted - watch.generate_s)
        return ep

    def _failed(self, ep: Episode, problem: Problem, request_id: str, trace, watch: EpisodeWatch, exc) -> Episode:
        """An environment failure: reward 0, the tokens the trace has (if they are the engine's), else the prompt."""
        if trace is not None and not ep.token_ids:
            kept = Episode(submitted=ep.submitted)
            with contextlib.suppress(TraceError):
                trace_into_episode(kept, trace, watch.turns)
                ep = kept
        ep.env_error, ep.env_error_kind = describe_failure(exc)
        ep.finish_reason = "env_error"
        if not ep.prompt_ids:
            ep.prompt_ids = self.turns.prompt_ids(problem.chat())
        log.error("environment ended episode %s after %d turns (scored 0): %s", request_id, ep.turns, ep.env_error)
        return ep

    async def _episode(self, task, watch: EpisodeWatch):
        """verifiers' `run_episode`, ended when its environment holds control past `--env-timeout-s`."""
        await self._start()
        watch.since = time.monotonic()  # the serve's own start-up is not the environment's time
        minted: list[str] = []

        def on_trace(trace) -> None:
            minted.append(trace.id)
            self.endpoint.watches[trace.id], watch.trace = watch, trace

        run = asyncio.ensure_future(self.env.env.run_episode(task, self._ctx, on_trace=on_trace))
        try:
            while not run.done():
                await asyncio.wait({run}, timeout=WATCH_S)
                if not run.done() and watch.env_held_s() > self.cfg.env_timeout_s:
                    raise HeldControl(watch.env_held_s(), self.cfg.env_timeout_s, watch.calls)
            return run.result()
        finally:
            if not run.done():
                run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            for trace_id in minted:
                self.endpoint.watches.pop(trace_id, None)

    async def _sample(self, watch: EpisodeWatch, body: GenerateBody) -> Completion:
        """One model turn of an episode on the engine, counted in the driver's `requests_inflight`."""
        params = turn_sampling(self.sampling, self.cfg, body, self._warned)
        rid = watch.request_id if not watch.calls else f"{watch.request_id}-t{watch.calls}"
        watch.calls, watch.generating = watch.calls + 1, watch.generating + 1
        if not watch.counted:
            self.stats.requests_inflight, watch.counted = self.stats.requests_inflight + 1, True
        start = time.monotonic()
        try:
            done = await self.sampler.generate(list(body.token_ids), params, rid)
        finally:
            self.stats.requests_inflight, watch.counted = self.stats.requests_inflight - 1, False
            watch.generating, watch.since = watch.generating - 1, time.monotonic()
            watch.generate_s += watch.since - start
            self.notify()
        watch.turns.append(ModelTurn(list(body.token_ids), done))
        return done

    async def start(self) -> None:
        """Bring the endpoint and the environment up and prepare its harness's program before the serve admits a
        group (inflight/serve/app.py); raises what stops it, which ends the serve at start."""
        await self._start()

    async def _start(self) -> None:
        """The endpoint and the environment's serving resources, brought up by the first episode."""
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_future()
            self._started = asyncio.ensure_future(self._serve(self._ready))
        await asyncio.shield(self._ready)  # a failed start raises here, in every episode
        if self._started.done():
            raise RuntimeError(f"env verifiers:{self.env.name} is not serving (closed, or failed: see the log)")

    async def _serve(self, ready: asyncio.Future) -> None:
        from verifiers.v1.clients import ModelContext, TrainClientConfig
        from verifiers.v1.types import SamplingConfig

        try:
            async with self.endpoint, self.env.env.serving():
                os.environ.setdefault("INFLIGHT_TOKEN_ENDPOINT", "loopback")  # nothing secret: the key is a header
                client = TrainClientConfig(
                    base_url=self.endpoint.base_url,
                    api_key_var="INFLIGHT_TOKEN_ENDPOINT",
                    headers={KEY_HEADER: self.endpoint.key},
                    renderer_model_name=self._model,
                    renderer={"name": "custom", "import_path": RENDERER},
                )
                sampling = SamplingConfig(
                    temperature=self.cfg.temperature, top_p=self.cfg.top_p, max_tokens=self.cfg.max_tokens
                )
                self._ctx = ModelContext(model=self._model, client=client, sampling=sampling)
                check_tools(self.env, self.turns.tokenizer, self._model)
                if self.env.harness_config is not None:  # once, so that no episode prepares it on its own clock
                    await prepare_program(self.env.name, self.env.harness_config)
                ready.set_result(None)
                await self._closing.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    async def close(self) -> None:
        """Take the endpoint and the environment's serving resources down (the serve's exit does it too)."""
        self._closing.set()
        if self._started is not None:
            await asyncio.gather(self._started, return_exceptions=True)


def check_tools(env: VerifiersEnv, tokenizer, model: str) -> None:
    """ValueError in one line where the env's harness offers the model tools and the model's chat template cannot
    render them in a format the serve parses (inflight/serve/verifiers_renderer.py): the harness, what it needs, how."""
    offered = offered_tools(env.harness_config)
    gap = tool_template_gap(tokenizer) if offered is not None else None
    if gap is not None:
        raise ValueError(
            f"env verifiers:{env.name}: harness {env.harness_config.id!r} offers the model its {offered}, and model "
            f"{model}'s chat template {gap}: the serve renders tools with the model's own chat template and reads "
            f"its calls with vLLM's {TOOL_CALL_PARSER!r} parser (`<tool_call>` JSON, as Qwen2.5, Qwen3 and Hermes "
            f"templates write them); use such a model, or the null harness ({NULL_HARNESS})"
        )


def turn_sampling(sampling, cfg, body: GenerateBody, warned: set[str]):
    """The serve's sampler (`sampling(max_tokens)`, the driver's) for one turn: the environment's max_tokens up to
    --max-tokens and the room left, its stop token ids added; a sampler setting of its own is warned about once."""
    room = cfg.max_model_len - len(body.token_ids)
    if room < 1:
        raise ValueError(f"the prompt is {len(body.token_ids)} tokens: no room under --max-model-len")
    asked = body.sampling_params.get("max_tokens") or cfg.max_tokens
    params = sampling(min(int(asked), cfg.max_tokens, room))
    for key in SAMPLER_KEYS:
        value = body.sampling_params.get(key)
        if value is not None and value != getattr(params, key) and key not in warned:
            warned.add(key)
            log.warning("env asks %s %s; the serve samples with its own (%s)", key, value, getattr(params, key))
    stop_ids = [int(t) for t in body.sampling_params.get("stop_token_ids") or ()]
    return msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *stop_ids])


def account_rewards(stats, trace) -> None:
    """Each reward's own score into the serve's per-reward means."""
    each = {name: [None if r is None else r.score] for name, r in trace.rewards.items()}
    stats.reward_means.add(GroupScores(total=[trace.reward], each=each))


class HeldControl(TimeoutError):
    """The environment held control past --env-timeout-s; before the first model call, that is its harness's setup or
    program start (verifiers' built-in harnesses prepare a uv script there)."""

    def __init__(self, held_s: float, limit_s: float, calls: int):
        where = f"after {calls} model call{'s' if calls > 1 else ''}" if calls else "before its first model call"
        hint = "" if calls else " (in its harness's setup or its program's start)"
        super().__init__(
            f"the environment held control {held_s:.1f} s {where}, longer than --env-timeout-s {limit_s}{hint}"
        )
        self.kind = "timeout after a model call" if calls else "timeout before the first model call"


_HARNESS_EXIT = re.compile(r"harness '([^']*)' exited (-?\d+): (.*)", re.DOTALL)
STDERR_LINES = 3  # a failed harness program's last stderr lines kept in the episode's error: its traceback's cause


def describe_failure(exc: BaseException) -> tuple[str, str]:
    """An episode's failure as (its error, its kind): a harness program's exit names the harness, its exit code and
    its last stderr lines; a timeout says whether the model was ever called; any other, its type."""
    if isinstance(exc, HeldControl):
        return f"TimeoutError: {exc}", exc.kind
    text = str(exc)
    exited = _HARNESS_EXIT.search(text)
    if exited is not None:
        harness, code, detail = exited.groups()
        tail = " | ".join(line.strip() for line in detail.strip().splitlines()[-STDERR_LINES:] if line.strip())
        return f"harness {harness!r} exited {code}, its last stderr lines: {tail}", f"harness {harness} exited {code}"
    if "failed to prepare uv script" in text:
        detail = text.split("failed to prepare uv script", 1)[1].lstrip(": ")
        tail = " | ".join(line.strip() for line in detail.strip().splitlines()[-STDERR_LINES:] if line.strip())
        return f"a uv script failed to prepare, its last stderr lines: {tail}", "uv script preparation failed"
    if isinstance(exc, RecordedFailure):
        return text, exc.kind
    return f"{type(exc).__name__}: {text}", type(exc).__name__


class RecordedFailure(RuntimeError):
    """A failure verifiers recorded on the episode or its trace; `kind` is verifiers' error type (HarnessError, ...)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def _raise_failure(episode, trace) -> None:
    """The episode's or its trace's recorded failure as an exception (verifiers records failures, never raises)."""
    errors = [*episode.errors, *(trace.errors if trace is not None else [])]
    if errors:
        raise RecordedFailure(errors[-1].type, errors[-1].message)
    if trace is None:
        raise TraceError("the episode has no trainable trace")
    if not trace.ok or not episode.ok:
        raise RuntimeError(f"the trace did not complete (stop condition {trace.stop_condition!r})")
