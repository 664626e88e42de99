"""InflightEngine: vLLM's AsyncLLM with in-flight weight updates in five interruption modes and exact token versions.

Called by `inflight.serve` (and the tests and benchmarks). It owns three things the raw AsyncLLM leaves to the caller:
- `generate()` returns a `Completion` with one behaviour logprob and one policy version per token, and transparently
  resubmits requests that the abort-resume mode aborted (prompt + partial tokens, remaining budget);
- every request carries `cache_salt=<version at submission>`, so no prefix-cache hit crosses weight versions;
- `update()` runs one weight update in the chosen mode:

  never-stop    stage in the background while decoding continues; commit between two steps (the only stall)
  keep-pause    pause (keep, KV kept) for the whole transfer, commit, resume — what PipelineRL/TRL do
  drain         pause (wait: running requests finish, new ones queue), transfer, commit, resume
  abort-resume  pause (abort), transfer, commit, resume; aborted requests are resubmitted by `generate()`
  blocking      the engine must be idle (synchronous RL: generate, train, update); refused otherwise
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from inflight.machine import is_cuda, serve_device
from inflight.wire.weights import UPDATE_MEMORY
from vllm_patches.kv_age import kv_ages
from vllm_patches.rpc import CommitApplied, CommitResult, GroupJoined, StageStatus, rpc_result

MODES = ("never-stop", "keep-pause", "drain", "abort-resume", "blocking")
HEAD_DTYPES = ("model", "float32")
WORKER_EXTENSION = "vllm_patches.worker_extension.InflightWorkerExtension"
STAGE_POLL_S = 0.1  # never-stop: the longest wait between two "staged yet?" polls (polls back off from 10 ms to it)


@dataclass
class EngineConfig:
    """What `InflightEngine.start` builds AsyncLLM from. Defaults run the embedded demo on CPU."""

    model: str
    max_model_len: int = 1024
    max_num_seqs: int = 256
    seed: int = 0
    # False lets vLLM compile the model and, on CUDA, capture CUDA graphs, which hold parameter addresses: allowed
    # only with update_memory "low", which commits into every parameter's existing storage (check_graph_safe_updates).
    enforce_eager: bool = True
    # CPU: the KV cache size, allocated and zeroed at start (first-touch page faults cost seconds). Unused on CUDA.
    kv_cache_gib: float = 1.0
    # CUDA: the fraction of the GPU's memory vLLM may take (weights, activations, graphs; the KV cache gets the rest),
    # in (0, 1]. Unused on CPU.
    gpu_memory_utilization: float = 0.9
    dtype: str = "bfloat16"
    enable_prefix_caching: bool = True
    # The LM head's precision: "float32" projects in fp32 (vLLM's head_dtype, through hf_overrides), as the learner's
    # fp32 head does; "model" keeps the engine dtype. Changes nothing when dtype is already float32.
    head_dtype: str = "model"
    update_memory: str = "double"  # one of UPDATE_MEMORY


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


@dataclass
class UpdateReport:
    """What one `update()` cost: `stall_s` is the time generation could not make progress because of it."""

    version: int
    mode: str
    total_s: float = 0.0
    stall_s: float = 0.0
    commit_s: float = 0.0
    receive_s: float = 0.0
    prepare_s: float = 0.0  # loading into the processed copy off the engine thread (update_memory "double")
    bytes: int = 0
    staging_window: tuple[float, float] = (0.0, 0.0)  # wall clock: receive started, all buckets verified
    workers: list[CommitApplied] = field(default_factory=list)


class UpdateError(RuntimeError):
    """A weight update was refused or failed; the live weights and the version are unchanged."""


def check_graph_safe_updates(enforce_eager: bool, update_memory: str) -> None:
    """Refuse graph capture with an update path that installs new parameter storage.

    Contract: raises ValueError naming both flags and the fix when `enforce_eager` is False and `update_memory` is
    "double". A captured CUDA graph replays kernels on the parameter addresses it saw at capture; the double path swaps
    in new tensors by reference, so the graphs would go on computing with the old weights while tokens are tagged with
    the new version. "low" writes every update into the existing storage (every parameter keeps its data_ptr:
    tests/vllm_patches/test_swap_exact.py), which graphs see.
    """
    if not enforce_eager and update_memory == "double":
        raise ValueError(
            "--enforce-eager false with --update-memory double: CUDA graphs hold the parameters' storage addresses "
            "and the double update path installs new storage, so the graphs would keep computing with the old "
            "weights. Pass --update-memory low (commits into every parameter's existing storage), or keep "
            "--enforce-eager true"
        )


def check_engine_config(cfg: EngineConfig) -> None:
    """Raise ValueError naming the field, the value and what is expected for a config vLLM must not be started with."""
    if not cfg.kv_cache_gib > 0:
        raise ValueError(f"kv_cache_gib must be > 0 (got {cfg.kv_cache_gib}): the KV cache size in GiB, e.g. 0.25")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1] (got {cfg.gpu_memory_utilization}): the fraction "
            "of the GPU's memory vLLM may take, e.g. 0.9"
        )
    if cfg.head_dtype not in HEAD_DTYPES:
        raise ValueError(f"head_dtype is {cfg.head_dtype!r}, expected one of {list(HEAD_DTYPES)}")
    check_graph_safe_updates(cfg.enforce_eager, cfg.update_memory)


def memory_kwargs(cfg: EngineConfig, device: str) -> dict:
    """How vLLM sizes its memory on `device`: a fraction of the GPU on CUDA, an explicit KV cache size elsewhere.

    Contract: exactly one of `gpu_memory_utilization` (CUDA) and `kv_cache_memory_bytes` (CPU) is returned; vLLM
    reads an explicit `kv_cache_memory_bytes` in place of the fraction, so passing both would ignore the fraction.
    Raises ValueError for `enforce_eager` False off CUDA (compilation there may freeze the weights).
    """
    if is_cuda(device):
        return {"gpu_memory_utilization": cfg.gpu_memory_utilization}
    if not cfg.enforce_eager:
        # On CPU there are no CUDA graphs to allow: vLLM compiles with Inductor instead, whose freezing may fold the
        # weights into the compiled graph as constants, where no commit path reaches them (notes: vllm-0.32.md).
        raise ValueError(
            "--enforce-eager false on a CPU serve: it enables CUDA graphs on a GPU; on CPU it compiles "
            "the model with Inductor, which may freeze the weights into the graph where updates do not "
            "reach. Keep --enforce-eager true on CPU"
        )
    # vLLM's legacy VLLM_CPU_KVCACHE_SPACE (whole GiB) overrides it when set.
    return {"kv_cache_memory_bytes": int(cfg.kv_cache_gib * (1 << 30))}


def engine_kwargs(cfg: EngineConfig, device: str) -> dict:
    """The keyword arguments of vLLM's `AsyncEngineArgs` for `cfg` on `device` ('cpu' or 'cuda', as
    `inflight.machine.serve_device` says).

    Contract: pure (no vLLM import, no device query), so it is tested without an engine; raises ValueError for a config
    `check_engine_config` refuses. Scheduling is synchronous on every device: a token's version is exact only when the
    step whose output is processed is the step that ran (vLLM's async scheduling overlaps the next step with it).
    """
    check_engine_config(cfg)
    return {
        "hf_overrides": {"head_dtype": cfg.head_dtype},
        "model": cfg.model,
        "dtype": cfg.dtype,
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "seed": cfg.seed,
        "enforce_eager": cfg.enforce_eager,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        **memory_kwargs(cfg, device),
        "logprobs_mode": "processed_logprobs",
        "async_scheduling": False,
        "worker_extension_cls": WORKER_EXTENSION,
    }


def engine_args(cfg: EngineConfig):
    """vLLM's `AsyncEngineArgs` for `cfg` on the device this process serves from (`engine_kwargs`)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**engine_kwargs(cfg, serve_device()))


def spans_to_versions(spans, n_tokens: int) -> list[int]:
    """Expand vLLM's `weight_versions` spans to one int version per generated token."""
    if not spans:
        if n_tokens:
            raise UpdateError("the engine reported no weight version for generated tokens")
        return []
    versions = []
    for span in spans:
        versions.extend([int(span.version)] * (span.end - span.start))
    if len(versions) != n_tokens:
        raise UpdateError(f"weight-version spans cover {len(versions)} tokens, the output has {n_tokens}")
    return versions


class InflightEngine:
    """AsyncLLM plus the weights group, update modes and per-token versions. One per serve process."""

    def __init__(self, llm, version: int = 0):
        self.llm, self.version = llm, version
        self.tokens_generated = 0  # every token streamed out, finished or not (for live tokens/s)
        # Ablation counters: requests resubmitted after an abort-resume update and the prompt + partial tokens their
        # resubmission prefills again; seconds with nothing to generate; generation seconds lost to updates.
        self.resubmitted = self.recomputed_tokens = 0
        self.stalled_s = 0.0
        self._empty_s, self._empty_since = 0.0, time.monotonic()
        self._aborted_for_update: set[str] = set()
        self._running: set[str] = set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._update_lock = asyncio.Lock()

    @classmethod
    async def start(cls, cfg: EngineConfig, version: int = 0) -> InflightEngine:
        from vllm.v1.engine.async_llm import AsyncLLM

        if cfg.update_memory not in UPDATE_MEMORY:
            raise ValueError(f"update_memory is {cfg.update_memory!r}, expected one of {list(UPDATE_MEMORY)}")
        llm = AsyncLLM.from_engine_args(engine_args(cfg))
        engine = cls(llm, version)
        await llm.collective_rpc("inflight_set_update_memory", args=(cfg.update_memory,))
        await llm.engine_core.call_utility_async("inflight_track_kv", version)  # also sets the weight version
        return engine

    def shutdown(self) -> None:
        self.llm.shutdown()

    @property
    def cache_salt(self) -> str:
        return f"inflight-v{self.version}"

    async def generate(self, prompt_ids: list[int], params, request_id: str) -> Completion:
        """Generate one completion; a request aborted by an abort-resume update is resubmitted and stitched."""
        if params.n != 1:
            raise ValueError(f"SamplingParams.n is {params.n}: submit one request per sample (group = n requests)")
        done = Completion(request_id, list(prompt_ids), [], [], [], "length")
        while True:
            rid = request_id if not done.resubmissions else f"{request_id}#resume{done.resubmissions}"
            final = await self._generate_once(done, params, rid)
            out = final.outputs[0]
            done.token_ids += list(out.token_ids)
            done.logprobs += [lp[t].logprob for lp, t in zip(out.logprobs or [], out.token_ids, strict=True)]
            done.versions += spans_to_versions(out.weight_versions, len(out.token_ids))
            spans = await self.llm.engine_core.call_utility_async("inflight_kv_spans", rid)
            done.kv_versions += kv_ages([tuple(s) for s in spans], len(out.token_ids))
            done.text += out.text
            done.finish_reason = out.finish_reason or "length"
            if rid not in self._aborted_for_update:
                return done
            self._aborted_for_update.discard(rid)
            await self._resumed.wait()
            done.resubmissions += 1
            self.resubmitted += 1
            self.recomputed_tokens += len(done.prompt_ids) + len(done.token_ids)

    async def _generate_once(self, done: Completion, params, rid: str):
        from vllm.inputs import TokensPrompt

        budget = params.max_tokens - len(done.token_ids)
        sub = params.clone()
        sub.max_tokens, sub.logprobs = max(budget, 1), 0
        await self._resumed.wait()
        prompt = TokensPrompt(prompt_token_ids=done.prompt_ids + done.token_ids, cache_salt=self.cache_salt)
        self._mark_running(rid)
        try:
            final, seen = None, 0
            async for output in self.llm.generate(prompt, sub, request_id=rid):
                final = output
                produced = len(output.outputs[0].token_ids) if output.outputs else 0
                self.tokens_generated += produced - seen
                if produced and not done.first_token_time:
                    done.first_token_time = time.time()
                seen = produced
        finally:
            self._mark_done(rid)
        return final

    def _mark_running(self, rid: str) -> None:
        if not self._running and self._empty_since is not None:
            self._empty_s += time.monotonic() - self._empty_since
            self._empty_since = None
        self._running.add(rid)

    def _mark_done(self, rid: str) -> None:
        self._running.discard(rid)
        if not self._running and self._empty_since is None:
            self._empty_since = time.monotonic()

    @property
    def idle_s(self) -> float:
        """Seconds so far with no request to generate for (a starved engine), not counting update stalls."""
        current = time.monotonic() - self._empty_since if self._empty_since is not None else 0.0
        return self._empty_s + current

    async def set_weights_key(self, key: bytes) -> None:
        """Every worker verifies updates by keyed tags under `key` from now on (inflight/wire/weights.py)."""
        done = await self.llm.collective_rpc("inflight_set_weights_key", args=(key,))
        if not all(done):
            raise UpdateError("a worker did not take the weights key")

    async def join_weights_group(self, host: str, port: int, rank: int, world_size: int, **kw) -> list[GroupJoined]:
        """Join the weights group as `rank` (TP workers take consecutive ranks). Blocks until rank 0 joins."""
        args = (
            host,
            port,
            rank,
            world_size,
            kw.get("group_name", "inflight-weights-0"),
            kw.get("backend", "gloo"),
            kw.get("timeout_s", 60.0),
        )
        joined = await self.llm.collective_rpc("inflight_init_weights_group", args=args)
        return rpc_result(joined, list[GroupJoined], "inflight_init_weights_group")

    async def update(
        self, manifest_bytes: bytes, mode: str = "never-stop", kv: str = "keep", timeout_s: float = 120.0
    ) -> UpdateReport:
        """Receive and commit one update in `mode`. Raises `UpdateError` with weights and version unchanged."""
        if mode not in MODES:
            raise ValueError(f"mode is {mode!r}, expected one of {MODES}")
        async with self._update_lock:
            report = UpdateReport(version=-1, mode=mode)
            busy = bool(self._running)  # a stall costs generation only when something was generating
            start = time.perf_counter()
            paused = await self._pause_for(mode)
            try:
                status = await self._begin(manifest_bytes)
                report.version = status.version
                # Generation is stopped in every mode but never-stop: block in the worker until staged. Polling an idle
                # worker every 10 ms keeps vLLM's shm reader busy-spinning (it spins for 1 s after each read), which
                # starves the staging thread of the GIL: 4.2 s instead of 0.7 s to receive SmolLM2 fp32 here.
                staged = await self._wait_staged(timeout_s, block=paused or mode == "blocking")
                report.receive_s, report.bytes = staged.receive_s, staged.bytes_received
                report.prepare_s = staged.prepare_s
                report.staging_window = (staged.started_at, staged.staged_at)
                await self._commit(report, kv)
            finally:
                if paused:
                    await self.llm.resume_generation()
                    self._resumed.set()
            report.total_s = time.perf_counter() - start
            report.stall_s = report.total_s if paused else report.commit_s
            if busy:
                self.stalled_s += report.stall_s
            return report

    async def _pause_for(self, mode: str) -> bool:
        if mode == "never-stop":
            return False
        if mode == "blocking":
            if self._running:
                raise UpdateError(f"mode blocking needs an idle engine; {len(self._running)} requests are running")
            return False
        if mode == "abort-resume":
            self._resumed.clear()
            self._aborted_for_update |= self._running
            await self.llm.pause_generation(mode="abort", clear_cache=False)
        else:
            await self.llm.pause_generation(mode="keep" if mode == "keep-pause" else "wait", clear_cache=False)
        return True

    async def _begin(self, manifest_bytes: bytes) -> StageStatus:
        try:
            statuses = await self.llm.collective_rpc("inflight_begin_update", args=(manifest_bytes,))
        except Exception as exc:
            raise UpdateError(f"update refused before any bucket was received: {exc}") from exc
        return rpc_result(statuses, list[StageStatus], "inflight_begin_update")[0]

    async def _wait_staged(self, timeout_s: float, block: bool = False) -> StageStatus:
        deadline, poll_s = time.monotonic() + timeout_s, 0.01
        while True:
            if block:
                remaining = max(0.0, deadline - time.monotonic())
                method, args = "inflight_wait_staged", (remaining,)
            else:
                method, args = "inflight_update_status", ()
            statuses = rpc_result(await self.llm.collective_rpc(method, args=args), list[StageStatus], method)
            failed = [s for s in statuses if s.state == "failed"]
            if failed:
                raise UpdateError(f"update v{failed[0].version} failed while staging: {failed[0].error}")
            if all(s.state == "staged" for s in statuses):
                return statuses[0]
            if time.monotonic() > deadline:
                raise UpdateError(f"update not staged within {timeout_s:.0f}s: {statuses[0]}")
            # Each poll is an RPC the worker answers between two steps, so polling costs decoding time for as long as
            # an update stages: 10 ms polls cost a prepared SmolLM2 update (~1 s to stage) more tokens than its commit
            # saved. Back off from 10 ms (a small model stages in tens of ms and commits at once) to STAGE_POLL_S.
            await asyncio.sleep(poll_s)
            poll_s = min(STAGE_POLL_S, poll_s * 1.5)

    async def _commit(self, report: UpdateReport, kv: str) -> None:
        try:
            result = await self.llm.engine_core.call_utility_async("inflight_commit", report.version, kv)
        except Exception as exc:
            raise UpdateError(f"commit of v{report.version} failed, previous weights restored: {exc}") from exc
        committed = rpc_result(result, CommitResult, "inflight_commit")
        report.commit_s, report.workers = committed.stall_s, committed.workers
        self.version = report.version
