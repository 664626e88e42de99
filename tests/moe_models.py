"""Tiny seeded MoE models of each family routing replay supports (learner/routing_replay.py), for tests.

Dimensions follow inflight/models.py's tiny-moe (a Qwen3-MoE): multiples of 32 (the CPU grouped-gemm's alignment),
head_dim 64, 4 experts, top-2, every layer sparse. `initializer_range` 0.1 makes router logits far apart, so the
recorded and the reference top-k are decided by the weights, not by rounding noise.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def tiny_moe_config(family: str, vocab_size: int):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
        return Qwen3MoeConfig(norm_topk_prob=True, head_dim=64, **moe, **common)
    if family == "qwen2_moe":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
        return Qwen2MoeConfig(norm_topk_prob=False, shared_expert_intermediate_size=64, **moe, **common)
    if family == "mixtral":
        return MixtralConfig(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, **common)
    raise ValueError(f"family is {family!r}, expected one of {FAMILIES}")


def tiny_moe(family: str, vocab_size: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_moe_config(family, vocab_size), dtype=dtype).eval()


def save_tiny_moe(family: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A bf16 checkpoint of `family` with the tokenizer in `tokenizer_dir` (the prepared smollm2's), for an engine."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_moe(family, len(tokenizer), seed, torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
