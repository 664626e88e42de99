"""FSDP2 data parallelism on CPU (gloo): a 2-rank step equals a 1-process step on the whole batch, and a sharded
checkpoint restores params and optimizer exactly, on 2 ranks and resharded onto 1 (learner/model.py, step.py,
checkpoint.py).

One module fixture runs everything once: a 1-process reference in the test process, then one spawn of 2 ranks
(file:// rendezvous, results through files, see docs/ARCHITECTURE.md "Testing distributed code on CPU") that runs both
models in turn, after which rank 0 alone joins a world of 1 to resume the checkpoints. The batch is split unevenly (the
long sequences and the fully masked one on rank 0), so only a global loss normaliser makes the runs agree.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learner.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from learner.losses import LossConfig
from learner.model import PolicyModel, full_hf_state, load_policy, shard_policy
from learner.step import Sample, TrainConfig, make_batch, make_optimizer, train_step

WORLD = 2
STALL_S = 150  # a rank still running after this long is stuck (the whole spawn takes ~20 s)
LR = 1e-4
PAD_ID = 0
PROMPT_LENS, COMPLETION_LENS = (5, 3, 4, 2), (9, 7, 3, 2)  # rank 0: the 2 long samples, rank 1: 2 short ones
CONFIGS = {  # each model covers one aggregation, so both global normalisers are exercised
    "tiny-qwen2": TrainConfig(lr=LR, temperature=0.7, loss=LossConfig(kind="ppo", aggregation="token")),
    "tiny-llama": TrainConfig(lr=LR, temperature=1.0, loss=LossConfig(kind="tis", aggregation="sequence")),
}


@dataclass
class Runs:
    initial: dict[str, torch.Tensor]
    reference: list[dict[str, torch.Tensor]]  # 1 process, whole batch: params after step 1 and step 2
    reference_metrics: list[dict[str, float]]
    sharded: list[dict[str, torch.Tensor]]  # 2 ranks, gathered full params after step 1 and step 2
    sharded_metrics: list[list[dict[str, float]]]  # [rank][step]
    restore: dict[str, bool]
    one_rank: dict  # the 2-rank checkpoint resumed on 1 rank: loaded params, params and metrics after step 2


def make_samples(model: PolicyModel, cfg: TrainConfig, seed: int) -> tuple[list[Sample], list[Sample]]:
    """Random tokens; behaviour logprobs = the model's own + noise, so ratios spread around 1; some tokens masked."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for p_len, c_len in zip(PROMPT_LENS, COMPLETION_LENS, strict=True):
        ids = torch.randint(1, model.hf.config.vocab_size, (p_len + c_len,), generator=gen).tolist()
        token_mask = (torch.rand(c_len, generator=gen) > 0.2).tolist()
        if len(samples) == 1:  # a sample the staleness gate dropped whole: ranks hold 1 and 2 trainable sequences
            token_mask = [False] * c_len
        samples.append(Sample(ids[:p_len], ids[p_len:], [0.0] * c_len, 0.0, token_mask))
    batch = make_batch(samples, PAD_ID)
    with torch.no_grad():
        logp = model(batch.input_ids, batch.targets, cfg.temperature)
    advantages = [1.0, -0.6, 0.8, -1.2]
    first = []
    for row, (s, adv) in enumerate(zip(samples, advantages, strict=True)):
        start = len(s.prompt_ids) - 1
        own = logp[row, start : start + len(s.completion_ids)]
        behaviour = own + 0.3 * torch.randn(own.shape, generator=gen)
        first.append(s._replace(behaviour_logprobs=behaviour.tolist(), advantage=adv))
    second = [s._replace(advantage=-0.5 * s.advantage) for s in reversed(first)]  # another step, other halves
    return first, second


def rank_worker(rank: int, tmp: str, jobs: dict[str, tuple[str, list[list[Sample]]]]) -> None:
    """One spawned rank runs every model in turn on 2 ranks; then rank 0 alone resumes their checkpoints on a world
    of 1. (One spawn for everything: a rank's start-up, importing torch and transformers, is the slow part.)"""
    torch.set_num_threads(1)  # the ranks share the box's cores
    faulthandler.dump_traceback_later(STALL_S, exit=False)  # a stuck rank shows where it is, then times out
    try:
        with process_group(Path(tmp) / "store-2", rank, WORLD):
            for name, (model_dir, steps) in jobs.items():
                run_rank(rank, Path(tmp) / name, model_dir, CONFIGS[name], steps)
        if rank == 0:
            with process_group(Path(tmp) / "store-1", 0, 1):
                for name, (model_dir, steps) in jobs.items():
                    resume_on_one_rank(Path(tmp) / name, model_dir, CONFIGS[name], steps)
    finally:
        faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def process_group(store: Path, rank: int, world: int) -> Iterator[None]:
    timeout = datetime.timedelta(seconds=STALL_S + 30)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    try:
        yield
    finally:
        gc.collect()  # FSDP state holds reference cycles: free models and meshes before the group goes
        dist.destroy_process_group()


def sharded_policy(model_dir: str, cfg: TrainConfig) -> tuple[PolicyModel, torch.optim.Optimizer]:
    mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    model = shard_policy(load_policy(model_dir), mesh)
    return model, make_optimizer(model, cfg)


def resume_on_one_rank(tmp: Path, model_dir: str, cfg: TrainConfig, steps: list[list[Sample]]) -> None:
    """Load the 2-rank checkpoint into a 1-rank sharded model (DCP reshards) and take step 2 on the whole batch."""
    model, optimizer = sharded_policy(model_dir, cfg)
    load_checkpoint(latest_checkpoint(tmp / "ckpt"), model, optimizer)
    loaded = full_hf_state(model)
    metrics = train_step(model, optimizer, make_batch(steps[1], PAD_ID), cfg, world_size=1)
    torch.save({"loaded": loaded, "after_step2": full_hf_state(model), "metrics": metrics}, tmp / "one_rank.pt")


def run_rank(rank: int, tmp: Path, model_dir: str, cfg: TrainConfig, steps: list[list[Sample]]) -> None:
    """Step 1, checkpoint, restore into a fresh model + optimizer, then step 2 on both; rank 0 writes the params."""
    half = len(steps[0]) // WORLD
    batches = [make_batch(samples[rank * half : (rank + 1) * half], PAD_ID) for samples in steps]
    model, optimizer = sharded_policy(model_dir, cfg)
    metrics = [train_step(model, optimizer, batches[0], cfg, world_size=WORLD)]
    after_step1 = full_hf_state(model)
    save_checkpoint(checkpoint_dir(tmp / "ckpt", 1), model, optimizer, {"version": 1, "rank_count": WORLD})

    restored, restored_optimizer = sharded_policy(model_dir, cfg)
    meta = load_checkpoint(latest_checkpoint(tmp / "ckpt"), restored, restored_optimizer)
    restored_step1 = full_hf_state(restored)
    metrics.append(train_step(model, optimizer, batches[1], cfg, world_size=WORLD))
    restored_metrics = train_step(restored, restored_optimizer, batches[1], cfg, world_size=WORLD)
    after_step2, restored_step2 = full_hf_state(model), full_hf_state(restored)
    result: dict = {"metrics": metrics}
    if rank == 0:
        result["states"] = [after_step1, after_step2]
        result["restore"] = {
            "meta": meta == {"version": 1, "rank_count": WORLD},
            "params_after_load": states_equal(restored_step1, after_step1),
            "params_after_next_step": states_equal(restored_step2, after_step2),
            "metrics_of_next_step": restored_metrics == metrics[1],
        }
    torch.save(result, tmp / f"rank{rank}.pt")


def states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def reference_steps(
    model_dir: Path, cfg: TrainConfig
) -> tuple[dict[str, torch.Tensor], list[list[Sample]], list[dict[str, torch.Tensor]], list[dict[str, float]]]:
    torch.manual_seed(0)
    model = load_policy(model_dir)
    optimizer = make_optimizer(model, cfg)
    initial = full_hf_state(model)
    steps = list(make_samples(model, cfg, seed=1))
    states, metrics = [], []
    for samples in steps:
        metrics.append(train_step(model, optimizer, make_batch(samples, PAD_ID), cfg))
        states.append(full_hf_state(model))
    return initial, steps, states, metrics


@pytest.fixture(scope="module")
def all_runs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Runs]:
    tmp = tmp_path_factory.mktemp("fsdp")
    references, jobs = {}, {}
    for name, cfg in CONFIGS.items():
        references[name] = reference_steps(model_dirs[name], cfg)
        jobs[name] = (str(model_dirs[name]), references[name][1])
        (tmp / name).mkdir()
    mp.spawn(rank_worker, args=(str(tmp), jobs), nprocs=WORLD, join=True)
    runs = {}
    for name, (initial, _, states, metrics) in references.items():
        ranks = [torch.load(tmp / name / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
        runs[name] = Runs(
            initial=initial,
            reference=states,
            reference_metrics=metrics,
            sharded=ranks[0]["states"],
            sharded_metrics=[r["metrics"] for r in ranks],
            restore=ranks[0]["restore"],
            one_rank=torch.load(tmp / name / "one_rank.pt", weights_only=False),
        )
    return runs


@pytest.fixture(params=sorted(CONFIGS))
def runs(request: pytest.FixtureRequest, all_runs: dict[str, Runs]) -> Runs:
    return all_runs[request.param]


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.double().flatten() for _, t in sorted(state.items())])


State = dict[str, torch.Tensor]


def assert_same_step(after: State, expected: State, before: State) -> None:
    """`after` took the step that took `before` to `expected`, up to fp32 summation order (see the tolerances)."""
    assert after.keys() == expected.keys() == before.keys()
    update = flat(expected) - flat(before)
    diff = flat(after) - flat(expected)
    assert update.abs().max() > 0.5 * LR  # AdamW moved weights by ~lr: the step is not trivial
    # Runs differ from the 1-process reference only in the order fp32 gradient terms are summed (loss and grad norm
    # agree to ~1e-6 relative). The split is uneven, so local normalisers would weight the ranks' gradients
    # differently and move the bulk by tens of percent. (A wrong overall gradient scale barely moves AdamW's
    # update; the grad-norm test catches that.)
    assert diff.norm() <= 1e-3 * update.norm()
    # Per weight, Adam's update lr·m/(√v + eps) turns an absolute gradient error ε into up to ~lr·ε/(4·eps): with
    # fp32 sums ε ≈ 1e-9 after clipping, a few % of lr on the ~1e-6 share of weights whose |g| is near eps.
    assert diff.abs().max() <= 0.1 * LR
    assert (diff.abs() > 1e-3 * LR).double().mean() <= 1e-4


@pytest.mark.parametrize("step", [0, 1])
def test_two_rank_step_equals_one_process_step_on_whole_batch(runs: Runs, step: int) -> None:
    before = runs.initial if step == 0 else runs.reference[step - 1]
    assert_same_step(runs.sharded[step], runs.reference[step], before)


@pytest.mark.parametrize("step", [0, 1])
def test_two_rank_loss_and_grad_norm_are_the_whole_batch_values_on_every_rank(runs: Runs, step: int) -> None:
    expected = runs.reference_metrics[step]
    for rank_metrics in runs.sharded_metrics:
        got = rank_metrics[step]
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)  # the norm of the reduced gradient
        assert got["normalizer"] == expected["normalizer"]
    local_tokens = sum(m[step]["tokens"] for m in runs.sharded_metrics)
    assert local_tokens == expected["tokens"]


def test_checkpoint_restores_params_optimizer_and_meta_exactly_across_two_ranks(runs: Runs) -> None:
    assert runs.restore == {
        "meta": True,
        "params_after_load": True,
        "params_after_next_step": True,
        "metrics_of_next_step": True,
    }


def test_two_rank_checkpoint_resumes_on_one_rank_and_steps_like_one_process(runs: Runs) -> None:
    assert states_equal(runs.one_rank["loaded"], runs.sharded[0])
    assert_same_step(runs.one_rank["after_step2"], runs.reference[1], runs.reference[0])
    expected = runs.reference_metrics[1]
    assert runs.one_rank["metrics"]["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert runs.one_rank["metrics"]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
