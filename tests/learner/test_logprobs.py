"""Chunked token logprobs (learner/model.py) against a float64 per-token reference with analytic gradients."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tolerances import abs_products, assert_within, lm_head_logprob_bound, sum_bound

from learner.model import naive_token_logprobs, token_logprobs

T, H, V = 37, 16, 53


def make_inputs(seed: int, dtype: torch.dtype = torch.float32, bias: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    inputs = {
        "hidden": torch.randn(T, H, generator=gen) * 0.8,
        "weight": torch.randn(V, H, generator=gen) * 0.5,
        "targets": torch.randint(0, V, (T,), generator=gen),
        "upstream": torch.randn(T, generator=gen),  # d loss / d logp, so the test checks a full VJP, not a sum
    }
    if bias:
        inputs["bias"] = torch.randn(V, generator=gen)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def reference(inputs: dict[str, torch.Tensor], temperature: float) -> dict[str, torch.Tensor]:
    """Per-token float64 values and gradients: d logp_t / d z_t = (onehot(target_t) − softmax(z_t)) / temperature.

    Also `scale_<key>`: for each gradient entry, Σ|term| of the sum behind it, with |onehot − p| replaced by onehot + p
    (which also bounds |p|, the size of a softmax entry's error): the `scale` its rounding error is proportional to."""
    hidden, weight = inputs["hidden"].double(), inputs["weight"].double()
    bias = inputs["bias"].double() if "bias" in inputs else torch.zeros(V, dtype=torch.float64)
    upstream = inputs["upstream"].double()
    values = torch.zeros(T, dtype=torch.float64)
    grad_hidden, grad_weight, grad_bias = torch.zeros_like(hidden), torch.zeros_like(weight), torch.zeros_like(bias)
    scale_hidden, scale_weight, scale_bias = torch.zeros_like(hidden), torch.zeros_like(weight), torch.zeros_like(bias)
    for t in range(T):
        z = (weight @ hidden[t] + bias) / temperature
        shifted = z - z.max()
        log_norm = shifted.exp().sum().log()
        target = int(inputs["targets"][t])
        values[t] = shifted[target] - log_norm
        p = (shifted - log_norm).exp()
        dz = -p
        dz[target] += 1.0
        dz *= upstream[t] / temperature
        grad_hidden[t] = weight.t() @ dz
        grad_weight += torch.outer(dz, hidden[t])
        grad_bias += dz
        q = p.clone()
        q[target] += 1.0
        q *= upstream[t].abs() / temperature
        scale_hidden[t] = weight.abs().t() @ q
        scale_weight += torch.outer(q, hidden[t].abs())
        scale_bias += q
    return {"values": values, "hidden": grad_hidden, "weight": grad_weight, "bias": grad_bias,
            "scale_hidden": scale_hidden, "scale_weight": scale_weight, "scale_bias": scale_bias}  # fmt: skip


def bounds(inputs: dict[str, torch.Tensor], want: dict[str, torch.Tensor], temperature: float,
           dtype: torch.dtype) -> dict[str, float]:  # fmt: skip
    """Worst-case error of each output computed in `dtype`, against `want` (the float64 reference, whose own error is
    added). A logprob errs by `lm_head_logprob_bound`, a softmax entry p by p times that. A gradient entry sums
    upstream·(onehot − p)/T times a weight row (V terms, for hidden) or a hidden row (T terms, for weight and bias):
    it errs by (logprob error + γ_{n+3})·Σ|term| (+3: onehot − p, × upstream, / T)."""
    out = dict.fromkeys(("values", "hidden", "weight", "bias"), 0.0)
    for d in (dtype, torch.float64):
        lp = lm_head_logprob_bound(d, inputs["hidden"], inputs["weight"], temperature, inputs.get("bias"))
        out["values"] += lp
        for key, n in (("hidden", V), ("weight", T), ("bias", T)):
            out[key] += (lp + sum_bound(d, n + 3, 1.0)) * float(want[f"scale_{key}"].max())
    return out


def run(inputs: dict[str, torch.Tensor], fn: Callable[..., torch.Tensor], **kwargs: object) -> dict[str, torch.Tensor]:
    hidden = inputs["hidden"].clone().requires_grad_(True)
    weight = inputs["weight"].clone().requires_grad_(True)
    bias = inputs["bias"].clone().requires_grad_(True) if "bias" in inputs else None
    values = fn(hidden, weight, inputs["targets"], lm_head_bias=bias, **kwargs)
    (values * inputs["upstream"]).sum().backward()
    out = {"values": values.detach(), "hidden": hidden.grad, "weight": weight.grad}
    if bias is not None:
        out["bias"] = bias.grad
    return out


def assert_matches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bound: dict[str, float],
                   what: str) -> None:  # fmt: skip
    for key, value in got.items():
        assert_within(value, want[key], bound[key], f"{what} {key}")


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("temperature", (0.7, 1.0, 1.6))
@pytest.mark.parametrize("chunk_tokens", (1, 8, 37, 1024))  # 8 does not divide T = 37
def test_chunked_values_and_grads_match_float64_reference(chunk_tokens: int, temperature: float, bias: bool) -> None:
    inputs = make_inputs(seed=chunk_tokens, bias=bias)
    got = run(inputs, token_logprobs, temperature=temperature, chunk_tokens=chunk_tokens)
    assert got["values"].dtype == torch.float32
    want = reference(inputs, temperature)
    assert_matches(got, want, bounds(inputs, want, temperature, torch.float32), "fp32 chunked vs float64")


@pytest.mark.parametrize("chunk_tokens", (5, 64))
def test_float64_inputs_are_computed_in_float64(chunk_tokens: int) -> None:
    inputs = make_inputs(seed=11, dtype=torch.float64, bias=True)
    got = run(inputs, token_logprobs, temperature=0.9, chunk_tokens=chunk_tokens)
    assert got["values"].dtype == torch.float64
    want = reference(inputs, 0.9)
    assert_matches(got, want, bounds(inputs, want, 0.9, torch.float64), "float64 chunked vs float64")


def test_naive_path_matches_float64_reference() -> None:
    inputs = make_inputs(seed=12, bias=True)
    want = reference(inputs, 0.8)
    got = run(inputs, naive_token_logprobs, temperature=0.8)
    assert_matches(got, want, bounds(inputs, want, 0.8, torch.float32), "fp32 naive vs float64")


def test_chunked_gradient_matches_naive_autograd_gradient() -> None:
    # A check of logic (two paths to the same values), so in float64: both err by at most `bounds` (float64).
    inputs = make_inputs(seed=13, dtype=torch.float64)
    chunked = run(inputs, token_logprobs, temperature=1.3, chunk_tokens=6)
    naive = run(inputs, naive_token_logprobs, temperature=1.3)
    bound = bounds(inputs, reference(inputs, 1.3), 1.3, torch.float64)
    assert_matches(chunked, naive, {key: 2 * b for key, b in bound.items()}, "float64 chunked vs naive")


def test_gradcheck_passes_in_float64() -> None:
    gen = torch.Generator().manual_seed(14)
    hidden = torch.randn(7, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 9, (7,), generator=gen)
    assert torch.autograd.gradcheck(
        lambda h, w, b: token_logprobs(h, w, targets, temperature=0.6, chunk_tokens=3, lm_head_bias=b),
        (hidden, weight, bias),
    )


def test_frozen_lm_head_gets_no_gradient() -> None:
    inputs = make_inputs(seed=15)
    hidden = inputs["hidden"].clone().requires_grad_(True)
    token_logprobs(hidden, inputs["weight"], inputs["targets"], chunk_tokens=4).sum().backward()
    assert hidden.grad is not None and inputs["weight"].grad is None


def test_bfloat16_inputs_give_float32_logprobs_close_to_float32_path() -> None:
    inputs = make_inputs(seed=16)
    bf16 = token_logprobs(inputs["hidden"].bfloat16(), inputs["weight"].bfloat16(), inputs["targets"], chunk_tokens=8)
    assert bf16.dtype == torch.float32
    fp32 = token_logprobs(inputs["hidden"], inputs["weight"], inputs["targets"])
    # Rounding h and W to bf16 moves each product h_i·w_i by up to 2u·|h_i·w_i| (u = 2^-8), and the bf16 matmul's
    # output rounds the logit by u·|z| <= u·Σ|h_i·w_i|: 3u·max(|h|·|w|) per logit, twice that per logprob (see
    # lm_head_logprob_bound), plus both paths' fp32 arithmetic. A wrong target or a missing term moves it by O(1).
    h, w = inputs["hidden"], inputs["weight"]
    bf16_rounding = 2 * sum_bound(torch.bfloat16, 3, float(abs_products(h, w).max()))
    assert_within(bf16, fp32, bf16_rounding + 2 * lm_head_logprob_bound(torch.float32, h, w, 1.0), "bf16 vs fp32")


def test_zero_tokens_give_empty_result() -> None:
    out = token_logprobs(torch.zeros(0, H), torch.zeros(V, H), torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.0}, "temperature is 0.0"),
        ({"chunk_tokens": 0}, "chunk_tokens is 0"),
        ({"hidden": torch.zeros(T, H + 1)}, "same H"),
        ({"hidden": torch.zeros(T, H, dtype=torch.float64)}, "hidden dtype"),
        ({"targets": torch.zeros(T, dtype=torch.int32)}, "targets has dtype"),
        ({"targets": torch.zeros(T - 1, dtype=torch.int64)}, "one target per hidden row"),
        ({"lm_head_bias": torch.zeros(V - 1)}, "lm_head_bias has shape"),
    ],
)
def test_bad_inputs_raise_with_the_offending_value(kwargs: dict[str, object], message: str) -> None:
    args = {"hidden": torch.zeros(T, H), "lm_head_weight": torch.zeros(V, H), "targets": torch.zeros(T).long()}
    with pytest.raises(ValueError, match=message):
        token_logprobs(**(args | kwargs))
