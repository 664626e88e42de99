"""The serve's GPU flags (inflight/serve/config.py): `--gpu-memory-utilization` checked at start and naming the flag,
`--enforce-eager false` refused with the update path that installs new storage, and an `inflight.run` on GPUs that
leaves the serve's memory sizing to the serve's own defaults (no CPU-only `--kv-cache-gib` sent to a GPU serve)."""

from __future__ import annotations

import pytest

from inflight.config import parse_dataclass
from inflight.run.config import RunConfig
from inflight.run.launch import side_commands
from inflight.serve.config import ServeConfig
from inflight.wire.delta import DECODE_WORKSPACE_BYTES
from vllm_patches.device_plan import EngineMode


def parse(*flags: str) -> ServeConfig:
    return parse_dataclass(ServeConfig, list(flags), "inflight.serve", "test")


def usage_error(capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(*flags)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_enforce_eager_false_with_update_memory_double_keeps_the_graphs_and_the_prepared_path() -> None:
    """Allowed since the prepared layers are copied into the live storage under graphs (vllm_patches/commit.py)."""
    cfg = parse("--enforce-eager", "false", "--update-memory", "double")
    assert cfg.engine_mode("cuda") == EngineMode(enforce_eager=False, update_memory="double")


def test_enforce_eager_false_with_update_memory_low_is_accepted() -> None:
    cfg = parse("--enforce-eager", "false", "--update-memory", "low")
    assert cfg.engine_mode("cuda") == EngineMode(enforce_eager=False, update_memory="low")


# (device, --enforce-eager, --update-memory) -> (eager, update path)
MODES = [
    ("cpu", "auto", "auto", True, "double"),  # eager with the prepared swap, as before
    ("cuda", "auto", "auto", False, "low"),  # vLLM's own default: CUDA graphs, which need the in-place path
    ("cuda:1", "auto", "auto", False, "low"),
    ("cuda", "auto", "double", False, "double"),  # double keeps the graphs: its prepared layers are copied in
    ("cuda", "true", "double", True, "double"),  # eager: they are swapped in
    ("cuda", "true", "auto", True, "low"),
    ("cpu", "false", "auto", False, "low"),  # graphs need low; a CPU engine then refuses compiling at start
    ("cpu", "true", "low", True, "low"),
]


@pytest.mark.parametrize(("device", "eager", "memory", "want_eager", "want_memory"), MODES)
def test_the_engine_mode_defaults_to_cuda_graphs_with_the_in_place_path_on_a_gpu_and_eager_double_on_cpu(
    device, eager, memory, want_eager, want_memory
) -> None:
    cfg = parse("--enforce-eager", eager, "--update-memory", memory)
    assert cfg.engine_mode(device) == EngineMode(want_eager, want_memory)


@pytest.mark.parametrize("fraction", ["0", "-0.5", "1.5"])
def test_a_gpu_memory_utilization_outside_zero_to_one_is_refused_naming_the_flag_and_the_value(capsys, fraction):
    err = usage_error(capsys, "--gpu-memory-utilization", fraction)
    assert f"--gpu-memory-utilization is {float(fraction)!r}, expected in (0, 1]" in err


def test_a_gpu_memory_utilization_of_one_is_accepted() -> None:
    assert parse("--gpu-memory-utilization", "1").gpu_memory_utilization == 1.0


SIZING = [("cuda", "--gpu-memory-utilization 0.8", "--kv-cache-gib"),
          ("cpu", "--kv-cache-gib 0.25", "--gpu-memory-utilization")]  # fmt: skip


@pytest.mark.parametrize(("device", "used", "unused"), SIZING)
def test_the_start_up_log_says_which_flag_sizes_memory_on_the_device(device, used, unused) -> None:
    said = ServeConfig(gpu_memory_utilization=0.8, kv_cache_gib=0.25).memory_sizing(device)
    assert said.startswith(used) and f"{unused} is not used" in said


def test_a_run_on_gpus_sends_the_serve_no_memory_flag_so_the_gpu_fraction_default_applies(tmp_path) -> None:
    """`inflight.run` forwards only the knobs both sides share; memory sizing is the serve's own (--serve-args)."""
    serve = side_commands(RunConfig(serve_gpus="0", learn_gpus="1,2,3"), tmp_path, (1, 2, 3))["serve"]
    assert not {"--kv-cache-gib", "--gpu-memory-utilization", "--enforce-eager"} & set(serve)
    cfg = parse(*serve[2:])  # drop "-m inflight.serve"
    assert cfg.gpu_memory_utilization == 0.9 and cfg.engine_mode("cuda") == EngineMode(False, "low")


def test_a_run_passes_the_serves_gpu_flags_through_serve_args(tmp_path) -> None:
    run = RunConfig(serve_gpus="0", serve_args="--gpu-memory-utilization 0.6 --enforce-eager false --update-memory low")
    cfg = parse(*side_commands(run, tmp_path, (1, 2, 3))["serve"][2:])
    assert (cfg.gpu_memory_utilization, cfg.enforce_eager, cfg.update_memory) == (0.6, "false", "low")


def test_a_run_refuses_a_bad_serve_flag_in_serve_args_before_anything_starts(tmp_path, capsys) -> None:
    from inflight.run.app import plan

    with pytest.raises(SystemExit) as exited:
        plan(["--run-dir", str(tmp_path / "run"), "--serve-gpus", "0", "--serve-args", "--gpu-memory-utilization 1.5"])
    assert exited.value.code == 2
    assert "--gpu-memory-utilization is 1.5, expected in (0, 1]" in capsys.readouterr().err


def test_the_serves_old_max_lag_flag_is_refused_naming_admit_lag(capsys) -> None:
    """--max-lag is the learner's staleness gate; the serve's admission window is --admit-lag (never an alias)."""
    err = usage_error(capsys, "--max-lag", "2")
    assert "--max-lag was renamed" in err and "--admit-lag" in err
    assert parse("--admit-lag", "2").admit_lag == 2


def test_a_cuda_serve_plans_its_updates_memory_from_the_checkpoint_and_hands_vllm_the_lowered_fraction() -> None:
    from inflight.models import model_dir
    from inflight.serve.app import engine_config
    from vllm_patches.engine import engine_kwargs

    cfg = parse("--dtype", "bfloat16")
    config = engine_config(cfg, model_dir("smollm2"), "cuda", device_bytes=8 << 30)
    plan = config.gpu_plan
    assert (config.enforce_eager, config.update_memory) == (False, "low")
    assert plan is not None and plan.staging.update_memory == "low"
    assert 250_000_000 < plan.staging.weight_bytes < 300_000_000  # SmolLM2-135M in bf16
    fraction = engine_kwargs(config, "cuda")["gpu_memory_utilization"]
    assert fraction == pytest.approx(0.9 - plan.staging.peak_bytes / (8 << 30))
    assert "staging plan: weights 0.25 GiB, --update-memory low" in plan.describe()
    deltas = engine_config(cfg, model_dir("smollm2"), "cuda", device_bytes=8 << 30, delta=True).gpu_plan.staging
    decoded = plan.staging.weight_bytes + DECODE_WORKSPACE_BYTES  # beside the payloads, a chunk at a time
    assert deltas.delta and deltas.peak_bytes - plan.staging.peak_bytes == decoded
    assert deltas.arena_bytes - plan.staging.arena_bytes == plan.staging.weight_bytes  # the arena holds them too


def test_a_low_serve_planned_for_deltas_has_room_to_prepare_an_update_beside_the_base_it_keeps() -> None:
    """`low` prepares an update a delta may follow beside the tensors it keeps as the delta's base only where its
    device arena has the room (vllm_patches/staging.py:prepares_beside): a CUDA serve whose learner sends deltas and a
    CPU `low` engine have it; a CUDA serve planned without deltas has not, and reloads such an update in place."""
    import torch
    from support import TEST_ENGINE

    from inflight.models import model_dir
    from inflight.serve.app import engine_config
    from inflight.wire.weights import plan_update
    from vllm_patches.device_plan import checkpoint_shapes
    from vllm_patches.engine import EngineConfig, arena_sizes
    from vllm_patches.staging import prepares_beside

    smol = model_dir("smollm2")
    state = {
        name: torch.empty(shape, dtype=torch.bfloat16, device="meta") for name, shape in checkpoint_shapes(smol).items()
    }
    manifest, _ = plan_update(state, 2, 64 << 20, checksums=False, keep_base=True)
    cfg = parse("--dtype", "bfloat16")
    arena = {
        d: engine_config(cfg, smol, "cuda", device_bytes=8 << 30, delta=d).gpu_plan.staging.arena_bytes for d in (0, 1)
    }
    cpu = arena_sizes(EngineConfig(model=str(smol), **{**TEST_ENGINE, "update_memory": "low"}))[0]
    assert prepares_beside(arena[True], manifest, None) and prepares_beside(cpu, manifest, None)
    assert not prepares_beside(arena[False], manifest, None)


def test_a_cuda_serve_with_double_under_graphs_plans_the_kept_version_it_rolls_back_to() -> None:
    """Its prepared layers are copied into the live storage, so it keeps the staged version as `low` does; eager,
    it swaps them in and keeps nothing."""
    from inflight.models import model_dir
    from inflight.serve.app import engine_config

    def staging(*flags: str):
        return engine_config(
            parse("--dtype", "bfloat16", *flags), model_dir("smollm2"), "cuda", 8 << 30
        ).gpu_plan.staging

    graphs, eager = (
        staging("--update-memory", "double"),
        staging("--update-memory", "double", "--enforce-eager", "true"),
    )
    assert graphs.copy_commit and graphs.host_bytes == graphs.weight_bytes
    assert not eager.copy_commit and eager.host_bytes == 0


def test_a_gpu_too_small_for_an_update_beside_the_engine_is_refused_before_vllm_starts() -> None:
    from inflight.models import model_dir
    from inflight.serve.app import engine_config

    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        engine_config(parse("--dtype", "bfloat16"), model_dir("smollm2"), "cuda", device_bytes=512 << 20)


def test_a_cpu_serve_makes_no_gpu_plan_and_keeps_eager_with_the_prepared_swap() -> None:
    from inflight.models import model_dir
    from inflight.serve.app import engine_config

    config = engine_config(parse("--dtype", "bfloat16"), model_dir("smollm2"), "cpu", device_bytes=0)
    assert config.gpu_plan is None and (config.enforce_eager, config.update_memory) == (True, "double")


REFUSED_BY_THE_ENGINE = [
    (("--routing-replay", "on"), "--routing-replay off"),  # tiny-llama is dense: no router to record
    (("--enforce-eager", "false", "--update-memory", "low"), "--enforce-eager false on a CPU serve"),
]


@pytest.mark.parametrize(("flags", "fix"), REFUSED_BY_THE_ENGINE)
def test_a_config_the_engine_refuses_ends_the_serve_in_one_line_naming_the_flag_before_vllm_starts(
    model_dirs, flags, fix
):
    from inflight.serve.app import main

    with pytest.raises(SystemExit) as exited:
        main(["--model", str(model_dirs["tiny-llama"]), *flags])
    message = str(exited.value.code)
    assert message.startswith("inflight.serve: ") and fix in message and "\n" not in message.strip()


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "::", "train0"])
def test_an_openai_api_bound_beyond_loopback_without_vllms_api_key_is_refused_naming_the_key(host, monkeypatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"--http-host is .* VLLM_API_KEY"):
        ServeConfig(http_port=8000, http_host=host).validate()
    monkeypatch.setenv("VLLM_API_KEY", "a-key")
    ServeConfig(http_port=8000, http_host=host).validate()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_an_openai_api_on_loopback_or_no_api_at_all_needs_no_key(host, monkeypatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    ServeConfig(http_port=8000, http_host=host).validate()
    ServeConfig(http_port=0, http_host="0.0.0.0").validate()  # --http-host without --http-port binds nothing
