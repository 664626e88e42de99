"""The serve's GPU flags (inflight/serve/config.py): `--gpu-memory-utilization` checked at start and naming the flag,
`--enforce-eager false` refused with the update path that installs new storage, and an `inflight.run` on GPUs that
leaves the serve's memory sizing to the serve's own defaults (no CPU-only `--kv-cache-gib` sent to a GPU serve)."""

from __future__ import annotations

import pytest

from inflight.config import parse_dataclass
from inflight.run.config import RunConfig
from inflight.run.launch import side_commands
from inflight.serve.config import ServeConfig


def parse(*flags: str) -> ServeConfig:
    return parse_dataclass(ServeConfig, list(flags), "inflight.serve", "test")


def usage_error(capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(*flags)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_enforce_eager_false_with_update_memory_double_is_refused_at_start_naming_both_flags_and_the_fix(capsys):
    err = usage_error(capsys, "--enforce-eager", "false")  # --update-memory double is the default
    assert "--enforce-eager false with --update-memory double" in err and "Pass --update-memory low" in err


def test_enforce_eager_false_with_update_memory_low_is_accepted() -> None:
    cfg = parse("--enforce-eager", "false", "--update-memory", "low")
    assert cfg.enforce_eager is False and cfg.update_memory == "low"


def test_enforce_eager_defaults_to_true_as_before() -> None:
    assert parse().enforce_eager is True


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
    assert cfg.gpu_memory_utilization == 0.9 and cfg.enforce_eager is True


def test_a_run_passes_the_serves_gpu_flags_through_serve_args(tmp_path) -> None:
    run = RunConfig(serve_gpus="0", serve_args="--gpu-memory-utilization 0.6 --enforce-eager false --update-memory low")
    cfg = parse(*side_commands(run, tmp_path, (1, 2, 3))["serve"][2:])
    assert (cfg.gpu_memory_utilization, cfg.enforce_eager, cfg.update_memory) == (0.6, False, "low")


def test_a_run_refuses_cuda_graphs_over_the_double_update_path_before_anything_starts(tmp_path, capsys) -> None:
    from inflight.run.app import plan

    with pytest.raises(SystemExit) as exited:
        plan(["--run-dir", str(tmp_path / "run"), "--serve-gpus", "0", "--serve-args", "--enforce-eager false"])
    assert exited.value.code == 2
    assert "--enforce-eager false with --update-memory double" in capsys.readouterr().err


def test_the_serves_old_max_lag_flag_is_refused_naming_admit_lag(capsys) -> None:
    """--max-lag is the learner's staleness gate; the serve's admission window is --admit-lag (never an alias)."""
    err = usage_error(capsys, "--max-lag", "2")
    assert "--max-lag was renamed" in err and "--admit-lag" in err
    assert parse("--admit-lag", "2").admit_lag == 2
