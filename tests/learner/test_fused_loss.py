"""The fused LM-head + policy loss (learner/fused_loss.py) against a float64 reference, forward and backward.

The reference is the unfused path in float64: `naive_token_logprobs` (full logits) then `policy_loss`, differentiated
by autograd. The same tests run the torch row pass on CPU and the Triton kernel on CUDA (skipped without CUDA; run by
scripts/gpu_check.sh on a GPU machine). Inputs are fresh random bf16 tensors (the seed is in each failure message);
tolerances are bf16's: the logits come out of a bf16 matmul, as the model's own LM head does. Each is derived from
where that rounding enters (see `logprob_tolerance` and `check`), never read off one machine.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tolerances import (
    assert_within,
    check_within,
    float64_bound,
    lm_head_logprob_bounds,
    policy_loss_bound,
    sum_bound,
    unit_roundoff,
)

from inflight.wire.contract import SamplingKnobs
from learner.fused_loss import _params, _torch_row_pass, aggregation_weights, fused_policy_loss, triton_available
from learner.losses import LOSS_KINDS, LossConfig, policy_loss
from learner.model import naive_token_logprobs, token_logprobs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
# (tokens, hidden, vocab, chunk): vocabularies off the kernel's 4096 tile, chunks that split the tokens unevenly
SIZES = [(37, 64, 1000, 2048), (300, 128, 5003, 128), (1031, 96, 4099, 256)]
CUDA_SIZES = [(4096, 896, 49152, 1024), (2048, 1024, 151936, 512)]
CONFIGS = [LossConfig("tis"), LossConfig("ppo"), LossConfig("mask"), LossConfig("tis", aggregation="sequence"),
           LossConfig("ppo", aggregation="sequence")]  # fmt: skip


# the default trust-region edges as log-ratios: tis cap 2, ppo clip 0.8 / 1.28, mask band 0.5 / 2
EDGES = torch.tensor([2.0, 0.8, 1.28, 0.5], dtype=torch.float64).log()


def logprob_tolerance(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per token: how far the fused path's logprob may be from the float64 one computed from the same `h` and `w`.

    The matmul rounds each logit z_v to h's dtype (u·|z_v|; u = 2^-8 for bf16) after summing H products in fp32: the
    logprob z_t − LSE(z) moves by the target's rounding plus at most the largest one (LSE is 1-Lipschitz), so by
    u·(|z_t| + max|z|)/T, plus the fp32 arithmetic's own `lm_head_logprob_bounds`."""
    u = unit_roundoff(h.dtype)
    h, w = h.detach().double().cpu(), w.detach().double().cpu()
    with torch.no_grad():
        z = h @ w.t()
        z_target, z_max = z.gather(1, targets.cpu()[:, None]).squeeze(1).abs(), z.abs().amax(1)
        del z
        acc = torch.promote_types(h.dtype, torch.float32)
        return u * (z_target + z_max) / temperature + lm_head_logprob_bounds(acc, h, w, temperature)


def make_batch(tokens: int, hidden: int, vocab: int, seed: int, device: str, dtype=torch.bfloat16,
               temperature: float = 1.0) -> dict:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) / hidden**0.5 * 2  # logits of a few units, as a real LM head's
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    with torch.no_grad():
        exact = naive_token_logprobs(h.to(dtype).double(), w.to(dtype).double(), targets, temperature)
    # Log-ratios spread across every trust region, but farther from each edge than the token's logprob may move
    # (logprob_tolerance, plus the fp32 rounding of the behaviour logprob and of the ratio): a ratio that crossed an
    # edge would change its token's loss and gradient discontinuously. So no ratio can cross, and the trust-region
    # decisions (clip_fraction) are exactly the reference's.
    margin = logprob_tolerance(h.to(dtype), w.to(dtype), targets, temperature)
    margin += sum_bound(torch.float32, 4, 1.0) * (exact.abs() + 2)
    log_ratio = 0.5 * torch.randn(tokens, generator=gen, dtype=torch.float64)
    for edge in EDGES:
        near = (log_ratio - edge).abs() < margin
        log_ratio[near] = edge + margin[near] * torch.sign(log_ratio[near] - edge + 1e-12)
    behaviour = (exact - log_ratio).float()
    mask = torch.rand(tokens, generator=gen) > 0.15
    behaviour[~mask] = float("-inf")  # a masked token may hold anything: it must never reach an exp
    return {
        "hidden": h.to(dtype).to(device), "weight": w.to(dtype).to(device), "targets": targets.to(device),
        "behaviour": behaviour.to(device), "advantages": torch.randn(tokens, generator=gen).to(device),
        "mask": mask.to(device), "seq_ids": (torch.arange(tokens) // 13).to(device),
    }  # fmt: skip


def reference(b: dict, cfg: LossConfig, temperature: float) -> dict:
    h = b["hidden"].double().cpu().requires_grad_()
    w = b["weight"].double().cpu().requires_grad_()
    logp = naive_token_logprobs(h, w, b["targets"].cpu(), temperature)
    logp.retain_grad()
    loss, metrics = policy_loss(logp, b["behaviour"].double().cpu(), b["advantages"].double().cpu(), b["mask"].cpu(),
                                b["seq_ids"].cpu(), cfg)  # fmt: skip
    loss.backward()
    return {"loss": loss.detach(), "logp": logp.detach(), "dloss_dlogp": logp.grad, "grad_hidden": h.grad,
            "grad_weight": w.grad, "logp_tol": logprob_tolerance(b["hidden"], b["weight"], b["targets"], temperature),
            **metrics}  # fmt: skip


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.double()
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def gradient_bounds(b: dict, dloss_dlogp: torch.Tensor, err: torch.Tensor,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Entry-by-entry error bounds of the hidden and weight gradients, given each token's logprob error `err`.

    A gradient is Σ dz·W (hidden) or Σ dzᵀ·h (weight) with dz_tv = c_t·(onehot − p_tv)/T, c_t = d loss / d logp_t.
    c_t errs by expm1(err_t) relative (it is A·ratio, and the ratio is exp of the logprob); p_tv = exp(z_v/T − LSE)
    by expm1(ρ_tv), ρ_tv = u·(|z_v| + max|z|)/T + the fp32 logprob bound (as in `logprob_tolerance`); dz is rounded to
    h's dtype before the matmul and each chunk's product after it (2u), whose fp32 sums add γ_n. So the error is at
    most Q·|W| resp. Qᵀ·|h|, Q_tv = |c_t|/T·[(onehot + p_tv)·(expm1(err_t) + 2u + γ_n) + p_tv·expm1(ρ_tv)]."""
    u = unit_roundoff(b["hidden"].dtype)
    acc = torch.promote_types(b["hidden"].dtype, torch.float32)
    h, w, targets = b["hidden"].double().cpu(), b["weight"].double().cpu(), b["targets"].cpu()
    with torch.no_grad():
        z = h @ w.t()
        p = torch.softmax(z / temperature, dim=-1)
        rho = u * (z.abs() + z.abs().amax(1, keepdim=True)) / temperature
        rho += lm_head_logprob_bounds(acc, h, w, temperature)[:, None]
        del z
        a = (torch.expm1(err) + 2 * u + sum_bound(acc, max(h.shape[0], w.shape[0]) + 3, 1.0))[:, None]
        q = p.mul_(a + torch.expm1(rho)).scatter_add_(1, targets[:, None], a)  # in place: [T, V] float64 is large
        del rho
        q *= dloss_dlogp.double().cpu().abs()[:, None] / temperature
        return q @ w.abs(), q.t() @ h.abs()


def loss_bound(b: dict, cfg: LossConfig, logp: torch.Tensor, err: torch.Tensor, normalizer: float | None = None,
               dtype: torch.dtype = torch.float32) -> float:  # fmt: skip
    """`policy_loss_bound` for this batch: the loss moves with its logprobs (`logp`, each off by up to `err`)."""
    weights = aggregation_weights(b["mask"].cpu(), b["seq_ids"].cpu(), cfg.aggregation, normalizer)
    return policy_loss_bound(logp, b["behaviour"], b["advantages"], weights, err, dtype)


def check(b: dict, cfg: LossConfig, temperature: float, chunk: int, backend: str, seed: int) -> None:
    want = reference(b, cfg, temperature)
    h, w = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
    loss, logp, metrics = fused_policy_loss(h, w, b["targets"], b["behaviour"], b["advantages"], b["mask"],
                                            b["seq_ids"], cfg, temperature, chunk_tokens=chunk,
                                            backend=backend)  # fmt: skip
    loss.backward()
    where = f"seed {seed}, {cfg}, T={temperature}, backend {backend}"
    mask = b["mask"].cpu()
    err = torch.where(mask, (logp.detach().cpu().double() - want["logp"]).abs(), 0.0)
    worst = int((err / want["logp_tol"]).argmax())
    check_within(err[worst], want["logp_tol"][worst], f"logprob ({where})")
    check_within(abs(float(loss.detach()) - float(want["loss"])), loss_bound(b, cfg, want["logp"], err),
                 f"loss ({where})")  # fmt: skip
    # Gradients: in norm, the entry bounds of `gradient_bounds` plus u of the result (its final rounding to bf16).
    u = unit_roundoff(h.dtype)
    bound_h, bound_w = gradient_bounds(b, want["dloss_dlogp"], err, temperature)
    for name, got, bound in (("hidden", h.grad, bound_h), ("weight", w.grad, bound_w)):
        key = f"grad_{name}"
        relative_bound = float(bound.norm() / want[key].norm()) + u
        check_within(rel_err(got, want[key]), relative_bound, f"{name} gradient ({where})")
    assert h.grad.dtype == h.dtype and w.grad.dtype == w.dtype
    assert metrics["tokens"] == want["tokens"], where
    # No ratio can cross a trust-region edge (make_batch keeps them farther than the logprob may move): exact.
    assert metrics["clip_fraction"] == want["clip_fraction"], where
    # Each ratio is off by a factor e^±δ, δ = err + the fp32 rounding of the log ratio: ess ((Σr)²/(n·Σr²)) by e^±4δ.
    log_ratio = want["logp"] - b["behaviour"].double().cpu()
    delta = float((err + sum_bound(torch.float32, 1, 1.0) * log_ratio.abs())[mask].max())
    ess_bound = want["ess"] * float(torch.expm1(torch.tensor(4 * delta))) + float64_bound(2 * len(err) + 4, 1.0)
    check_within(abs(metrics["ess"] - want["ess"]), ess_bound, f"ess ({where})")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.kind}-{c.aggregation}")
def test_fused_loss_matches_the_float64_reference_forward_and_backward(device, size, cfg):
    seed = random.randrange(2**31)
    tokens, hidden, vocab, chunk = size
    temperature = random.choice([1.0, 0.7])
    backend = "torch" if device == "cpu" else "triton"
    check(make_batch(tokens, hidden, vocab, seed, device, temperature=temperature), cfg, temperature, chunk, backend,
          seed)  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("size", CUDA_SIZES, ids=lambda s: "x".join(map(str, s)))
def test_triton_kernel_matches_the_float64_reference_at_real_vocabularies(size):
    seed = random.randrange(2**31)
    tokens, hidden, vocab, chunk = size
    check(make_batch(tokens, hidden, vocab, seed, "cuda"), LossConfig("tis"), 1.0, chunk, "triton", seed)


def interpret_row_kernel(
    inputs: dict[str, torch.Tensor], temperature: float, tmp_path: Path
) -> dict[str, torch.Tensor]:
    """learner/triton_kernels.py:row_pass on `inputs`, run by Triton's interpreter in a fresh process
    (tests/learner/interpret_row_kernel.py), for every loss kind: `{kind}.logp`, `.loss`, `.hit`, `.grad`."""
    source, target = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(inputs, source)
    script = Path(__file__).with_name("interpret_row_kernel.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([sys.executable, str(script), str(source), str(target), str(temperature)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return load_file(target)


# Where a GPU runs the compiled kernel (the test above) the interpreter adds nothing, and on the lent H200 (Triton 3.6
# with numpy 2.5) the interpreter itself breaks: it calls int() on a one-element array, which numpy 2.5 refuses.
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA: the compiled kernel is tested instead")
def test_the_triton_row_kernel_interpreted_on_cpu_matches_the_float64_row_pass(tmp_path: Path):
    """The Triton kernel's own code, run by Triton's interpreter on CPU tensors (so it is checked where no GPU is):
    the online log-normaliser over three 4096-wide tiles (the last partial), every loss kind, the trust-region hits
    and the bf16 logit gradient, against the torch row pass in float64 on the same bf16 logits."""
    pytest.importorskip("triton")
    seed, temperature, tokens, vocab = random.randrange(2**31), 0.7, 48, 9001
    b = make_batch(tokens, 64, vocab, seed, "cpu", temperature=temperature)  # log-ratios clear of every edge
    weight = aggregation_weights(b["mask"], b["seq_ids"], "token").float()  # 0 where masked
    logits = b["hidden"] @ b["weight"].t()  # bf16, as the model's LM head gives them
    inputs = {"logits": logits, "targets": b["targets"], "behaviour": b["behaviour"], "adv": b["advantages"]}
    got = interpret_row_kernel({**inputs, "weight": weight}, temperature, tmp_path)
    u, x = unit_roundoff(torch.float32), logits.double() / temperature
    for kind in LOSS_KINDS:
        want = {"logp": torch.empty(tokens, dtype=torch.float64), "loss": torch.empty(tokens, dtype=torch.float64)}
        hit, grad = torch.empty(tokens, dtype=torch.bool), logits.double()
        p1, p2 = _params(LossConfig(kind))
        _torch_row_pass(grad, b["targets"], b["behaviour"], b["advantages"], weight, want["logp"], want["loss"], hit,
                        temperature, kind, p1, p2, True)  # fmt: skip
        where = f"{kind}, seed {seed}"
        # fp32: z · fp32(1/T) rounds twice (2u|x|, each x within max|x|), so x_v − LSE moves by twice that (LSE is
        # 1-Lipschitz) plus γ of LSE's V-term sum and its exp and log, plus the subtraction's own rounding.
        lp_tol = 4 * u * x.abs().amax(1) + sum_bound(torch.float32, vocab + 4, 1.0) + u * want["logp"].abs()
        assert_within(got[f"{kind}.logp"], want["logp"], lp_tol, f"logp ({where})")
        assert torch.equal(got[f"{kind}.hit"].bool(), hit), f"trust-region hits ({where})"
        loss_bound = policy_loss_bound(want["logp"], b["behaviour"], b["advantages"], weight, lp_tol, torch.float32)
        check_within(abs(float(got[f"{kind}.loss"].double().sum() - want["loss"].sum())), loss_bound, f"loss ({where})")
        # The logit gradient g·(onehot − p), |g| <= w·|A|·r/T for every kind: g is off by the ratio's error (the
        # logprob's, plus the log-ratio's rounding) and a few roundings, p by p·expm1(lp_tol); then bf16 storage.
        log_ratio = torch.where(b["mask"], want["logp"] - b["behaviour"].double(), 0.0)
        g_max = weight.double() * b["advantages"].double().abs() * log_ratio.exp() / temperature
        ratio_tol = torch.expm1(lp_tol + u * log_ratio.abs()) + 4 * u
        grad_tol = g_max * (ratio_tol + torch.expm1(lp_tol) + 8 * u)
        bf16 = unit_roundoff(torch.bfloat16)
        assert_within(got[f"{kind}.grad"], grad, grad_tol[:, None] + 2 * bf16 * grad.abs(), f"logit gradient ({where})")


def test_float64_inputs_give_the_unfused_path_to_rounding():
    """In float64 the fused path and `token_logprobs` + `policy_loss` are the same arithmetic: agreement to float64
    rounding (~1e-12 here) checks the per-kind gradient formulas themselves, which bf16 tolerances could hide."""
    seed = random.randrange(2**31)
    for cfg in CONFIGS:
        b = make_batch(200, 32, 777, seed, "cpu", dtype=torch.float64)
        h1, w1 = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
        logp = token_logprobs(h1, w1, b["targets"], 0.9, chunk_tokens=64)
        logp.retain_grad()
        loss1, _ = policy_loss(logp, b["behaviour"].double(), b["advantages"].double(), b["mask"], b["seq_ids"], cfg,
                               normalizer=50.0)  # fmt: skip
        loss1.backward()
        h2, w2 = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
        loss2, _, _ = fused_policy_loss(h2, w2, b["targets"], b["behaviour"].double(), b["advantages"].double(),
                                        b["mask"], b["seq_ids"], cfg, 0.9, normalizer=50.0, chunk_tokens=48,
                                        backend="torch")  # fmt: skip
        (3.0 * loss2).backward()  # backward scales the gradient finished in forward by the incoming gradient
        where = f"seed {seed}, {cfg}"
        # Both paths err as the bf16 check's bounds say, with float64's u: each logprob by logprob_tolerance, so the
        # two differ by twice that, and each loss and gradient by its bound for that error.
        tol = logprob_tolerance(b["hidden"], b["weight"], b["targets"], 0.9)
        exact = logp.detach()
        check_within(
            abs(float(loss2.detach() - loss1.detach())), 2 * loss_bound(b, cfg, exact, tol, 50.0, torch.float64), where
        )
        bound_h, bound_w = gradient_bounds(b, logp.grad, tol, 0.9)
        assert_within(h2.grad, 3.0 * h1.grad, 2 * 3.0 * bound_h, f"hidden gradient ({where})")
        assert_within(w2.grad, 3.0 * w1.grad, 2 * 3.0 * bound_w, f"weight gradient ({where})")


def test_aggregation_weights_reproduce_policy_loss_aggregation():
    gen = torch.Generator().manual_seed(0)
    per_token = torch.randn(50, generator=gen, dtype=torch.float64)
    mask = torch.rand(50, generator=gen) > 0.3
    mask[10:20] = False  # a fully masked sequence: it counts in neither numerator nor denominator
    seq_ids = torch.arange(50) // 10
    for aggregation, normalizer in (("token", None), ("token", 7.0), ("sequence", None), ("sequence", 3.0)):
        w = aggregation_weights(mask, seq_ids, aggregation, normalizer).double()
        if aggregation == "token":
            want = per_token[mask].sum() / (mask.sum() if normalizer is None else normalizer)
        else:
            means = [per_token[(seq_ids == s) & mask].mean() for s in range(5) if ((seq_ids == s) & mask).any()]
            want = sum(means) / (len(means) if normalizer is None else normalizer)
        assert torch.allclose((w * per_token).sum(), torch.as_tensor(want, dtype=torch.float64)), aggregation


def test_bad_inputs_name_the_field_and_the_fix():
    b = make_batch(10, 8, 20, 0, "cpu")
    args = [b["hidden"], b["weight"], b["targets"], b["behaviour"], b["advantages"], b["mask"], b["seq_ids"],
            LossConfig()]  # fmt: skip
    with pytest.raises(ValueError, match="advantages has shape"):
        fused_policy_loss(*args[:4], b["advantages"][:5], *args[5:])
    with pytest.raises(ValueError, match="backend is 'cuda'"):
        fused_policy_loss(*args, backend="cuda")
    if not triton_available():
        with pytest.raises(ValueError, match="backend='torch'"):
            fused_policy_loss(*args, backend="triton")


def tiny_cuda_policy(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    from learner.model import PolicyModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4099, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    return PolicyModel(LlamaForCausalLM(config)).cuda().eval()


def cuda_samples(seed: int):
    from learner.step import Sample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(6):
        prompt = torch.randint(1, 4099, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen).tolist()
        n = int(torch.randint(5, 40, (1,), generator=gen))
        out.append(Sample(prompt, torch.randint(1, 4099, (n,), generator=gen).tolist(),
                          (-8.3 + 0.3 * torch.randn(n, generator=gen)).tolist(), float(i % 3) - 1.0,
                          (torch.rand(n, generator=gen) > 0.1).tolist()))  # fmt: skip
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fsdp2"])
def test_cuda_train_step_with_the_triton_kernel_takes_the_unfused_step(sharded, tmp_path):
    """On CUDA `fused_loss='auto'` runs the Triton kernel inside PolicyModel's root forward (under FSDP2 too: the
    LM head is unsharded there) and takes the same AdamW step as logprobs + `policy_loss`."""
    import copy

    import torch.distributed as dist

    from learner.model import shard_policy
    from learner.step import TrainConfig, make_batch, make_optimizer, train_step

    if sharded and not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        base = tiny_cuda_policy(tied=True)
        batch = make_batch(cuda_samples(1), 0).to("cuda")  # Batch.to: optional fields (routes) stay None
        results = []
        for fused in ("off", "auto"):
            model = copy.deepcopy(base)
            if sharded:
                model = shard_policy(model, dist.device_mesh.init_device_mesh("cuda", (1,)))
            cfg = TrainConfig(lr=1e-3, sampling=SamplingKnobs(temperature=0.9), fused_loss=fused, chunk_tokens=64)
            metrics = train_step(model, make_optimizer(model, cfg), batch, cfg)
            params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                      for p in model.parameters()]  # fmt: skip
            results.append((metrics, params))
        (off, off_params), (on, on_params) = results
        assert {k: on[k] for k in off} == pytest.approx(off, rel=1e-4, abs=1e-6)
        for a, b in zip(off_params, on_params, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
    finally:
        if sharded and dist.is_initialized():
            dist.destroy_process_group()
