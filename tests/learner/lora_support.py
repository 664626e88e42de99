"""What the LoRA tests share (test_lora.py, test_lora_distributed.py): a LoRA policy whose adapters are not zero, and
a small batch of rollouts to train it on."""

from __future__ import annotations

from pathlib import Path

import torch

from learner.lora import LoraSpec, is_lora_name
from learner.model import PolicyModel, load_policy
from learner.step import Sample

SPEC = LoraSpec(rank=4, alpha=8.0)  # scale 2, every decoder linear module
PAD = 0
B_SCALE = 0.05  # |B·A·x| of this order moves logprobs by ~0.1-1: an adapter left out is seen


def lora_policy(model_dir: str | Path, dtype: torch.dtype, spec: LoraSpec = SPEC, seed: int = 0) -> PolicyModel:
    """`load_policy` with `spec`, the same on every call with the same seed (A is drawn at load), and B filled with
    small random values: PEFT starts B at zero, which makes the adapter a no-op that no comparison could catch."""
    torch.manual_seed(seed)
    model = load_policy(model_dir, dtype=dtype, lora=spec)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_lora_name(name) and ".lora_B." in name:
                param.copy_(B_SCALE * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return model


def rollouts(vocab_size: int, seed: int, lengths: tuple[tuple[int, int], ...]) -> list[Sample]:
    """Random (prompt, completion) token rows of the given lengths, behaviour logprobs near -log(vocab) (ratios
    spread around the model's own), advantages of both signs, one token masked per completion of 3 or more."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for row, (p_len, c_len) in enumerate(lengths):
        ids = torch.randint(1, vocab_size, (p_len + c_len,), generator=gen).tolist()
        behaviour = (-torch.rand(c_len, generator=gen) - 6.0).tolist()
        mask = [not (c_len >= 3 and i == 1) for i in range(c_len)]
        samples.append(Sample(ids[:p_len], ids[p_len:], behaviour, (-1.0) ** row * (0.5 + row), mask))
    return samples
