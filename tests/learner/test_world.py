"""learner/world.py: where a learner rank runs, resolved once from `--device` and torchrun's environment; and the
CUDA branch's FSDP2 mixed precision (`shard_policy(compute_dtype=...)`), exercised on a CPU world of one."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from learner.model import load_policy, shard_policy
from learner.step import Sample, TrainConfig, make_batch, make_optimizer, train_step
from learner.world import World, WorldError, resolve_device, start_world

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour of a machine without CUDA")


@no_gpu
def test_auto_resolves_to_the_cpu_on_a_machine_without_cuda():
    assert resolve_device("auto") == "cpu"


@no_gpu
def test_device_cuda_without_a_gpu_fails_at_start_naming_the_flag_and_the_fix():
    with pytest.raises(WorldError, match=r"--device is 'cuda', but torch sees no CUDA device .*pass --device cpu"):
        resolve_device("cuda")


def test_nccl_weights_from_a_cpu_learner_are_refused_before_any_group_is_joined(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # would join a world if the check came later
    with pytest.raises(WorldError, match=r"--backend is 'nccl', but the learner runs on the CPU .*--backend gloo"):
        start_world("cpu", "nccl")
    assert not dist.is_initialized()


def test_without_torchrun_a_cpu_learner_is_a_world_of_one_with_gloo_and_no_mesh(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    world = start_world("cpu")
    assert world == World("cpu", rank=0, local_rank=0, size=1, weights_backend="gloo", mesh=None)
    assert (world.device, world.backend, world.weights_device) == (torch.device("cpu"), "gloo", torch.device("cpu"))
    assert not dist.is_initialized()


def test_a_cuda_rank_owns_its_local_gpu_runs_nccl_and_gathers_decoder_layers_in_the_autocast_dtype():
    world = World("cuda", rank=3, local_rank=1, size=4, weights_backend="nccl")  # no GPU needed: placement only
    assert (world.device, world.backend, world.weights_device) == (torch.device("cuda", 1), "nccl", world.device)
    assert world.layer_compute_dtype(torch.bfloat16) is torch.bfloat16
    assert World("cuda", weights_backend="gloo").weights_device == torch.device("cpu")  # gloo sends host memory
    assert World("cpu").layer_compute_dtype(torch.bfloat16) is None  # the CPU keeps autocast alone, as before


@pytest.fixture
def world_of_one(tmp_path: Path):
    """A gloo world of one in this process and its 1-rank CPU mesh, torn down after the test."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    holder = {"mesh": init_device_mesh("cpu", (1,))}
    try:
        yield holder
    finally:
        holder.clear()
        gc.collect()  # the mesh and the model before the group (docs/ARCHITECTURE.md "Testing distributed code on CPU")
        dist.destroy_process_group()


def test_sharded_with_a_compute_dtype_the_decoder_layers_run_in_bf16_and_the_lm_head_and_master_weights_stay_fp32(
    model_dirs, world_of_one
):
    reference = load_policy(model_dirs["tiny-llama"])
    model = shard_policy(load_policy(model_dirs["tiny-llama"]), world_of_one["mesh"], compute_dtype=torch.bfloat16)
    world_of_one["model"] = model
    seen = {}

    def dtype_during_forward(key: str, weight_of):
        def hook(_module, _args) -> None:
            seen[key] = weight_of().dtype

        return hook

    q_proj, norm = model.hf.model.layers[0].self_attn.q_proj, model.hf.model.norm
    q_proj.register_forward_pre_hook(dtype_during_forward("layer", lambda: q_proj.weight))
    norm.register_forward_pre_hook(dtype_during_forward("head", lambda: model.hf.lm_head.weight))
    sample = Sample(list(range(5, 12)), list(range(20, 29)), [-5.0] * 9, 1.0, [True] * 9)
    batch = make_batch([sample], pad_id=0)
    with torch.no_grad():
        want = reference(batch.input_ids, batch.targets, 1.0).logp
        got = model(batch.input_ids, batch.targets, 1.0).logp
    assert seen == {"layer": torch.bfloat16, "head": torch.float32}
    gap = (got - want)[batch.mask].abs().max().item()
    print(f"\nlargest |bf16 layers - fp32| logprob gap {gap:.2e}")
    assert 0 < gap < 0.2, gap  # bf16 rounding in the layers: visible, and far below a broken forward
    train_step(model, make_optimizer(model, TrainConfig(lr=1e-3)), batch, TrainConfig(lr=1e-3))
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # master weights (and AdamW) stay fp32
