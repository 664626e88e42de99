"""The serve process: engine + rollout driver + rollout stream + control client (+ OpenAI API), one event loop.

`python -m inflight.serve` calls `main`. Shutdown (SIGINT/SIGTERM, or `--max-groups` reached and everything sent):
stop admitting, cancel generating groups, give the outbox up to 10 s to reach the learner (none when no learner is
connected: the launchers stop it first), stop the engine.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from inflight.config import parse_dataclass, setup_logging
from inflight.machine import front_end_process_env, is_cuda, query_cuda_device, resolve_precision, serve_device
from inflight.models import MODEL_NAMES, checkpoint_fingerprint, resolve_model
from inflight.serve.config import ServeConfig
from inflight.serve.eval import Evaluation, load_eval_problems
from inflight.serve.http import start_http
from inflight.serve.latency import parse_latency
from inflight.serve.progress import ProgressReporter
from inflight.tasks.base import Problem
from inflight.tasks.loading import load_task
from inflight.tasks.rewards import Reward, load_rewards
from inflight.wire.contract import RunContract
from inflight.wire.control import Ask, TensorSpec
from inflight.wire.group import WEIGHTS_MAX_CTAS
from inflight.wire.rollouts import RolloutStream
from inflight.wire.secure import CurveKeys, derive_keys, weights_key
from vllm_patches.device_plan import (
    LEARNER_BUCKET_BYTES,
    checkpoint_staging_plan,
    cpu_threads_bind,
    plan_gpu_memory,
    plans_deltas,
)

if TYPE_CHECKING:  # annotations only: vLLM is imported when a serve starts (see `serve`)
    from inflight.serve.control import ControlClient
    from inflight.serve.driver import RolloutDriver
    from vllm_patches.engine import EngineConfig, InflightEngine

log = logging.getLogger("inflight.serve")


@dataclass
class Work:
    """What the serve generates for and scores with, loaded before the engine starts (a bad task costs nothing)."""

    problems: Iterable[Problem]
    rewards: list[Reward]
    held_out: list[Problem] | None  # --eval-task's problems
    tool_latency: Callable[[], float] | None


def load_work(cfg: ServeConfig) -> Work:
    problems, default_reward = load_task(
        cfg.task,
        cfg.task_seed,
        cfg.max_operand,
        cfg.prompt_key,
        cfg.answer_key,
        cfg.system_prompt,
        terms=cfg.arithmetic_terms,
        ops=cfg.arithmetic_ops,
        task_args=cfg.task_args,
    )
    # --reward none: only the environment's own rewards (inflight/envs/base.py)
    rewards = (
        []
        if cfg.reward == "none"
        else load_rewards(cfg.reward or default_reward, cfg.reward_weights, cfg.reward_convention)
    )
    held_out = load_eval_problems(cfg) if cfg.eval_task else None
    latency = parse_latency(cfg.tool_latency, cfg.seed) if cfg.tool_latency else None
    return Work(problems, rewards, held_out, latency)


async def serve(cfg: ServeConfig) -> int:
    # vLLM (the engine, the driver's SamplingParams) and transformers are imported only here, once a serve really
    # starts: `--help` and a refused flag answer at once instead of after seconds of imports.
    from transformers import AutoTokenizer

    from inflight.serve.control import ControlClient
    from inflight.serve.driver import RolloutDriver
    from vllm_patches.engine import InflightEngine

    model_path = resolve_model(cfg.model)
    # what the learner checks at Hello, asked before the engine starts: a refused serve stops before loading its model
    contract = cfg.contract(checkpoint_fingerprint(model_path) if cfg.lora_rank else "")
    config = served_engine_config(cfg, model_path)  # no deltas planned yet: a refused flag answers at once
    socket_secret, tag_secret = cfg.secrets()
    keys = derive_keys(socket_secret) if socket_secret is not None else None
    asked, full_every = await _asked(cfg, contract, keys)
    if not asked:
        return 1
    if config.gpu_plan is not None and plans_deltas(full_every):  # the learner sends deltas: the plan counts them
        config = served_engine_config(cfg, model_path, delta=True)
    work = load_work(cfg)
    engine = await InflightEngine.start(config, version=cfg.version)
    try:
        expected = (await engine.llm.collective_rpc("inflight_expected_tensors"))[0]
        tensors = [TensorSpec(n, d, s) for n, (d, s) in sorted(expected.items())]
        http = await _maybe_http(cfg, engine, model_path)
        if tag_secret is not None:  # the engine verifies updates by keyed tags, not checksums
            await engine.set_weights_key(weights_key(tag_secret))
    except BaseException:
        engine.shutdown()
        raise
    stream = RolloutStream(cfg.rollouts, keys=keys)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    driver = RolloutDriver(engine, cfg, work.problems, work.rewards, stream, tokenizer, work.tool_latency)
    control = ControlClient(cfg.control, driver, tensors, keys=keys, contract=contract)
    reporter = ProgressReporter(driver, cfg.metrics, cfg.progress_s, control)
    control.on_update = reporter.update_event
    if work.held_out:
        driver.evaluation = Evaluation(
            engine, cfg, work.held_out, work.rewards, tokenizer, driver.server_id, reporter.eval_result
        )
    try:
        await _start_episodes(driver)
        return await _run(cfg, driver, stream, control, reporter)
    finally:
        await driver.stop()
        await stream.flush(10.0)
        if http is not None:
            http.cancel()
        control.close()
        stream.close()
        engine.shutdown()


def served_engine_config(cfg: ServeConfig, model_path: Path, delta: bool = False) -> EngineConfig:
    """The config the patched vLLM engine (vllm_patches/engine.py:InflightEngine) starts with, checked: a flag the
    engine refuses ends the serve here, in one line naming it, before anything waits or loads. `delta`: the learner
    said it sends delta updates (its `Agreed`), which the staging plan then counts."""
    from vllm_patches.engine import engine_kwargs  # vLLM: see `serve`

    device = serve_device()
    gpu = query_cuda_device() if is_cuda(device) else None  # in a child: this process keeps no CUDA context
    pool = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    one_pool = not pool or set(pool) <= set("0123456789,-")  # unset, or one core list (inflight.run's), not "0|1"
    if not is_cuda(device) and cfg.tensor_parallel_size > 1 and one_pool:
        bind = cpu_threads_bind(sorted(os.sched_getaffinity(0)), cfg.tensor_parallel_size)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind  # read by the workers vLLM spawns
        log.info("CPU tensor parallelism: worker cores %s (VLLM_CPU_OMP_THREADS_BIND)", bind)
    try:
        config = engine_config(cfg, model_path, device, gpu.total_bytes if gpu else 0, delta)
        engine_kwargs(config, device)  # every refusal of the engine's config, before vLLM starts
    except ValueError as exc:  # a refused flag, said in one line (the message names the flag and the fix)
        raise SystemExit(f"inflight.serve: {exc}") from None
    if config.gpu_plan is not None:
        log.info("%s", config.gpu_plan.describe())
    return config


def standalone_engine_config(cfg: ServeConfig, model_path: Path) -> EngineConfig:
    """The engine a serve given `cfg`'s flags starts on this machine, its precision resolved as `main` resolves it:
    for the tools that run the engine without a serve (scripts/task_accuracy.py, the generation demo), so that they
    measure what a serve runs (its dtype, LM head precision, update path), not a bare EngineConfig's test values."""
    resolved = replace(cfg, dtype=resolve_precision(cfg.dtype, serve_device()).dtype)
    return served_engine_config(resolved, model_path)


def engine_config(
    cfg: ServeConfig, model_path: Path, device: str, device_bytes: int, delta: bool = False
) -> EngineConfig:
    """The engine's config on `device`: --enforce-eager and --update-memory resolved for it and, on CUDA, the
    staging plan made from the checkpoint's weight bytes, counting deltas' decoded tensors when `delta` (a ValueError
    naming the numbers and the flags when the GPU cannot hold an update beside the engine). `cfg.dtype` is already
    resolved (`main`). One worker stages whole buckets; a tensor-parallel worker its slices through one
    buffer of the learner's default bucket."""
    from vllm_patches.engine import EngineConfig  # vLLM: see `serve`

    mode = cfg.engine_mode(device)
    plan = None
    if is_cuda(device):
        tp = cfg.tensor_parallel_size
        # prepared layers copied in: `low`'s always (over the staged tensors, or beside those a delta may follow),
        # `double`'s under graphs (beside them)
        copies = mode.update_memory == "low" or not mode.enforce_eager
        staging = checkpoint_staging_plan(
            model_path, cfg.dtype, tp, mode.update_memory, delta, WEIGHTS_MAX_CTAS, LEARNER_BUCKET_BYTES, copies
        )
        plan = plan_gpu_memory(staging, device_bytes, cfg.gpu_memory_utilization)
    return EngineConfig(
        **cfg.sizing(),  # the engine's size: the same knobs (inflight/config.py:EngineSizing)
        model=str(model_path),
        enforce_eager=mode.enforce_eager,
        dtype=cfg.dtype,
        head_dtype=cfg.head_dtype,
        update_memory=mode.update_memory,
        gpu_plan=plan,
        lora_dir=served_adapter(cfg, model_path),
        lora_rank=cfg.lora_rank,
        routing_replay=cfg.routing_replay == "on",
    )


def served_adapter(cfg: ServeConfig, model_path: Path) -> str | None:
    """With --lora-rank: the adapter directory the serve starts from — `--lora-init`, checked against the flags, or a
    zero adapter written for them (vllm_patches/adapter.py) — else None."""
    from inflight.wire.weights import AdapterSpec
    from vllm_patches.adapter import ServedAdapter, decoder_linear_targets, write_zero_adapter

    if cfg.lora_rank == 0:
        return None
    targets = sorted(cfg.lora_target_names() or decoder_linear_targets(model_path))
    spec = AdapterSpec(cfg.lora_rank, cfg.resolved_lora_alpha, targets)
    if not cfg.lora_init:
        directory = tempfile.mkdtemp(prefix="inflight-lora-")
        atexit.register(shutil.rmtree, directory, True)  # the adapter's own size (SmolLM2 rank 16: 19.5 MB) per start
        return str(write_zero_adapter(model_path, directory, spec))
    given = ServedAdapter.read(cfg.lora_init).spec
    if differs := given.differences(spec):
        raise ValueError(f"--lora-init {cfg.lora_init} is not the adapter the flags say ({'; '.join(differs)})")
    return cfg.lora_init


async def _asked(cfg: ServeConfig, contract: RunContract, keys: CurveKeys | None) -> tuple[bool, int]:
    """(False, 0) when the learner refused this serve's run contract (logged with its reason), asked before the
    engine starts; (True, its --full-every) when it agreed, (True, 0) when it did not answer (its Hello is checked
    after the engine starts all the same)."""
    from inflight.serve.control import RefusedError, ask_learner  # the driver's module: vLLM, see `serve`

    try:
        agreed = await ask_learner(cfg.control, Ask(server_id=cfg.resolved_server_id(), contract=contract), keys)
    except RefusedError as exc:
        log.error("%s", exc)
        return False, 0
    if agreed is None:
        log.info(
            "no learner answered at %s yet (not running, or given another secret): the contract is checked "
            "at Hello, once the engine runs",
            cfg.control,
        )
        return True, 0
    return True, agreed.full_every


async def _maybe_http(cfg: ServeConfig, engine: InflightEngine, model_path: Path) -> asyncio.Task | None:
    if not cfg.http_port:
        return None
    served_name = cfg.model if cfg.model in MODEL_NAMES else model_path.name
    return await start_http(engine, str(model_path), served_name, cfg.http_host, cfg.http_port)


async def _start_episodes(driver: RolloutDriver) -> None:
    """The episode runner's own start-up, where it has one (a verifiers environment: its endpoint, its serving
    resources, its harness's program): what fails there ends the serve now, in one line, not every episode later."""
    start = getattr(driver.episodes, "start", None)
    if start is None:
        return
    try:
        await start()
    except Exception as exc:
        raise SystemExit(f"inflight.serve: {exc}") from None


async def _run(
    cfg: ServeConfig, driver: RolloutDriver, stream: RolloutStream, control: ControlClient, reporter: ProgressReporter
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = [
        asyncio.create_task(c, name=n)
        for n, c in (
            ("driver", driver.run()),
            ("stream", stream.pump(driver.notify)),
            ("peer", stream.watch()),
            ("control", control.serve()),
            ("heartbeat", control.heartbeat()),
            ("progress", reporter.run()),
            ("finished", _finished(cfg, driver, stream)),
            ("health", _healthy(driver)),
        )
    ]
    stopper = asyncio.create_task(stop.wait())
    print(
        f"inflight.serve ready: server {driver.server_id}, model {cfg.model}, mode {cfg.mode}, rollouts -> "
        f"{cfg.rollouts}, control -> {cfg.control}",
        file=sys.stderr,
        flush=True,
    )
    done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    for task in done:
        if task is not stopper and task.get_name() != "finished" and task.exception() is not None:
            log.error("serve task %s died: %r", task.get_name(), task.exception())
            code = 1
    for task in [*tasks, stopper]:
        task.cancel()
    await asyncio.gather(*tasks, stopper, return_exceptions=True)
    return code


async def _healthy(driver: RolloutDriver, every_s: float = 0.5) -> None:
    """Raises once vLLM's EngineCore has died or FAILED_IN_A_ROW_LIMIT groups failed with no rollout made between them,
    so the serve exits 1 (for its launcher to restart it, or to end the run with these lines) instead of admitting and
    failing groups for ever."""
    from inflight.serve.driver import FAILED_IN_A_ROW_LIMIT

    stats = driver.stats
    while not driver.engine.dead and stats.failed_in_a_row < FAILED_IN_A_ROW_LIMIT:
        await asyncio.sleep(every_s)
    if driver.engine.dead:
        raise RuntimeError("vLLM's EngineCore died (its error is above); this serve cannot generate any more")
    raise RuntimeError(f"the last {stats.failed_in_a_row} groups all failed, the last with {stats.last_failure}")


async def _finished(cfg: ServeConfig, driver: RolloutDriver, stream: RolloutStream) -> None:
    """Returns once `--max-groups` groups are generated and sent (never, when max_groups is 0)."""
    if not cfg.max_groups:
        await asyncio.Event().wait()
    while driver.stats.groups_finished < cfg.max_groups or stream.outbox:
        await asyncio.sleep(0.1)
    await stream.drained.wait()


def main(argv: list[str] | None = None) -> int:
    about = "Patched vLLM engine + rollout driver streaming per-token-versioned rollouts over ZeroMQ."
    cfg = parse_dataclass(ServeConfig, argv, "python -m inflight.serve", about)
    setup_logging()
    device = serve_device()
    os.environ.update(front_end_process_env(device, os.environ))  # before vLLM is imported: `serve` imports it
    precision = resolve_precision(cfg.dtype, device)
    log.info("serve precision: %s (%s)", precision.dtype, precision.reason)
    log.info("serve device: %s; memory sized by %s", device, cfg.memory_sizing(device))
    cfg.dtype = precision.dtype
    code = asyncio.run(serve(cfg))
    # The engine was shut down inside serve(); collect it now, while modules are intact: left to interpreter
    # teardown, AsyncLLM.__del__ calls shutdown again on half-torn-down globals and prints a TypeError traceback.
    gc.collect()
    return code
