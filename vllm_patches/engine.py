"""InflightEngine: vLLM's AsyncLLM with in-flight weight updates in five interruption modes and exact token versions.

Called by `inflight.serve` (and the demo, the tests and the benchmarks). The engine is a facade over one collaborator
per job, each created once in `start`:
- `generate()`: `vllm_patches/generation.py:VersionedGeneration` — one behaviour logprob and one policy version per
  token, a cache salt per version, resubmission of requests an abort-resume update aborted;
- `update()`: `vllm_patches/update_frontend.py:WeightUpdates` — one weight update in the chosen mode (never-stop,
  keep-pause, drain, abort-resume, blocking), the workers' staged signals awaited on
  `vllm_patches/update_frontend.py:StagedSignals`;
- `set_weights_key()` and `join_weights_group()`: the workers' membership of the weights group, here.
This module also turns an `EngineConfig` into vLLM's engine arguments, without importing vLLM (`engine_kwargs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

from inflight.config import EngineSizing
from inflight.machine import is_cuda, serve_device
from inflight.wire.weights import UPDATE_MEMORY
from vllm_patches.adapter import ServedAdapter, check_lora_kernels, engine_lora_rank, lora_request
from vllm_patches.device_plan import DTYPE_BYTES, LEARNER_BUCKET_BYTES, GpuMemoryPlan, checkpoint_staging_plan
from vllm_patches.generation import RunningRequests, ServedVersion, VersionedGeneration
from vllm_patches.routes import check_routed_checkpoint, route_capture
from vllm_patches.rpc import GroupJoined, rpc_result
from vllm_patches.update_frontend import StagedSignals, UpdateError, UpdateReport, WeightUpdates

if TYPE_CHECKING:  # vLLM is imported by `start`: this module's config checks run where no engine starts
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

HEAD_DTYPES = ("model", "float32")
WORKER_EXTENSION = "vllm_patches.worker_extension.InflightWorkerExtension"
JOIN_POLL_S = 0.05  # how often a join asks the workers (one RPC between two steps each time)
JOIN_MARGIN_S = 10.0  # past the group's own timeout, by which each worker's join has failed by itself


@dataclass
class EngineConfig(EngineSizing):
    """What `InflightEngine.start` builds AsyncLLM from: a serve's is built from its flags (inflight/serve/app.py:
    engine_config; a tool without a serve: standalone_engine_config), and the tests' (tests/support.py:TEST_ENGINE).
    Its size (context, batch, workers, KV cache or GPU fraction, seed) is `EngineSizing`'s, declared once
    with the serve's flags (inflight/config.py); the fields below are the serve's knobs resolved."""

    model: str = field(kw_only=True)
    # The serve's knobs resolved, slots its builder fills (their defaults and help are the serve's flags'):
    # False lets vLLM compile the model and, on CUDA, capture CUDA graphs, which hold parameter addresses: every commit
    # then writes into the existing storage ("low" in place, "double" by copying its prepared layers in).
    enforce_eager: bool = field(kw_only=True)
    dtype: str = field(kw_only=True)
    # The LM head's precision: "float32" projects in fp32 (vLLM's head_dtype, through hf_overrides), as the learner's
    # fp32 head does; "model" keeps the engine dtype. Changes nothing when dtype is already float32.
    head_dtype: str = field(kw_only=True)
    update_memory: str = field(kw_only=True)  # one of UPDATE_MEMORY
    # LoRA: the adapter's rank (vLLM's max_lora_rank holds it), 0 without one; --routing-replay on: the workers record
    # every token's routed experts (vllm_patches/routes.py), which needs every position fed, so prefix caching is then
    # off whatever `enable_prefix_caching` says
    lora_rank: int = field(kw_only=True)
    routing_replay: bool = field(kw_only=True)
    enable_prefix_caching: bool = True
    # CUDA: the staging plan (vllm_patches/device_plan.py); vLLM gets its lowered fraction, never the raw one.
    gpu_plan: GpuMemoryPlan | None = None
    # LoRA: the PEFT adapter every request is served with, whose updates arrive in flight (vllm_patches/adapter.py);
    # None serves the model's own weights.
    lora_dir: str | None = None
    # Each worker's device arena, every update is staged within (vllm_patches/arenas.py): None, the staging plan's
    # `arena_bytes`; a number overrides it (tests: an arena too small, whose updates are refused).
    arena_bytes: int | None = None


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
    if cfg.routing_replay:
        check_routed_checkpoint(cfg.model)


def memory_kwargs(cfg: EngineConfig, device: str) -> dict:
    """How vLLM sizes its memory on `device`: a fraction of the GPU on CUDA, an explicit KV cache size elsewhere.

    Contract: exactly one of `gpu_memory_utilization` (CUDA) and `kv_cache_memory_bytes` (CPU) is returned; vLLM
    reads an explicit `kv_cache_memory_bytes` in place of the fraction, so passing both would ignore the fraction.
    Raises ValueError for `enforce_eager` False off CUDA (compilation there may freeze the weights).
    """
    if is_cuda(device):
        return {"gpu_memory_utilization": planned_utilization(cfg)}
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


def planned_utilization(cfg: EngineConfig) -> float:
    """The fraction vLLM may take on CUDA once the staging plan's peak is set aside: a CUDA engine without a plan for
    its updates' memory would give it all to the KV cache, and the first update would run out of memory."""
    plan = cfg.gpu_plan
    if plan is None:
        raise ValueError(
            "a CUDA engine needs a staging plan (EngineConfig.gpu_plan, from vllm_patches/device_plan.py:"
            "plan_gpu_memory): without it vLLM gives the update's memory to the KV cache"
        )
    if plan.requested_utilization != cfg.gpu_memory_utilization or plan.staging.update_memory != cfg.update_memory:
        raise ValueError(
            f"the staging plan was made for --gpu-memory-utilization {plan.requested_utilization} and "
            f"--update-memory {plan.staging.update_memory}, the engine has {cfg.gpu_memory_utilization} and "
            f"{cfg.update_memory}: plan again with the engine's values"
        )
    return plan.engine_utilization


def engine_kwargs(cfg: EngineConfig, device: str) -> dict:
    """The keyword arguments of vLLM's `AsyncEngineArgs` for `cfg` on `device` ('cpu' or 'cuda', as
    `inflight.machine.serve_device` says).

    Contract: pure (no vLLM import, no device query), so it is tested without an engine; raises ValueError for a config
    `check_engine_config` refuses. Scheduling is synchronous on every device: a token's version is exact only when the
    step whose output is processed is the step that ran (vLLM's async scheduling overlaps the next step with it).
    """
    check_engine_config(cfg)
    if cfg.lora_dir is not None:
        check_lora_kernels(cfg.model, device)
    route_capture(device, cfg.routing_replay, cfg.enforce_eager, {})  # refuses graphs that would record no route
    return {
        "hf_overrides": {"head_dtype": cfg.head_dtype},
        "model": cfg.model,
        "dtype": cfg.dtype,
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "seed": cfg.seed,
        "enforce_eager": cfg.enforce_eager,
        "enable_prefix_caching": cfg.enable_prefix_caching and not cfg.routing_replay,
        **memory_kwargs(cfg, device),
        **lora_kwargs(cfg),
        "logprobs_mode": "processed_logprobs",
        "async_scheduling": False,
        "worker_extension_cls": WORKER_EXTENSION,
    }


def lora_kwargs(cfg: EngineConfig) -> dict:
    """vLLM's LoRA arguments: one adapter slot, vLLM's smallest max_lora_rank that holds `lora_rank`, and the served
    adapter's modules as vLLM's deployment-time `lora_target_modules`; none without an adapter.

    The target filter gives LoRA buffers to the adapter's modules only: without it vLLM wraps every fused-experts
    layer of a MoE model for LoRA too (vllm/lora/layers/fused_moe.py: buffers per expert and slot), although the
    learner's adapter never touches the experts. A MoE model with LoRA still needs a CUDA serve
    (`check_lora_kernels`)."""
    if cfg.lora_dir is None:
        return {}
    targets = ServedAdapter.read(cfg.lora_dir).spec.targets
    return {
        "enable_lora": True,
        "max_loras": 1,
        "max_lora_rank": engine_lora_rank(cfg.lora_rank),
        # PEFT's "all-linear" or a regex is no list of module names: vLLM's default (every LoRA-capable module) then
        "lora_target_modules": list(targets) if all(t.isidentifier() for t in targets) else None,
    }


def arena_sizes(cfg: EngineConfig) -> tuple[int, int]:
    """Each worker's device and host arena bytes (vllm_patches/arenas.py): the CUDA plan's, or off CUDA a plan of the
    whole checkpoint with deltas (a CPU worker can stage any update a learner sends, sliced or whole; host memory
    is not the GPU's); `cfg.arena_bytes` overrides the device arena's. Reads the checkpoint's headers only."""
    if cfg.gpu_plan is not None:
        plan = cfg.gpu_plan.staging
    else:
        dtype = cfg.dtype if cfg.dtype in DTYPE_BYTES else "float32"  # "auto": the widest a CPU serve computes in
        copies = cfg.update_memory == "low"  # the room `low`'s prepared copies take where the model can (CUDA's rule)
        plan = checkpoint_staging_plan(cfg.model, dtype, 1, cfg.update_memory, True, 0, LEARNER_BUCKET_BYTES, copies)
    return (plan.arena_bytes if cfg.arena_bytes is None else cfg.arena_bytes), plan.host_arena_bytes


def engine_args(cfg: EngineConfig) -> AsyncEngineArgs:
    """vLLM's `AsyncEngineArgs` for `cfg` on the device this process serves from (`engine_kwargs`)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**engine_kwargs(cfg, serve_device()))


def count_engine_start(cfg: EngineConfig, seconds: float) -> None:
    """Opt-in (INFLIGHT_COUNT_ENGINE_STARTS=<file>): append one line per engine started — the pytest test that started
    it (pytest's PYTEST_CURRENT_TEST, which serve subprocesses inherit), the model, the workers and the start's
    seconds — so the suite's engine starts are counted, not estimated (README: Tests). One write per line: concurrent
    processes append whole lines."""
    path = os.environ.get("INFLIGHT_COUNT_ENGINE_STARTS")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "-")
    line = f"{test}\t{cfg.model}\ttp={cfg.tensor_parallel_size}\t{seconds:.1f}s\tpid={os.getpid()}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def finish_interrupted_shutdown(llm: AsyncLLM) -> None:
    """vLLM 0.32 force-kills an EngineCore that outlives its shutdown timeout by naming each of its children first, and
    raises psutil.NoSuchProcess when one has just exited, before killing the rest (seen under load in the suite,
    2026-11-28): kill what remains of each engine process's tree, then release the client's sockets and its output
    task as its own shutdown would have."""
    resources = llm.engine_core.resources
    for proc in resources.engine_manager.processes if resources.engine_manager is not None else []:
        if proc.is_alive():
            kill_tree(proc.pid)
            proc.join(10)
    resources()
    handler = getattr(llm, "output_handler", None)
    if handler is not None:
        with contextlib.suppress(RuntimeError):  # its loop already closed: nothing left to cancel
            handler.get_loop().call_soon_threadsafe(handler.cancel)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it, any of which may already be gone."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


class InflightEngine:
    """AsyncLLM and its collaborators: generation, weight updates, the weights group. One per serve process."""

    def __init__(
        self,
        llm: AsyncLLM,
        signals: StagedSignals,
        version: int = 0,
        lora_dir: str | None = None,
        routes: bool = False,
    ):
        self.llm, self.signals = llm, signals
        self.served = ServedVersion(version)
        self.requests = RunningRequests()
        self.lora = lora_request(lora_dir) if lora_dir is not None else None  # every request's adapter
        self.generation = VersionedGeneration(llm, self.served, self.requests, self.lora, routes)
        self.updates = WeightUpdates(llm, self.served, self.requests, signals)
        self.arena_sizes = (0, 0)  # each worker's device and host arena bytes (`arena_sizes`), set by `start`

    @classmethod
    async def start(cls, cfg: EngineConfig, version: int = 0) -> InflightEngine:
        from vllm.v1.engine.async_llm import AsyncLLM

        if cfg.update_memory not in UPDATE_MEMORY:
            raise ValueError(f"update_memory is {cfg.update_memory!r}, expected one of {list(UPDATE_MEMORY)}")
        # The route capture's runner choice (VLLM_USE_V2_MODEL_RUNNER=0 on CUDA) is read by vLLM's config: set first.
        os.environ.update(route_capture(serve_device(), cfg.routing_replay, cfg.enforce_eager, os.environ).env)
        began = time.monotonic()
        llm = AsyncLLM.from_engine_args(engine_args(cfg))
        engine = cls(llm, StagedSignals(), version, cfg.lora_dir, cfg.routing_replay)
        try:
            if engine.lora is not None:
                await engine.llm.add_lora(engine.lora)
                await engine.llm.collective_rpc("inflight_use_adapter", args=(cfg.lora_dir,))
            if cfg.routing_replay:
                await engine.llm.collective_rpc("inflight_record_routes")
            await engine.llm.collective_rpc("inflight_set_update_memory", args=(cfg.update_memory,))
            engine.arena_sizes = arena_sizes(cfg)
            await engine.llm.collective_rpc("inflight_set_staging_arenas", args=engine.arena_sizes)
            await engine.llm.collective_rpc("inflight_signal_staged_to", args=(engine.signals.address,))
            await engine.llm.engine_core.call_utility_async("inflight_track_kv", version)  # also sets the version
        except BaseException:
            engine.shutdown()
            raise
        count_engine_start(cfg, time.monotonic() - began)
        return engine

    def shutdown(self) -> None:
        try:
            self.llm.shutdown()
        except psutil.NoSuchProcess:
            finish_interrupted_shutdown(self.llm)
        finally:
            self.signals.close()

    @property
    def version(self) -> int:
        """The weight version served now: every token sampled from here on carries it."""
        return self.served.number

    @property
    def cache_salt(self) -> str:
        return self.served.cache_salt

    async def update(
        self, manifest_bytes: bytes, mode: str = "never-stop", kv: str = "keep", timeout_s: float = 120.0
    ) -> UpdateReport:
        """Receive and commit one update in `mode` (vllm_patches/update_frontend.py:WeightUpdates.run).
        Raises `UpdateError`
        with weights and version unchanged."""
        return await self.updates.run(manifest_bytes, mode, kv, timeout_s)

    @property
    def dead(self) -> bool:
        """vLLM's EngineCore died (its process monitor saw it go, or its output handler failed): every request fails
        from now on (AsyncLLM.errored)."""
        return self.llm.errored

    @property
    def tokens_generated(self) -> int:
        return self.generation.tokens_generated

    @property
    def resubmitted(self) -> int:
        return self.generation.resubmitted

    @property
    def recomputed_tokens(self) -> int:
        return self.generation.recomputed_tokens

    @property
    def stalled_s(self) -> float:
        return self.updates.stalled_s

    @property
    def updates_refused(self) -> int:
        """Updates a worker refused because they would not fit its staging arena (weights and decoding unharmed)."""
        return self.updates.refused

    @property
    def idle_s(self) -> float:
        return self.requests.idle_s

    async def set_staging_arena(self, device_bytes: int) -> None:
        """Every worker stages the next updates within a device arena of `device_bytes` (tests: one too small);
        refused while an update is being received."""
        self.arena_sizes = (device_bytes, self.arena_sizes[1])
        await self.llm.collective_rpc("inflight_set_staging_arenas", args=self.arena_sizes)

    async def set_weights_key(self, key: bytes) -> None:
        """Every worker verifies updates by keyed tags under `key` from now on (inflight/wire/weights.py)."""
        done = await self.llm.collective_rpc("inflight_set_weights_key", args=(key,))
        if not all(done):
            raise UpdateError("a worker did not take the weights key")

    async def join_weights_group(self, host: str, port: int, rank: int, world_size: int, **kw) -> list[GroupJoined]:
        """Join the weights group from `rank` on: the engine's workers take consecutive ranks, each at its
        tensor-parallel rank (inflight/wire/group.py:member_rank). Returns once every worker is a member (rank 0 and
        the other members joined too); raises UpdateError naming a worker's failure. The rendezvous runs on each
        worker's own thread (vllm_patches/joining.py) while the engine keeps stepping; this asks for its state."""
        name, timeout_s = kw.get("group_name", "inflight-weights-0"), kw.get("timeout_s", 60.0)
        args = (host, port, rank, world_size, name, kw.get("backend", "gloo"), timeout_s)
        states = await self.llm.collective_rpc("inflight_init_weights_group", args=args)
        deadline = time.monotonic() + timeout_s + JOIN_MARGIN_S  # the workers' own timeout fails them first
        while True:
            joined = rpc_result(states, list[GroupJoined], "inflight_weights_group_state")
            failed = [j for j in joined if j.state == "failed"]
            if failed:
                raise UpdateError(f"weights group {name}: rank {failed[0].rank} could not join: {failed[0].error}")
            if all(j.state == "joined" for j in joined):
                return joined
            if time.monotonic() > deadline:
                raise UpdateError(f"weights group {name}: not formed within {timeout_s:.0f}s (+{JOIN_MARGIN_S:.0f}s)")
            await asyncio.sleep(JOIN_POLL_S)
            states = await self.llm.collective_rpc("inflight_weights_group_state")
