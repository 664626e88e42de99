"""The staging plan of real models served tensor-parallel on 80 GB and 141 GB GPUs (issue 41): what one rank holds
during an update when each rank stages only its slice, against today's whole-model staging, and whether it fits.

Run on the driver (no GPU, no model download): `python -m benchmarks.tp_plan` prints the table docs/gpus.md and
BENCHMARKS.md quote. The models are described by their published config.json facts (hidden size, layers, heads, kv
heads, head dim, intermediate size, vocabulary, experts); their checkpoint tensors are laid out here the way their
Hugging Face checkpoints name them, and tests/vllm_patches/test_device_plan.py checks the totals against the
published parameter counts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from vllm_patches.device_plan import GIB, TensorParallel, plan_gpu_memory, rank_sizes, staging_plan, weight_sizes

BF16 = 2
GPUS = {"H100 80 GB": 80 * GIB, "H200 141 GB": 143771 << 20}  # what the driver reports: 81559 MiB, 143771 MiB
LEARNER_BUCKET = 64 << 20  # inflight/learn/publisher.py's default bucket
MAX_CTAS = 4  # inflight/wire/group.py:WEIGHTS_MAX_CTAS


@dataclass(frozen=True)
class ModelFacts:
    """A model's config.json facts (published on its hub page)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP; for an MoE, each expert's (moe_intermediate_size)
    vocab: int
    experts: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False


MODELS = {
    "Llama-3.1-70B": ModelFacts("Llama-3.1-70B", 8192, 80, 64, 8, 128, 28672, 128256),
    "Qwen2.5-32B": ModelFacts("Qwen2.5-32B", 5120, 64, 40, 8, 128, 27648, 152064, qkv_bias=True),
    "Qwen3-30B-A3B": ModelFacts("Qwen3-30B-A3B", 2048, 48, 32, 4, 128, 768, 151936, experts=128, qk_norm=True),
    "Qwen3-235B-A22B": ModelFacts("Qwen3-235B-A22B", 4096, 94, 64, 4, 128, 1536, 151936, experts=128, qk_norm=True),
}


def checkpoint(m: ModelFacts) -> dict[str, list[int]]:
    """Every tensor name -> shape of `m`'s Hugging Face checkpoint (untied embedding and head)."""
    h, q, kv = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    out = {"model.embed_tokens.weight": [m.vocab, h], "model.norm.weight": [h], "lm_head.weight": [m.vocab, h]}
    for i in range(m.layers):
        p = f"model.layers.{i}"
        out |= {f"{p}.input_layernorm.weight": [h], f"{p}.post_attention_layernorm.weight": [h]}
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            out[f"{p}.self_attn.{proj}_proj.weight"] = [rows, h]
            if m.qkv_bias:
                out[f"{p}.self_attn.{proj}_proj.bias"] = [rows]
        out[f"{p}.self_attn.o_proj.weight"] = [h, q]
        if m.qk_norm:
            out |= {f"{p}.self_attn.q_norm.weight": [m.head_dim], f"{p}.self_attn.k_norm.weight": [m.head_dim]}
        mlps = [f"{p}.mlp.experts.{e}" for e in range(m.experts)] if m.experts else [f"{p}.mlp"]
        if m.experts:
            out[f"{p}.mlp.gate.weight"] = [m.experts, h]
        for mlp in mlps:
            out |= {f"{mlp}.gate_proj.weight": [m.intermediate, h], f"{mlp}.up_proj.weight": [m.intermediate, h]}
            out[f"{mlp}.down_proj.weight"] = [h, m.intermediate]
    return out


@dataclass(frozen=True)
class PlanRow:
    model: str
    parallel: str
    gpu: str
    memory: str
    whole_gib: float  # the whole checkpoint (what every rank staged before issue 41)
    rank_gib: float  # what one rank keeps
    peak_gib: float  # the update's device peak on one rank, sliced
    fits: bool
    left_gib: float  # left to vLLM beyond the rank's live weights (activations, graphs, KV cache); <0: refused
    fits_whole: bool  # today's whole-model staging


def plan_row(model: str, tp: int, ep: bool, gpu: str, memory: str, utilization: float = 0.9) -> PlanRow:
    facts = MODELS[model]
    shapes = checkpoint(facts)
    split = TensorParallel(tp, facts.kv_heads, expert_parallel=ep)
    sliced = staging_plan(rank_sizes(shapes, BF16, split), memory, False, MAX_CTAS, bucket_bytes=LEARNER_BUCKET)
    whole_sizes = weight_sizes({n: _numel(s) * BF16 for n, s in shapes.items()})
    whole = staging_plan(whole_sizes, memory, False, MAX_CTAS)
    fits, left = _fits(sliced, GPUS[gpu], utilization)
    # Before issue 41 every rank staged the whole model beside its live share.
    old_peak = (
        whole.peak_bytes
        - (whole.weight_bytes if memory == "double" else 0)
        + sliced.weight_bytes * (memory == "double")
    )
    fits_whole = utilization * GPUS[gpu] - old_peak >= 1.25 * sliced.weight_bytes
    parallel = f"TP={tp}" + (" EP" if ep else "")
    return PlanRow(model, parallel, gpu, memory, whole_sizes.total / GIB, sliced.weight_bytes / GIB,
                   sliced.peak_bytes / GIB, fits, left / GIB, fits_whole)  # fmt: skip


def _fits(staging, device_bytes: int, utilization: float) -> tuple[bool, int]:
    try:
        return True, plan_gpu_memory(staging, device_bytes, utilization).left_bytes
    except ValueError:
        left = int((utilization - staging.peak_bytes / device_bytes) * device_bytes) - staging.weight_bytes
        return False, left


def _numel(shape: list[int]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


CASES = [
    ("Llama-3.1-70B", 8, False),
    ("Llama-3.1-70B", 4, False),
    ("Qwen2.5-32B", 2, False),
    ("Qwen3-30B-A3B", 2, False),
    ("Qwen3-30B-A3B", 4, True),
    ("Qwen3-235B-A22B", 8, True),
    ("Qwen3-235B-A22B", 8, False),
]


def table(utilization: float = 0.9) -> list[PlanRow]:
    return [
        plan_row(model, tp, ep, gpu, memory, utilization)
        for model, tp, ep in CASES
        for gpu in GPUS
        for memory in ("low", "double")
    ]


def markdown(rows: list[PlanRow]) -> str:
    lines = [
        "| model | split | GPU | --update-memory | checkpoint GiB | one rank keeps GiB | update peak GiB/rank "
        "| sliced: fits? (left to vLLM beyond weights, GiB) | whole staging (before): fits? |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        verdict = f"yes ({r.left_gib:.1f})" if r.fits else f"no ({r.left_gib:.1f})"
        lines.append(
            f"| {r.model} | {r.parallel} | {r.gpu} | {r.memory} | {r.whole_gib:.1f} | {r.rank_gib:.1f} | "
            f"{r.peak_gib:.1f} | {verdict} | {'yes' if r.fits_whole else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args()
    print(markdown(table(args.gpu_memory_utilization)))


if __name__ == "__main__":
    main()
