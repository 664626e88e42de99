"""Lag-0 logprob mismatch of a bf16 serve with a bf16 LM head vs an fp32 LM head, side by side in one run.

At version 0 both sides hold the same weights, so |learner logprob − serve logprob| of a sampled token measures only
how differently the two compute it: the floor under every importance ratio of a run. For each serve head precision
the same prompts are sampled (SmolLM2, temperature 1) and scored by two learners: fp32 throughout, and the bf16
learner a bf16 run uses (`--autocast bfloat16`: decoder under bf16 autocast, LM head and log-softmax in fp32).

    python -m benchmarks.head_precision [--model smollm2] [--samples 64] [--max-tokens 32]

Prints one table and writes it with the CPU label to `benchmarks/results/head_precision.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from benchmarks import RESULTS

PROMPTS = ["What is {a} + {b}? Reply with only the number.", "Name a fruit that starts with the letter {c}.",
           "Write one sentence about the number {a}.", "Count from {b} to {a}."]  # fmt: skip
OUT = RESULTS / "head_precision.json"


def prompt_ids(tokenizer, n: int) -> list[list[int]]:
    texts = [PROMPTS[i % len(PROMPTS)].format(a=10 + i, b=i % 7, c="ABCDEFGP"[i % 8]) for i in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts]  # fmt: skip


async def sample(model_dir: Path, head_dtype: str, prompts: list[list[int]], max_tokens: int):
    """Completions of a bf16 engine with the given head precision (one sample per prompt, temperature 1)."""
    from vllm import SamplingParams

    from inflight.serve.app import standalone_engine_config
    from inflight.serve.config import ServeConfig
    from vllm_patches.engine import InflightEngine

    flags = ServeConfig(max_model_len=512, dtype="bfloat16", head_dtype=head_dtype, kv_cache_gib=0.25)
    cfg = standalone_engine_config(flags, model_dir)
    engine = await InflightEngine.start(cfg)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=0)  # the engine seed fixes draws
        jobs = [engine.generation.generate(p, params, f"{head_dtype}-{i}") for i, p in enumerate(prompts)]
        return await asyncio.gather(*jobs)
    finally:
        engine.shutdown()


def learner_gaps(model_dir: Path, completions, autocast: torch.dtype | None) -> torch.Tensor:
    """|learner − serve| logprob of every sampled token; the learner as `inflight.learn` runs it (fp32 parameters)."""
    from learner.model import load_policy
    from learner.step import Sample, make_batch

    model = load_policy(model_dir, dtype=torch.float32)
    samples = [Sample(c.prompt_ids, c.token_ids, c.logprobs, 0.0, [True] * len(c.token_ids)) for c in completions]
    batch = make_batch(samples, pad_id=0)
    with torch.no_grad():
        logp = model(batch.input_ids, batch.targets, 1.0, positions=batch.mask, autocast=autocast).logp
    return (logp - batch.behaviour_logp).abs()[batch.mask]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.head_precision", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from inflight.machine import cpu_label
    from inflight.models import resolve_model

    model_dir = resolve_model(args.model)
    prompts = prompt_ids(AutoTokenizer.from_pretrained(model_dir), args.samples)
    rows = []
    print(f"lag-0 mean |learner - serve| logprob, {args.model}, bf16 serve, {args.samples} samples; {cpu_label()}")
    print("| serve LM head | fp32 learner | bf16-autocast learner (fp32 head) | tokens | sampling s |")
    print("| --- | --- | --- | --- | --- |")
    for head in ("model", "float32"):
        start = time.perf_counter()
        completions = asyncio.run(sample(model_dir, head, prompts, args.max_tokens))
        seconds = time.perf_counter() - start
        fp32 = learner_gaps(model_dir, completions, None)
        bf16 = learner_gaps(model_dir, completions, torch.bfloat16)
        row = {"serve_head": "bfloat16" if head == "model" else "float32", "fp32_learner": float(fp32.mean()),
               "bf16_autocast_learner": float(bf16.mean()), "tokens": fp32.numel(), "sampling_s": seconds}  # fmt: skip
        rows.append(row)
        print(f"| {row['serve_head']} | {row['fp32_learner']:.2e} | {row['bf16_autocast_learner']:.2e} | "
              f"{row['tokens']} | {seconds:.1f} |")  # fmt: skip
    ratio = rows[0]["bf16_autocast_learner"] / max(rows[1]["bf16_autocast_learner"], 1e-12)
    print(f"bf16 head / fp32 head (bf16-autocast learner): {ratio:.1f}x")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_label(), "model": args.model, "rows": rows}
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
