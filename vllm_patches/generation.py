"""VersionedGeneration: one completion from vLLM's AsyncLLM with one behaviour logprob and one policy version per token.

Reached as `InflightEngine.generation` (the serve's episodes and evaluation, the demo, tests and benchmarks).
It owns what the raw AsyncLLM leaves to the caller:
- every token's version, from vLLM's `weight_versions` spans (`spans_to_versions`), and the version of the oldest KV it
  attended to (vllm_patches/kv_age.py);
- every request carries `cache_salt=<version at submission>`, so no prefix-cache hit crosses weight versions;
- a request aborted by an abort-resume update is resubmitted (prompt + partial tokens, remaining budget) and stitched.

`RunningRequests` is what an update's choreography (vllm_patches/update_frontend.py) needs to know of generation: which
requests run, which one it aborted, and when generation may go on; `ServedVersion` is the version each commit sets.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_patches.kv_age import kv_ages
from vllm_patches.routes import RoutedExperts, check_route_coverage, stitch
from vllm_patches.rpc import rpc_result

if TYPE_CHECKING:  # vLLM is imported when a request is submitted: this module is imported for the config checks too
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM


@dataclass
class Completion:
    """One finished sample: what the learner needs for token-level importance sampling."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    # per token, the version that computed the oldest KV it attended to (vllm_patches/kv_age.py): equal to `versions`
    # until a commit with kv="keep" lets a request go on over KV of the older weights; -1 where none was recorded
    kv_versions: list[int] = field(default_factory=list)
    text: str = ""
    resubmissions: int = 0
    first_token_time: float = 0.0  # time.time() when the first token came out
    # --routing-replay on: the top-k experts of every fed position (prompt + tokens − 1) in every MoE layer
    # (vllm_patches/routes.py); None when routes are not recorded
    routes: RoutedExperts | None = None


class VersionSpanError(RuntimeError):
    """vLLM's weight-version spans do not cover a request's output: its tokens' versions would be guesses."""


def spans_to_versions(spans, n_tokens: int) -> list[int]:
    """Expand vLLM's `weight_versions` spans to one int version per generated token."""
    if not spans:
        if n_tokens:
            raise VersionSpanError("the engine reported no weight version for generated tokens")
        return []
    versions = []
    for span in spans:
        versions.extend([int(span.version)] * (span.end - span.start))
    if len(versions) != n_tokens:
        raise VersionSpanError(f"weight-version spans cover {len(versions)} tokens, the output has {n_tokens}")
    return versions


@dataclass
class ServedVersion:
    """The weight version the engine serves: set by each commit, stamped into every new request's cache salt."""

    number: int

    @property
    def cache_salt(self) -> str:
        return f"inflight-v{self.number}"


class RunningRequests:
    """The requests generating now, those an abort-resume update aborted, and the seconds with none running."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.aborted: set[str] = set()
        self.resumed = asyncio.Event()  # cleared while an abort-resume update holds resubmissions back
        self.resumed.set()
        self._empty_s, self._empty_since = 0.0, time.monotonic()

    def started(self, rid: str) -> None:
        if not self.ids and self._empty_since is not None:
            self._empty_s += time.monotonic() - self._empty_since
            self._empty_since = None
        self.ids.add(rid)

    def finished(self, rid: str) -> None:
        self.ids.discard(rid)
        if not self.ids and self._empty_since is None:
            self._empty_since = time.monotonic()

    def abort_all(self) -> None:
        """Every running request is being aborted by an update: each is resubmitted once `resume()` is called."""
        self.resumed.clear()
        self.aborted |= self.ids

    def resume(self) -> None:
        self.resumed.set()

    def take_aborted(self, rid: str) -> bool:
        """Whether `rid` was aborted by an update (answered once: its resubmission runs under another id)."""
        if rid not in self.aborted:
            return False
        self.aborted.discard(rid)
        return True

    @property
    def idle_s(self) -> float:
        """Seconds so far with no request to generate for (a starved engine), not counting update stalls."""
        current = time.monotonic() - self._empty_since if self._empty_since is not None else 0.0
        return self._empty_s + current


class VersionedGeneration:
    """Submits requests to `llm` under the served version's cache salt and stitches what comes back per token."""

    def __init__(
        self,
        llm: AsyncLLM,
        served: ServedVersion,
        requests: RunningRequests,
        lora: LoRARequest | None = None,
        routes: bool = False,
    ):
        self.llm, self.served, self.requests = llm, served, requests
        self.lora = lora  # the serve's adapter (vllm_patches/adapter.py), on every request; None: the model alone
        self.record_routes = routes  # the workers record routes (InflightEngine.start, --routing-replay on)
        self.tokens_generated = 0  # every token streamed out, finished or not (for live tokens/s)
        # Ablation counters: requests resubmitted after an abort-resume update and the prompt + partial tokens their
        # resubmission prefills again.
        self.resubmitted = self.recomputed_tokens = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> Completion:
        """Generate one completion; a request aborted by an abort-resume update is resubmitted and stitched."""
        if params.n != 1:
            raise ValueError(f"SamplingParams.n is {params.n}: submit one request per sample (group = n requests)")
        done = Completion(request_id, list(prompt_ids), [], [], [], "length")
        while True:
            rid = request_id if not done.resubmissions else f"{request_id}#resume{done.resubmissions}"
            final = await self._generate_once(done, params, rid)
            spans = await self.llm.engine_core.call_utility_async("inflight_kv_spans", rid)
            _append(done, final, [tuple(s) for s in spans])
            if self.record_routes:
                done.routes = stitch(done.routes, await self._routes(rid))
            if not self.requests.take_aborted(rid):
                if self.record_routes:
                    check_route_coverage(done.routes, len(done.prompt_ids) + len(done.token_ids) - 1, request_id)
                return done
            await self.requests.resumed.wait()
            done.resubmissions += 1
            self.resubmitted += 1
            self.recomputed_tokens += len(done.prompt_ids) + len(done.token_ids)

    async def _routes(self, rid: str) -> RoutedExperts | None:
        routes = await self.llm.engine_core.call_utility_async("inflight_routes", rid)
        return None if routes is None else rpc_result(routes, RoutedExperts, "inflight_routes")

    async def _generate_once(self, done: Completion, params: SamplingParams, rid: str) -> RequestOutput:
        from vllm.inputs import TokensPrompt

        budget = params.max_tokens - len(done.token_ids)
        sub = params.clone()
        sub.max_tokens, sub.logprobs = max(budget, 1), 0
        await self.requests.resumed.wait()
        prompt = TokensPrompt(prompt_token_ids=done.prompt_ids + done.token_ids, cache_salt=self.served.cache_salt)
        self.requests.started(rid)
        try:
            final, seen = None, 0
            async for output in self.llm.generate(prompt, sub, request_id=rid, lora_request=self.lora):
                final = output
                produced = len(output.outputs[0].token_ids) if output.outputs else 0
                self.tokens_generated += produced - seen
                if produced and not done.first_token_time:
                    done.first_token_time = time.time()
                seen = produced
        finally:
            self.requests.finished(rid)
        return final


def _append(done: Completion, final: RequestOutput, kv_spans: list[tuple[int, int]]) -> None:
    """Add one submission's output (the whole request, or the part before an abort) to `done`."""
    out = final.outputs[0]
    done.token_ids += list(out.token_ids)
    done.logprobs += [lp[t].logprob for lp, t in zip(out.logprobs or [], out.token_ids, strict=True)]
    done.versions += spans_to_versions(out.weight_versions, len(out.token_ids))
    done.kv_versions += kv_ages(kv_spans, len(out.token_ids))
    done.text += out.text
    done.finish_reason = out.finish_reason or "length"
