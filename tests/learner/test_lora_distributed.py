"""LoRA under FSDP2 on CPU (gloo, 2 ranks; learner/lora.py, learner/model.py:shard_policy): every decoder layer is one
FSDP unit holding frozen base weights and trainable adapters together, and a 2-rank run equals a 1-process run on the
whole batch — the same logprobs, loss and grad norm, and the same adapter after the step — and a sharded checkpoint
restores the adapter and its optimizer state.

The recipe is test_distributed.py's (spawn_support.py's group, left by both ranks together; results through files);
one spawn runs both models. float64 throughout: the runs check logic, so they may differ only by rounding bounds
derived from the arithmetic (tests/tolerances.py). The split is uneven (the long rows on rank 0), so a rank-local loss
normaliser would move the loss and the gradient far beyond them.
"""

from __future__ import annotations

import faulthandler
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lora_support import PAD, lora_policy, rollouts
from spawn_support import process_group
from tolerances import (
    assert_within,
    check_within,
    float64_bound,
    lm_head_logprob_bound,
    logprob_gradient_bound,
    policy_loss_bound,
)
from torch.distributed.tensor import DTensor

from inflight.wire.contract import SamplingKnobs
from learner.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from learner.export import checkpoint_tensor_names, full_hf_state
from learner.fused_loss import aggregation_weights
from learner.lora import adapter_state
from learner.losses import LossConfig
from learner.model import PolicyModel, shard_policy
from learner.step import TrainConfig, make_batch, make_optimizer, train_step

WORLD = 2
DTYPE = torch.float64
STALL_S = 150  # a rank still running after this long is stuck
LR = 1e-4
LENGTHS = ((5, 9), (4, 7), (3, 3), (2, 2))  # rank 0: the two long rows, rank 1: the two short ones
CFG = TrainConfig(lr=LR, sampling=SamplingKnobs(temperature=0.7), loss=LossConfig(kind="tis", aggregation="token"))
MODELS = ("tiny-llama", "tiny-qwen2")


def samples_for(model: PolicyModel, seed: int = 0):
    return rollouts(model.hf.config.vocab_size, seed, LENGTHS)


def rank_worker(rank: int, tmp: str, jobs: dict[str, str]) -> None:
    torch.set_num_threads(1)  # the ranks share the box's cores
    faulthandler.dump_traceback_later(STALL_S, exit=False)  # a stuck rank shows where it is, then times out
    try:
        with process_group(Path(tmp) / "store", rank, WORLD, STALL_S + 30):
            for name, model_dir in jobs.items():
                run_rank(rank, Path(tmp) / name, model_dir)
    finally:
        faulthandler.cancel_dump_traceback_later()


def sharded_lora_policy(model_dir: str, seed: int = 0) -> tuple[PolicyModel, torch.optim.Optimizer]:
    mesh = dist.device_mesh.init_device_mesh("cpu", (WORLD,))
    model = shard_policy(lora_policy(model_dir, DTYPE, seed=seed), mesh)
    return model, make_optimizer(model, CFG)


def run_rank(rank: int, tmp: Path, model_dir: str) -> None:
    """Logprobs and step 1 on this rank's half, checkpoint, restore into a fresh model, step 2 on both."""
    model, optimizer = sharded_lora_policy(model_dir)
    samples = samples_for(model)
    batch = make_batch(samples[rank * 2 : rank * 2 + 2], PAD)
    with torch.no_grad():
        logp = model(batch.input_ids, batch.targets, CFG.sampling.temperature).logp[batch.mask]
    metrics = train_step(model, optimizer, batch, CFG, world_size=WORLD)
    after_step1 = adapter_state(model)
    save_checkpoint(checkpoint_dir(tmp / "ckpt", 1), model, optimizer, {"version": 1})
    restored, restored_optimizer = sharded_lora_policy(model_dir, seed=7)  # other adapters, no Adam state
    load_checkpoint(latest_checkpoint(tmp / "ckpt"), restored, restored_optimizer)
    restored_step1 = adapter_state(restored)
    second = make_batch(samples_for(model, seed=1)[rank * 2 : rank * 2 + 2], PAD)
    train_step(model, optimizer, second, CFG, world_size=WORLD)
    train_step(restored, restored_optimizer, second, CFG, world_size=WORLD)
    after_step2, restored_step2 = adapter_state(model), adapter_state(restored)
    base = full_hf_state(model)  # collective: the frozen base weights, what the serves are checked against at Hello
    result = {"logp": logp, "metrics": metrics, "frozen_sharded": frozen_params_are_sharded(model)}
    if rank == 0:
        result["adapter"] = after_step1
        result["base_names"] = set(base)
        loaded, stepped = equal(restored_step1, after_step1), equal(restored_step2, after_step2)
        result["restore"] = {"after_load": loaded, "next": stepped}
    torch.save(result, tmp / f"rank{rank}.pt")


def frozen_params_are_sharded(model: PolicyModel) -> bool:
    """Every parameter, frozen or not, is a DTensor sharded over the mesh (one FSDP unit holds both kinds)."""
    params = list(model.named_parameters())
    frozen = [p for _, p in params if not p.requires_grad]
    return bool(frozen) and all(isinstance(p, DTensor) for _, p in params)


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def reference(model_dir: str) -> dict:
    """One process, the whole batch: logprobs, step metrics, the adapter after the step, and the rounding bounds."""
    model = lora_policy(model_dir, DTYPE)
    optimizer = make_optimizer(model, CFG)
    batch = make_batch(samples_for(model), PAD)
    with torch.no_grad():
        hidden = model.hf.model(input_ids=batch.input_ids).last_hidden_state[batch.mask]
        logp = model(batch.input_ids, batch.targets, CFG.sampling.temperature).logp
    head = model.hf.lm_head.weight
    # δ: a gradient entry's error
    relative = logprob_gradient_bound(DTYPE, hidden, head, CFG.sampling.temperature, 1.0)
    weights = aggregation_weights(batch.mask.flatten(), batch.seq_ids.flatten(), CFG.loss.aggregation)
    loss_bound = policy_loss_bound(logp.flatten(), batch.behaviour_logp.flatten(), batch.advantages.flatten(),
                                   weights, 2 * relative, DTYPE)  # fmt: skip
    metrics = train_step(model, optimizer, batch, CFG)
    # AdamW's first step moves a weight by lr·g/(|g| + eps): a gradient error ε (both runs: 4·δ·max|g|, max|g| read
    # back from the first moment m = (1 − β1)·g) moves it by at most lr·ε/eps, plus the update's own roundings.
    max_grad = max(float(optimizer.state[p]["exp_avg"].abs().max()) for p in optimizer.state) / (1 - CFG.betas[0])
    adapter = adapter_state(model)
    epsilon = 4 * relative * max_grad
    bounds = {k: 3 * LR * epsilon / CFG.eps + float64_bound(3, float(t.abs().max()) + LR) for k, t in adapter.items()}
    return {
        "logp": logp[batch.mask],
        "logp_bound": 2 * lm_head_logprob_bound(DTYPE, hidden, head, CFG.sampling.temperature),
        "metrics": metrics,
        "loss_bound": loss_bound,
        "grad_norm_bound": 2 * relative * metrics["grad_norm"] + float64_bound(len(adapter), metrics["grad_norm"]),
        "adapter": adapter,
        "adapter_bounds": bounds,
    }


@pytest.fixture(scope="module")
def runs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("lora-fsdp")
    for name in MODELS:
        (tmp / name).mkdir()
    references = {name: reference(str(model_dirs[name])) for name in MODELS}
    mp.spawn(rank_worker, args=(str(tmp), {name: str(model_dirs[name]) for name in MODELS}), nprocs=WORLD, join=True)
    return {
        name: {"reference": references[name], "ranks": [torch.load(tmp / name / f"rank{r}.pt") for r in range(WORLD)]}
        for name in MODELS
    }


@pytest.mark.parametrize("name", MODELS)
def test_frozen_and_trainable_parameters_shard_together_on_two_ranks(runs: dict, name: str) -> None:
    assert all(rank["frozen_sharded"] for rank in runs[name]["ranks"])


@pytest.mark.parametrize("name", MODELS)
def test_two_rank_lora_logprobs_loss_and_grad_norm_equal_one_process_on_the_whole_batch(runs: dict, name: str):
    ref, ranks = runs[name]["reference"], runs[name]["ranks"]
    logp = torch.cat([rank["logp"] for rank in ranks])  # rank 0's rows first, as in the whole batch
    assert_within(logp, ref["logp"], ref["logp_bound"], "logprobs")
    for rank in ranks:
        check_within(abs(rank["metrics"]["loss"] - ref["metrics"]["loss"]), ref["loss_bound"], "loss")
        check_within(abs(rank["metrics"]["grad_norm"] - ref["metrics"]["grad_norm"]), ref["grad_norm_bound"], "norm")
        assert rank["metrics"]["normalizer"] == ref["metrics"]["normalizer"]


@pytest.mark.parametrize("name", MODELS)
def test_two_rank_lora_step_gives_the_one_process_adapter(runs: dict, name: str, model_dirs) -> None:
    ref, adapter = runs[name]["reference"], runs[name]["ranks"][0]["adapter"]
    initial = adapter_state(lora_policy(model_dirs[name], DTYPE))
    assert adapter.keys() == ref["adapter"].keys() == initial.keys()
    moved = max(float((ref["adapter"][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 0.5 * LR  # AdamW moved the adapter by ~lr: the step is not trivial
    for key in sorted(adapter):
        assert_within(adapter[key], ref["adapter"][key], ref["adapter_bounds"][key], key)


@pytest.mark.parametrize("name", MODELS)
def test_a_two_rank_lora_checkpoint_restores_the_adapter_and_its_optimizer_state(runs: dict, name: str) -> None:
    # equal after the load, and equal after one more step: Adam's moments and step count came back too
    assert runs[name]["ranks"][0]["restore"] == {"after_load": True, "next": True}


@pytest.mark.parametrize("name", MODELS)
def test_full_hf_state_of_a_sharded_lora_policy_has_the_base_checkpoint_names(runs: dict, name: str, model_dirs):
    assert runs[name]["ranks"][0]["base_names"] == checkpoint_tensor_names(model_dirs[name])
