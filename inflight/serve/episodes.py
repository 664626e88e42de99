"""Episodes: a policy turn, the environment's answer, the next turn, ... — token in, token out, every token versioned.

Called by the driver (inflight/serve/driver.py), one `EpisodeRunner.run` per sample. The environment (inflight/envs/)
sees text; this module owns the tokens. Each turn's prompt is the previous turn's prompt ids + the ids vLLM generated
+ the environment's messages rendered as ids (`TurnTokens.env_ids`), so nothing earlier is ever re-tokenised and the
learner trains on exactly the ids the engine saw. Each turn is its own engine request salted by the version it is
submitted under, so a commit between two turns shows up as a version change inside the episode.

Environment calls run under `--env-timeout-s` (plain functions each in a daemon thread, so a hanging one can block
neither the serve's event loop nor its exit); one that raises, times out or answers garbage ends the episode with
`env_error` set, logged, counted by the driver, scored 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from inflight.envs.base import Environment, EpisodeState, check_feedback, check_messages
from inflight.tasks.base import Message, Problem
from vllm_patches.generation import Completion
from vllm_patches.routes import RoutedExperts, stitch

if TYPE_CHECKING:  # vLLM and transformers are imported once a serve really starts (inflight/serve/app.py)
    from transformers import PreTrainedTokenizerBase
    from vllm import SamplingParams

    from inflight.serve.config import ServeConfig
    from inflight.serve.driver import DriverStats

log = logging.getLogger("inflight.serve")
ENV_VERSION = -1  # the version an environment token carries: no policy sampled it
_U, _A = "inflight-user-7f3a", "inflight-assistant-9c1e"  # stand-ins to find where a template opens/closes a turn


class TemplateError(ValueError):
    """The chat template cannot append turns without re-rendering earlier ones; the message names the template."""


class TurnTokens:
    """Chat messages as the token ids a conversation appends, for one tokenizer's chat template.

    `prompt_ids(messages)` is the first turn's prompt. `env_ids(turn_ids, messages)` the ids that follow a policy turn
    whose ids were `turn_ids`: the rest of the assistant turn's closing (all of it when the turn stopped on a stop
    string or the budget instead of its end-of-turn token), then `messages` and the next assistant header, exactly as
    the template renders them after an assistant turn.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._base = [{"role": "user", "content": _U}, {"role": "assistant", "content": _A}]
        base = self._render(self._base, generation_prompt=False)
        self._base_text = base
        self.closing = base[base.rindex(_A) + len(_A) :]  # e.g. "<|im_end|>\n" for ChatML

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    def env_ids(self, turn_ids: list[int], messages: list[Message]) -> list[int]:
        full = self._render(self._base + messages, generation_prompt=True)
        if not full.startswith(self._base_text):
            raise TemplateError(
                "the chat template renders earlier turns differently once a message follows "
                "them; multi-turn episodes need a template that only appends (ChatML, Llama 3, "
                "...)"
            )
        closing = self.closing
        ended = self.tokenizer.decode(turn_ids[-1:], skip_special_tokens=False) if turn_ids else ""
        if ended and closing.startswith(ended):  # the turn ended on the template's end-of-turn token
            closing = closing[len(ended) :]
        return list(self.tokenizer.encode(closing + full[len(self._base_text) :], add_special_tokens=False))


@dataclass
class Episode:
    """One sample: the first prompt, then every later token with its role, logprob and versions.

    Policy tokens keep vLLM's behaviour logprob, the version that sampled them and their KV version; environment
    tokens carry logprob 0.0, version −1 and KV version −1, and `env[i]` True. `text`/`last_ids` are the last policy
    turn's (what the task's rewards score)."""

    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_versions: list[int] = field(default_factory=list)
    env: list[bool] = field(default_factory=list)
    turns: int = 0
    text: str = ""
    last_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    env_reward: float = 0.0
    env_s: float = 0.0
    tool_errors: int = 0
    env_error: str = ""  # why an environment call failed; the episode then scores 0
    env_error_kind: str = ""  # its kind, what the serve counts errors by ("TimeoutError in step", "harness exited 1")
    resubmissions: int = 0
    submitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    # --routing-replay on: every fed position's experts (vllm_patches/routes.py), later turns' prefills included
    routes: RoutedExperts | None = None

    def add_policy(self, done) -> None:
        """A finished engine request (vllm_patches/generation.py:Completion) as this episode's next turn."""
        self.token_ids += done.token_ids
        self.logprobs += done.logprobs
        self.versions += done.versions
        self.kv_versions += done.kv_versions or [-1] * len(done.token_ids)
        self.env += [False] * len(done.token_ids)
        self.text, self.last_ids, self.finish_reason = done.text, list(done.token_ids), done.finish_reason
        self.resubmissions += done.resubmissions
        self.first_token = self.first_token or done.first_token_time
        self.routes = stitch(self.routes, done.routes)  # a later turn's prompt is this whole episode so far
        self.turns += 1

    def add_env(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [ENV_VERSION] * len(ids)
        self.kv_versions += [ENV_VERSION] * len(ids)
        self.env += [True] * len(ids)


class Sampler(Protocol):
    """What an episode asks of the engine: one request's completion, with a logprob and a weight version per token
    (vllm_patches/generation.py:VersionedGeneration.generate)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> Completion: ...


class VersionedEngine(Protocol):
    """What the driver and the evaluation read of the engine (vllm_patches/engine.py:InflightEngine): the weight
    version it serves (admission, eval's schedule), its generation, which episodes sample from, and whether vLLM's
    EngineCore died (the serve's health watch, inflight/serve/app.py:_healthy)."""

    version: int
    generation: Sampler
    dead: bool


@dataclass(frozen=True)
class RunnerContext:
    """What the driver hands whichever episode runner its environment takes (this module's `EpisodeRunner`, or
    inflight/serve/verifiers_runner.py's): the engine's generation (`sampler`); `stats`, the driver's `DriverStats`
    (its `requests_inflight` counts a sample while one of its turns generates); `notify`, which tells the driver's
    admission something changed; `sampling(max_tokens)`, which builds a turn's `SamplingParams`; `tool_latency`
    (--tool-latency), a simulated tool call's seconds after each turn."""

    sampler: Sampler
    tokenizer: PreTrainedTokenizerBase
    cfg: ServeConfig
    stats: DriverStats
    notify: Callable[[], None]
    sampling: Callable[[int], SamplingParams]
    tool_latency: Callable[[], float] | None = None


class EpisodeRunner:
    """Runs episodes of one environment on the engine's generation (`RunnerContext`)."""

    def __init__(self, env: Environment, context: RunnerContext):
        self.env, self.sampler, self.cfg, self.stats = env, context.sampler, context.cfg, context.stats
        self.notify, self.sampling, self.tool_latency = context.notify, context.sampling, context.tool_latency
        self.turns = TurnTokens(context.tokenizer)

    async def run(self, problem: Problem, request_id: str) -> Episode:
        """The whole episode; its first turn is already counted in `stats.requests_inflight` by the driver."""
        ep = Episode(submitted=time.time())
        try:
            await self._turns(ep, problem, request_id)
        except (Exception, asyncio.TimeoutError) as exc:
            if not getattr(exc, "inflight_env", False):
                raise  # the engine's failure, not the environment's: the group fails as before
            ep.env_error, ep.finish_reason = str(exc), "env_error"
            ep.env_error_kind = f"{type(exc).__name__} {'in step' if ep.turns else 'before the first model call'}"
            log.error("environment ended episode %s after %d turns (scored 0): %s", request_id, ep.turns, exc)
            if not ep.prompt_ids:  # reset failed: the rollout keeps the task's own prompt and no tokens
                ep.prompt_ids = self.turns.prompt_ids(problem.chat())
        ep.finished = time.time()
        return ep

    async def _turns(self, ep: Episode, problem: Problem, request_id: str) -> None:
        counted = True  # in stats.requests_inflight: the first turn by the driver at admission, later ones here
        try:
            messages = check_messages(await self._call(ep, self.env.reset, problem), "reset")
            ep.prompt_ids = _env_step(self.turns.prompt_ids, messages)
            state = EpisodeState(problem, list(messages))
            while True:
                room = self.cfg.max_model_len - len(ep.prompt_ids) - len(ep.token_ids)
                if room < 1:
                    ep.finish_reason = "context"
                    return
                if not counted:
                    self.stats.requests_inflight, counted = self.stats.requests_inflight + 1, True
                rid = request_id if not ep.turns else f"{request_id}-t{ep.turns}"
                try:
                    done = await self.sampler.generate(
                        ep.prompt_ids + ep.token_ids, self.sampling(min(self.cfg.max_tokens, room)), rid
                    )
                finally:
                    self.stats.requests_inflight, counted = self.stats.requests_inflight - 1, False
                    self.notify()
                if not await self._after_turn(ep, state, done):
                    return
        finally:
            if counted:
                self.stats.requests_inflight -= 1
                self.notify()

    async def _after_turn(self, ep: Episode, state: EpisodeState, done) -> bool:
        """Record the turn, ask the environment; True when the episode goes on (its messages appended as tokens)."""
        ep.add_policy(done)
        state.messages.append({"role": "assistant", "content": done.text})
        state.turn = ep.turns
        if self.tool_latency is not None:  # --tool-latency: a simulated tool call, environment time too
            delay = self.tool_latency()
            await asyncio.sleep(delay)
            ep.env_s += delay
        feedback = _env_step(check_feedback, await self._call(ep, self.env.step, state, done.text))
        ep.env_reward += feedback.reward or 0.0
        ep.tool_errors += feedback.tool_errors
        if feedback.done or not feedback.messages:
            return False
        if ep.turns >= self.cfg.max_turns:
            ep.finish_reason = "max_turns"
            return False
        ep.add_env(_env_step(self.turns.env_ids, done.token_ids, feedback.messages))
        state.messages.extend(feedback.messages)
        return True

    async def _call(self, ep: Episode, fn, *args):
        """One environment call under the timeout; its failure is marked as the environment's."""
        start = time.perf_counter()
        try:
            if inspect.iscoroutinefunction(fn):
                result = await asyncio.wait_for(fn(*args), self.cfg.env_timeout_s)
            elif getattr(self.env, "run_inline", False):  # quick by its own account: a thread would cost more
                result = fn(*args)
            else:
                result = await asyncio.wait_for(_in_thread(fn, *args), self.cfg.env_timeout_s)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, self.cfg.env_timeout_s)
            return result
        except asyncio.TimeoutError:
            raise _marked(
                TimeoutError(
                    f"{getattr(fn, '__qualname__', fn)} took longer than --env-timeout-s {self.cfg.env_timeout_s}"
                )
            ) from None
        except Exception as exc:
            raise _marked(exc) from exc
        finally:
            ep.env_s += time.perf_counter() - start


def _in_thread(fn, *args) -> asyncio.Future:
    """`fn(*args)` in a daemon thread of its own: a call that never returns leaks that thread, never the serve (a
    pool's workers are joined at exit; a daemon thread is not)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():  # not timed out and cancelled meanwhile
            (future.set_result if ok else future.set_exception)(value)

    def work() -> None:
        try:
            value, ok = fn(*args), True
        except BaseException as exc:  # noqa: BLE001 - handed to the episode, which counts it
            value, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the serve's loop closed while this call hung
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=work, name="inflight-env", daemon=True).start()
    return future


def _env_step(fn, *args):
    """`fn(*args)` where a failure is the environment's answer's fault (bad messages, a template that cannot append)."""
    try:
        return fn(*args)
    except Exception as exc:
        raise _marked(exc) from exc


def _marked(exc: BaseException) -> BaseException:
    exc.inflight_env = True  # type: ignore[attr-defined]
    return exc
