"""The engine's vLLM arguments (vllm_patches/engine.py:engine_kwargs), built without starting an engine: memory is
sized by a GPU fraction on CUDA and by an explicit KV cache on CPU, never both; CUDA graphs are taken with either update
path; scheduling stays synchronous everywhere."""

from __future__ import annotations

import dataclasses

import pytest
from support import TEST_ENGINE

from vllm_patches.device_plan import GIB, StagingPlan, plan_gpu_memory
from vllm_patches.engine import EngineConfig, engine_kwargs


def config(**fields) -> EngineConfig:
    """The tests' engine config (tests/support.py:TEST_ENGINE) of a model "m", `fields` changed."""
    return EngineConfig(**{"model": "m", **TEST_ENGINE, **fields})


def planned(cfg: EngineConfig, weight_bytes: int = 4 * GIB, device_bytes: int = 80 * GIB) -> EngineConfig:
    """`cfg` with the staging plan a CUDA serve makes for it (a 2B bf16 model on an 80 GiB GPU by default)."""
    staging = StagingPlan(weight_bytes, cfg.update_memory, delta=False)
    return dataclasses.replace(cfg, gpu_plan=plan_gpu_memory(staging, device_bytes, cfg.gpu_memory_utilization))


def test_a_cuda_engine_sizes_its_memory_by_gpu_memory_utilization_and_passes_no_kv_cache_bytes() -> None:
    kwargs = engine_kwargs(planned(config(gpu_memory_utilization=0.75, kv_cache_gib=0.25)), "cuda")
    assert kwargs["gpu_memory_utilization"] == pytest.approx(0.75 - 2 * 4 / 80)  # the double update set aside
    assert "kv_cache_memory_bytes" not in kwargs  # vLLM would read it in place of the fraction


def test_a_cpu_engine_sizes_its_kv_cache_in_bytes_and_passes_no_gpu_fraction() -> None:
    kwargs = engine_kwargs(config(gpu_memory_utilization=0.75, kv_cache_gib=0.25), "cpu")
    assert kwargs["kv_cache_memory_bytes"] == 1 << 28
    assert "gpu_memory_utilization" not in kwargs


def test_a_cuda_device_with_an_index_is_still_cuda() -> None:
    assert "gpu_memory_utilization" in engine_kwargs(planned(config()), "cuda:1")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_scheduling_stays_synchronous_and_an_eager_config_stays_eager_on_every_device(device) -> None:
    kwargs = engine_kwargs(planned(config(enforce_eager=True)), device)
    assert kwargs["async_scheduling"] is False  # exact token versions need the synchronous step path
    assert kwargs["enforce_eager"] is True


def test_cuda_graphs_are_allowed_with_the_update_path_that_keeps_parameter_storage() -> None:
    kwargs = engine_kwargs(planned(config(enforce_eager=False, update_memory="low")), "cuda")
    assert kwargs["enforce_eager"] is False


def test_a_cuda_engine_without_a_staging_plan_is_refused_naming_the_plan() -> None:
    with pytest.raises(ValueError, match="needs a staging plan"):
        engine_kwargs(config(), "cuda")


def test_a_staging_plan_made_for_other_engine_values_is_refused() -> None:
    cfg = planned(config(gpu_memory_utilization=0.9))
    with pytest.raises(ValueError, match="plan again"):
        engine_kwargs(dataclasses.replace(cfg, gpu_memory_utilization=0.8), "cuda")


def test_a_cpu_engine_refuses_compilation_which_may_freeze_the_weights_into_its_graph() -> None:
    with pytest.raises(ValueError, match="--enforce-eager false on a CPU serve.*Keep --enforce-eager true on CPU"):
        engine_kwargs(config(enforce_eager=False, update_memory="low"), "cpu")


@pytest.mark.parametrize(
    ("enforce_eager", "update_memory"), [(True, "double"), (True, "low"), (False, "low"), (False, "double")]
)
def test_every_combination_of_eager_and_update_memory_is_accepted_on_cuda(enforce_eager, update_memory) -> None:
    """Under CUDA graphs `double` copies its prepared layers into the live storage (vllm_patches/commit.py)."""
    kwargs = engine_kwargs(planned(config(enforce_eager=enforce_eager, update_memory=update_memory)), "cuda")
    assert kwargs["enforce_eager"] is enforce_eager


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.01])
def test_a_gpu_memory_utilization_outside_zero_to_one_is_refused_naming_the_field(fraction) -> None:
    with pytest.raises(ValueError, match=rf"gpu_memory_utilization must be in \(0, 1\] \(got {fraction}\)"):
        engine_kwargs(config(gpu_memory_utilization=fraction), "cuda")


def test_every_argument_is_a_field_of_vllms_async_engine_args() -> None:
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for device in ("cpu", "cuda"):
        unknown = set(engine_kwargs(planned(config()), device)) - fields
        assert not unknown, f"not AsyncEngineArgs fields in vLLM {vllm.__version__}: {unknown}"


def test_routing_replay_turns_prefix_caching_off_since_a_cached_block_has_no_route() -> None:
    assert engine_kwargs(config(), "cpu")["enable_prefix_caching"] is True
    assert engine_kwargs(config(routing_replay=True), "cpu")["enable_prefix_caching"] is False


@pytest.mark.parametrize(
    ("device", "eager", "environ", "mechanism", "env"),
    [
        ("cpu", True, {}, "recorder", {}),
        ("cuda", True, {}, "recorder", {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
        ("cuda:1", True, {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "recorder", {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    ],
)
def test_routing_replay_records_on_the_v1_runner_eager_on_every_device(device, eager, environ, mechanism, env):
    """Issue 40, point 2: the capture is a pure function of the engine config; on CUDA it pins the V1 runner."""
    from vllm_patches.routes import route_capture

    capture = route_capture(device, True, eager, environ)
    assert (capture.mechanism, capture.env) == (mechanism, env)
    assert route_capture(device, False, False, {"VLLM_USE_V2_MODEL_RUNNER": "1"}).mechanism == "none"


@pytest.mark.parametrize(
    ("eager", "environ", "names"),
    [(False, {}, "--enforce-eager false"), (True, {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "VLLM_USE_V2_MODEL_RUNNER=1")],
)
def test_a_cuda_config_under_which_routes_would_go_unrecorded_is_refused_naming_it(eager, environ, names):
    """CUDA graphs replay the MoE layers without the Python capture; Model Runner V2 is refused by the recorder."""
    from vllm_patches.routes import route_capture

    with pytest.raises(ValueError, match=f"--routing-replay on with {names}"):
        route_capture("cuda", True, eager, environ)
    if not eager:
        cfg = planned(config(routing_replay=True, enforce_eager=False, update_memory="low"))
        with pytest.raises(ValueError, match="no route would be recorded"):
            engine_kwargs(cfg, "cuda")


def test_the_recorder_refuses_a_runner_that_replays_cuda_graphs():
    """The worker's own guard, on vLLM's real CompilationConfig: graphs on means no capture runs on replay."""
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CUDAGraphMode

    from vllm_patches.routes import check_eager_runner

    def runner(mode):
        return SimpleNamespace(vllm_config=SimpleNamespace(compilation_config=CompilationConfig(cudagraph_mode=mode)))

    check_eager_runner(runner(CUDAGraphMode.NONE))
    with pytest.raises(ValueError, match="FULL_AND_PIECEWISE.*--enforce-eager true"):
        check_eager_runner(runner(CUDAGraphMode.FULL_AND_PIECEWISE))


def test_a_request_whose_routes_miss_fed_positions_fails_instead_of_sending_a_rollout_without_them():
    """Issue 40, point 2: no configuration records nothing silently, whatever the reason the capture did not run."""
    from vllm_patches.routes import RoutedExperts, check_route_coverage

    def routes(positions: int) -> RoutedExperts:
        return RoutedExperts(bytes(positions * 2 * 4), positions, layers=2, top_k=4, dtype="uint8")

    check_route_coverage(routes(9), fed=9, request_id="r")
    check_route_coverage(None, fed=0, request_id="r")  # nothing was fed: nothing to record
    with pytest.raises(RuntimeError, match="request r has routes for 0 of its 9 fed positions"):
        check_route_coverage(None, fed=9, request_id="r")
    with pytest.raises(RuntimeError, match="routes for 5 of its 9"):
        check_route_coverage(routes(5), fed=9, request_id="r")
