"""PolicyModel (learner/model.py) against transformers' own full logits in float64; the HF-named state that
learner/export.py makes of it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tolerances import assert_within, lm_head_logprob_bound, logprob_gradient_bound

from learner.export import checkpoint_tensor_names, full_hf_state
from learner.model import PolicyModel, load_policy

MODELS = ("tiny-llama", "tiny-qwen2")
LENGTHS = (11, 4, 8)  # right-padded rows of different lengths


@pytest.fixture(scope="module", params=MODELS)
def policy(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> tuple[str, PolicyModel]:
    return request.param, load_policy(model_dirs[request.param])


def padded_batch(vocab_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, targets (the next token) and the attention mask of right-padded random rows; pad id 0."""
    gen = torch.Generator().manual_seed(seed)
    rows, length = len(LENGTHS), max(LENGTHS)
    tokens = torch.zeros(rows, length + 1, dtype=torch.int64)
    attention_mask = torch.zeros(rows, length, dtype=torch.int64)
    for row, n in enumerate(LENGTHS):
        tokens[row, : n + 1] = torch.randint(1, vocab_size, (n + 1,), generator=gen)
        attention_mask[row, :n] = 1
    return tokens[:, :-1], tokens[:, 1:], attention_mask


def reference_logprobs(
    hf_model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) at the targets, from the HF model's full logits, in float64."""
    logits = hf_model(input_ids=input_ids, attention_mask=mask).logits.double()
    return torch.log_softmax(logits / temperature, dim=-1).gather(2, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_equal_float64_hf_logits_with_right_padding(policy: tuple[str, PolicyModel], temperature: float):
    _, model = policy
    input_ids, targets, mask = padded_batch(model.hf.config.vocab_size)
    reference_hf = copy.deepcopy(model.hf).double()
    with torch.no_grad():
        expected = reference_logprobs(reference_hf, input_ids, targets, mask, temperature)
        unmasked = model(input_ids, targets, temperature, chunk_tokens=7).logp  # chunks straddle rows and padding
        masked = model(input_ids, targets, temperature, attention_mask=mask).logp
        hidden = reference_hf.model(input_ids=input_ids, attention_mask=mask).last_hidden_state[mask.bool()]
    real = mask.bool()
    assert unmasked.dtype == torch.float32 and unmasked.shape == input_ids.shape
    # fp32 against float64: the LM head's H-term dot products and the V-term log-sum-exp (γ_V ≈ 3e-3 for V = 49152,
    # the bulk) bound a logprob's error; the 2-layer decoder's sums of <= 256 terms add ~1e-4 through the same |h|·|w|.
    # Measured: ~3e-6, 1000x under; padding leaking into a real position or a wrong chunk seam moves it by O(0.1).
    bound = lm_head_logprob_bound(torch.float32, hidden, reference_hf.lm_head.weight, temperature)
    # Right padding: causal attention alone keeps real positions from the pads, so no mask is needed.
    assert_within(unmasked.double()[real], expected[real], bound, "unmasked logprobs")
    assert_within(masked.double()[real], expected[real], bound, "masked logprobs")


def test_gradients_equal_those_through_hf_logits(policy: tuple[str, PolicyModel]) -> None:
    """The chunked path must give the same parameter gradients, including a tied head's two contributions."""
    _, model = policy
    # A check of logic (the chunked backward against autograd through HF's logits), so both in float64.
    model = copy.deepcopy(model).double()
    input_ids, targets, mask = padded_batch(model.hf.config.vocab_size, seed=1)
    weights = torch.randn(input_ids.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * mask
    reference_hf = copy.deepcopy(model.hf)

    (model(input_ids, targets, 0.7, chunk_tokens=5).logp * weights).sum().backward()
    (reference_logprobs(reference_hf, input_ids, targets, mask, 0.7) * weights).sum().backward()

    with torch.no_grad():
        hidden = reference_hf.model(input_ids=input_ids, attention_mask=mask).last_hidden_state[mask.bool()]
    expected = dict(reference_hf.named_parameters())
    for name, param in model.hf.named_parameters():
        ref_grad = expected[name].grad
        scale = float(ref_grad.abs().max())
        assert scale > 0, name
        # both float64 computations err by up to logprob_gradient_bound (γ_V-dominated: ~1e-11 of the largest entry)
        bound = 2 * logprob_gradient_bound(torch.float64, hidden, reference_hf.lm_head.weight, 0.7, scale)
        assert_within(param.grad, ref_grad, bound, name)


def test_full_hf_state_has_the_checkpoint_names_and_values(policy: tuple[str, PolicyModel], model_dirs) -> None:
    name, model = policy
    checkpoint = load_file(str(model_dirs[name] / "model.safetensors"))
    state = full_hf_state(model)

    assert set(state) == set(checkpoint) == checkpoint_tensor_names(model_dirs[name])
    assert ("lm_head.weight" in state) == (name == "tiny-qwen2")  # only the untied head is its own tensor
    for key, tensor in state.items():
        assert tensor.device.type == "cpu" and tensor.dtype == torch.float32
        assert torch.equal(tensor, checkpoint[key].float()), key  # bf16 → fp32 is exact
    embed = model.hf.model.embed_tokens.weight
    original = embed.detach().clone()
    with torch.no_grad():
        embed.add_(1.0)  # a snapshot: a later optimizer step must not show through
    try:
        assert torch.equal(state["model.embed_tokens.weight"], original)
    finally:
        with torch.no_grad():
            embed.copy_(original)


def test_load_policy_turns_dropout_and_kv_cache_off(policy: tuple[str, PolicyModel]) -> None:
    _, model = policy
    assert not model.training and not model.hf.training
    assert model.hf.config.use_cache is False


def test_checkpoint_tensor_names_without_safetensors_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        checkpoint_tensor_names(tmp_path)


def test_mismatched_targets_shape_raises(policy: tuple[str, PolicyModel]) -> None:
    _, model = policy
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(2, 5, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64), 1.0)
