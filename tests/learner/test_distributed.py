"""FSDP2 data parallelism on CPU (gloo): a 2-rank step equals a 1-process step on the whole batch, and a sharded
checkpoint restores params and optimizer exactly, on 2 ranks and resharded onto 1 (learner/model.py, export.py,
step.py, checkpoint.py).

One module fixture runs everything once: a 1-process reference in the test process, then one spawn of 2 ranks
(file:// rendezvous, results through files, see docs/ARCHITECTURE.md "Testing distributed code on CPU") that runs both
models in turn, after which rank 0 alone joins a world of 1 to resume the checkpoints. The batch is split unevenly (the
long sequences and the fully masked one on rank 0), so only a global loss normaliser makes the runs agree.

Everything runs in float64: the runs check logic (2 ranks = 1 process), and in float64 they differ only by rounding
bounds derived from the arithmetic (`StepBounds`), far below what a wrong normaliser moves.
"""

from __future__ import annotations

import faulthandler
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawn_support import process_group
from tolerances import assert_within, check_within, float64_bound, logprob_gradient_bound, policy_loss_bound

from inflight.wire.contract import SamplingKnobs
from learner.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from learner.export import full_hf_state, iter_full_pieces
from learner.fused_loss import aggregation_weights
from learner.losses import LossConfig
from learner.model import PolicyModel, load_policy, shard_policy
from learner.step import Sample, TrainConfig, make_batch, make_optimizer, train_step

WORLD = 2
DTYPE = torch.float64  # see the module docstring
STALL_S = 150  # a rank still running after this long is stuck (the whole spawn takes ~20 s)
LR = 1e-4
PAD_ID = 0
PROMPT_LENS, COMPLETION_LENS = (5, 3, 4, 2), (9, 7, 3, 2)  # rank 0: the 2 long samples, rank 1: 2 short ones
CONFIGS = {  # each model covers one aggregation, so both global normalisers are exercised
    "tiny-qwen2": TrainConfig(
        lr=LR, sampling=SamplingKnobs(temperature=0.7), loss=LossConfig(kind="ppo", aggregation="token")
    ),
    "tiny-llama": TrainConfig(
        lr=LR, sampling=SamplingKnobs(temperature=1.0), loss=LossConfig(kind="tis", aggregation="sequence")
    ),
}


@dataclass
class StepBounds:
    """How far a float64 run of a step may be from the 1-process reference's: per weight, and for loss and grad_norm."""

    weights: dict[str, torch.Tensor]
    metrics: dict[str, float]


@dataclass
class Runs:
    initial: dict[str, torch.Tensor]
    reference: list[dict[str, torch.Tensor]]  # 1 process, whole batch: params after step 1 and step 2
    reference_metrics: list[dict[str, float]]
    bounds: list[StepBounds]  # after step 1 and step 2
    sharded: list[dict[str, torch.Tensor]]  # 2 ranks, gathered full params after step 1 and step 2
    sharded_metrics: list[list[dict[str, float]]]  # [rank][step]
    restore: dict[str, bool]
    one_rank: dict  # the 2-rank checkpoint resumed on 1 rank: loaded params, params and metrics after step 2
    pieces: dict  # rank 0's iter_full_pieces after step 2: count, assembled tensors, full_hf_state


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
        logp = model(batch.input_ids, batch.targets, cfg.sampling.temperature).logp
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
        with process_group(Path(tmp) / "store-2", rank, WORLD, STALL_S + 30):
            for name, (model_dir, steps) in jobs.items():
                run_rank(rank, Path(tmp) / name, model_dir, CONFIGS[name], steps)
        if rank == 0:
            with process_group(Path(tmp) / "store-1", 0, 1, STALL_S + 30):
                for name, (model_dir, steps) in jobs.items():
                    resume_on_one_rank(Path(tmp) / name, model_dir, CONFIGS[name], steps)
    finally:
        faulthandler.cancel_dump_traceback_later()


def sharded_policy(model_dir: str, cfg: TrainConfig) -> tuple[PolicyModel, torch.optim.Optimizer]:
    mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    model = shard_policy(load_policy(model_dir, dtype=DTYPE), mesh)
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
    pieces = list(iter_full_pieces(model, max_piece_bytes=1 << 12))  # 4 KiB blocks: every big tensor in many
    result: dict = {"metrics": metrics}
    if rank == 0:
        result["states"] = [after_step1, after_step2]
        result["restore"] = {
            "meta": meta == {"version": 1, "rank_count": WORLD},
            "params_after_load": states_equal(restored_step1, after_step1),
            "params_after_next_step": states_equal(restored_step2, after_step2),
            "metrics_of_next_step": restored_metrics == metrics[1],
        }
        result["pieces"] = {"count": len(pieces), "assembled": assembled(pieces), "full": after_step2}
    torch.save(result, tmp / f"rank{rank}.pt")


def assembled(pieces) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, shape, start, rows in pieces:
        whole = out.setdefault(name, torch.empty(shape, dtype=rows.dtype))
        if rows.shape == shape:
            whole.copy_(rows)
        else:
            whole[start : start + rows.shape[0]].copy_(rows)
    return out


def states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def reference_steps(
    model_dir: Path, cfg: TrainConfig
) -> tuple[dict[str, torch.Tensor], list[list[Sample]], list[dict[str, torch.Tensor]], list[dict[str, float]], list]:
    torch.manual_seed(0)
    model = load_policy(model_dir, dtype=DTYPE)
    optimizer = make_optimizer(model, cfg)
    initial = full_hf_state(model)
    steps = list(make_samples(model, cfg, seed=1))
    states, metrics, bounds, adam, moments = [], [], [], [], {}
    for samples in steps:
        batch = make_batch(samples, PAD_ID)
        metric_bounds, relative = step_error(model, batch, cfg)
        metrics.append(train_step(model, optimizer, batch, cfg))
        states.append(full_hf_state(model))
        metric_bounds["grad_norm"] = 2 * relative * metrics[-1]["grad_norm"] + float64_bound(
            sum(p.numel() for p in model.parameters()), metrics[-1]["grad_norm"]
        )
        adam.append(adam_sizes(model, optimizer, cfg, len(states), moments))
        bounds.append(StepBounds(weight_bounds(adam, relative, cfg, states[-1]), metric_bounds))
    return initial, steps, states, metrics, bounds


def step_error(model: PolicyModel, batch, cfg: TrainConfig) -> tuple[dict[str, float], float]:
    """The loss bound of a run of this step against the reference (each logprob off by up to twice the LM head's
    float64 bound, `policy_loss_bound`; the ranks' partial losses summed once more), and δ: a gradient entry's error
    relative to the largest (`logprob_gradient_bound` with scale 1)."""
    with torch.no_grad():
        hidden = model.hf.model(input_ids=batch.input_ids).last_hidden_state[batch.mask]
        logp = model(batch.input_ids, batch.targets, cfg.sampling.temperature).logp.flatten()
    lm_head = model.hf.lm_head.weight
    relative = logprob_gradient_bound(torch.float64, hidden, lm_head, cfg.sampling.temperature, 1.0)
    mask = batch.mask.flatten()
    weights = aggregation_weights(mask, batch.seq_ids.flatten(), cfg.loss.aggregation)
    loss = policy_loss_bound(logp, batch.behaviour_logp.flatten(), batch.advantages.flatten(), weights,
                             2 * relative, torch.float64)  # fmt: skip
    return {"loss": loss}, relative


def adam_sizes(model: PolicyModel, optimizer: torch.optim.Optimizer, cfg: TrainConfig, step: int,
               previous: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Per weight after AdamW step `step`: √v̂ (the bias-corrected second moment's root) and the clipped gradient
    g = (m_t − β1·m_{t−1}) / (1 − β1), read back from the optimizer's moments (`previous`: m_{t−1}, updated)."""
    beta1, beta2 = cfg.betas
    out = {}
    for name, p in model.named_parameters():
        name, state = name.removeprefix("hf."), optimizer.state[p]
        m = state["exp_avg"].clone()
        grad = (m - beta1 * previous.get(name, torch.zeros_like(m))) / (1 - beta1)
        previous[name] = m
        out[name] = ((state["exp_avg_sq"] / (1 - beta2**step)).sqrt(), grad)
    return out


def weight_bounds(adam: list[dict], relative: float, cfg: TrainConfig, state: dict[str, torch.Tensor]) -> dict:
    """Per weight, how far a run's weights after these AdamW steps may be from the reference's.

    A run's clipped gradient entry errs by ε = 2·δ·max|g| (δ: `step_error`; ×2: both runs err), twice that with the
    clip factor's own error. Step t moves a weight by lr·m̂/(√v̂ + eps), m̂ and √v̂ weighted means (of g, of g²) with
    weights summing to 1, so each moves by at most ε, and |m̂| <= 1.002·√v̂ for t <= 2: the step moves by at most
    3·lr·ε/(max(√v̂ − ε, 0) + eps). That is lr·ε/eps where √v̂ ≈ 0 (Adam magnifies errors in near-zero gradients) and
    ~0 where |g| >> eps. Each step's update adds a few float64 roundings of |weight| + lr."""
    epsilon = 4 * relative * max(float(g.abs().max()) for step in adam for _, g in step.values())
    bounds = {}
    for name, weight in state.items():
        total = sum(3 * cfg.lr * epsilon / ((step[name][0] - epsilon).clamp(min=0) + cfg.eps) for step in adam)
        bounds[name] = total + len(adam) * float64_bound(3, float(weight.abs().max()) + cfg.lr)
    return bounds


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
    for name, (initial, _, states, metrics, bounds) in references.items():
        ranks = [torch.load(tmp / name / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
        runs[name] = Runs(
            initial=initial,
            reference=states,
            reference_metrics=metrics,
            bounds=bounds,
            sharded=ranks[0]["states"],
            sharded_metrics=[r["metrics"] for r in ranks],
            restore=ranks[0]["restore"],
            one_rank=torch.load(tmp / name / "one_rank.pt", weights_only=False),
            pieces=ranks[0]["pieces"],
        )
    return runs


@pytest.fixture(params=sorted(CONFIGS))
def runs(request: pytest.FixtureRequest, all_runs: dict[str, Runs]) -> Runs:
    return all_runs[request.param]


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.double().flatten() for _, t in sorted(state.items())])


State = dict[str, torch.Tensor]


def assert_same_step(after: State, expected: State, before: State, bounds: StepBounds) -> None:
    """`after` took the step that took `before` to `expected`, up to float64 rounding (`weight_bounds`)."""
    assert after.keys() == expected.keys() == before.keys()
    update = flat(expected) - flat(before)
    assert update.abs().max() > 0.5 * LR  # AdamW moved weights by ~lr: the step is not trivial
    # Runs differ from the 1-process reference only in the order gradient terms are summed. The split is uneven, so
    # local normalisers would weight the ranks' gradients differently and move the bulk by tens of percent of lr,
    # far above these bounds (~1e-10·lr where |g| >> eps, at most ~1e-2·lr where g ≈ 0). (A wrong overall
    # gradient scale barely moves AdamW's update; the grad-norm test catches that.)
    for name in sorted(expected):
        assert_within(after[name], expected[name], bounds.weights[name], name)


@pytest.mark.parametrize("step", [0, 1])
def test_two_rank_step_equals_one_process_step_on_whole_batch(runs: Runs, step: int) -> None:
    before = runs.initial if step == 0 else runs.reference[step - 1]
    assert_same_step(runs.sharded[step], runs.reference[step], before, runs.bounds[step])


@pytest.mark.parametrize("step", [0, 1])
def test_two_rank_loss_and_grad_norm_are_the_whole_batch_values_on_every_rank(runs: Runs, step: int) -> None:
    expected, bounds = runs.reference_metrics[step], runs.bounds[step].metrics
    for rank_metrics in runs.sharded_metrics:
        got = rank_metrics[step]
        check_within(abs(got["loss"] - expected["loss"]), bounds["loss"], "loss")
        # the norm of the reduced gradient
        check_within(abs(got["grad_norm"] - expected["grad_norm"]), bounds["grad_norm"], "grad_norm")
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
    assert_same_step(runs.one_rank["after_step2"], runs.reference[1], runs.reference[0], runs.bounds[1])
    expected, bounds = runs.reference_metrics[1], runs.bounds[1].metrics
    check_within(abs(runs.one_rank["metrics"]["loss"] - expected["loss"]), bounds["loss"], "loss")
    check_within(abs(runs.one_rank["metrics"]["grad_norm"] - expected["grad_norm"]), bounds["grad_norm"], "grad_norm")


def test_rank0_receives_the_full_tensors_piece_by_piece_bitwise_without_gathering_them(runs: Runs) -> None:
    """learner/export.py:iter_full_pieces, what the streamed publish reads: every tensor of full_hf_state, assembled on
    rank 0 from its own rows and the other rank's, sent in blocks of at most 4 KiB — bit for bit."""
    pieces = runs.pieces
    assert pieces["assembled"].keys() == pieces["full"].keys()
    assert pieces["count"] > 2 * len(pieces["full"]), "the big tensors must have come in several blocks"
    for name, tensor in pieces["full"].items():
        assert torch.equal(pieces["assembled"][name], tensor), name
