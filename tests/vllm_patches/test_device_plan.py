"""The staging plan (vllm_patches.device_plan.py): the device bytes an update needs, reserved out of the fraction of
the GPU vLLM would otherwise give its KV cache, or a refusal naming the numbers and the fix. Pure arithmetic, so it is
decided here on CPU; the checkpoint reader runs on a real prepared model."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from inflight.models import model_dir
from vllm_patches.device_plan import GIB, StagingPlan, checkpoint_weight_bytes, plan_gpu_memory

TWO_B_BF16 = 2_000_000_000 * 2
H100 = 80 * GIB


@pytest.mark.parametrize(
    ("update_memory", "delta", "peak", "host"),
    [("low", False, 1, 1), ("double", False, 2, 0), ("low", True, 2, 1), ("double", True, 3, 1)],
)
def test_an_update_needs_its_buckets_plus_the_processed_copy_in_double_plus_decoded_deltas_and_holds_nothing_after(
    update_memory, delta, peak, host
):
    plan = StagingPlan(weight_bytes=TWO_B_BF16, update_memory=update_memory, delta=delta)
    assert (plan.peak_bytes, plan.host_bytes) == (peak * TWO_B_BF16, host * TWO_B_BF16)
    assert ("pinned host memory kept between updates" in plan.describe()) == bool(host)


def test_a_2b_bf16_model_at_0_9_of_an_80gb_gpu_gets_its_double_update_set_aside_from_the_kv_cache():
    plan = plan_gpu_memory(StagingPlan(TWO_B_BF16, "double", delta=False), H100, 0.9)
    assert plan.engine_utilization == pytest.approx(0.9 - 2 * TWO_B_BF16 / H100)
    # what vLLM may take plus what the update takes is still the fraction the user gave
    assert plan.engine_utilization * H100 + plan.staging.peak_bytes == pytest.approx(0.9 * H100)
    assert "becomes 0.807" in plan.describe() and "7.45 GiB on the device at its peak" in plan.describe()


def test_a_model_whose_update_leaves_vllm_too_little_is_refused_naming_the_numbers_and_every_flag_that_helps():
    fifteen_b = 15_000_000_000 * 2
    with pytest.raises(ValueError) as refused:
        plan_gpu_memory(StagingPlan(fifteen_b, "double", delta=True), H100, 0.9)
    text = str(refused.value)
    for words in (
        "--gpu-memory-utilization 0.9",
        "80.0 GiB",
        "83.82 GiB on the device at its peak",
        "--full-every 1",
    ):
        assert words in text
    with pytest.raises(ValueError, match="pass --update-memory low"):
        plan_gpu_memory(StagingPlan(fifteen_b, "double", delta=False), H100, 0.8)
    # a 7B model's double update fits at 0.8
    assert plan_gpu_memory(StagingPlan(7_000_000_000 * 2, "double", delta=False), H100, 0.8).engine_utilization > 0.4


def test_the_checkpoint_reader_counts_every_tensor_of_a_real_model_from_the_headers_alone():
    where = model_dir("smollm2")
    expected = 0
    for path in sorted(where.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                expected += f.get_tensor(name).numel()
    assert expected > 100_000_000  # SmolLM2-135M
    assert checkpoint_weight_bytes(where, "bfloat16") == 2 * expected
    assert checkpoint_weight_bytes(where, "float32") == 4 * expected


def test_an_unresolved_dtype_is_refused_naming_the_value():
    with pytest.raises(ValueError, match="'auto'"):
        checkpoint_weight_bytes(model_dir("smollm2"), "auto")


def test_the_cpu_only_moe_reload_fix_runs_on_a_cpu_model_and_on_no_other():
    import torch

    from vllm_patches.commit import moe_reload_needs_fresh_kernels

    assert moe_reload_needs_fresh_kernels(torch.nn.Linear(2, 2))
    assert not moe_reload_needs_fresh_kernels(torch.nn.Linear(2, 2, device="meta"))  # not CPU: no prepack to redo
    assert not moe_reload_needs_fresh_kernels(torch.nn.Module())


@pytest.mark.parametrize(
    ("cores", "workers", "bind"),
    [([0, 1], 2, "0|1"), (list(range(8)), 2, "0-3|4-7"), ([0, 2, 4, 6], 2, "0,2|4,6"), ([3, 1, 2], 1, "1-3")],
)
def test_a_cpu_tensor_parallel_serve_gives_each_worker_an_equal_share_of_its_cores(cores, workers, bind):
    from vllm_patches.device_plan import cpu_threads_bind

    assert cpu_threads_bind(cores, workers) == bind


def test_more_cpu_workers_than_cores_is_refused_naming_the_flag():
    from vllm_patches.device_plan import cpu_threads_bind

    with pytest.raises(ValueError, match="--tensor-parallel-size 3 on a CPU serve"):
        cpu_threads_bind([0, 1], 3)
