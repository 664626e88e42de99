"""Measure the served model's accuracy on the default task at serve's default sampling settings.

RL needs signal: if the base model is never right (or always right) group advantages are all zero. This script
samples `--problems` × `--samples` completions with exactly the settings `python -m inflight.serve` uses by default
(task, difficulty, temperature, max tokens — read from ServeConfig, so they cannot drift apart) and prints the accuracy
with its standard error and the fraction of groups that carry signal (not all equal).

    python scripts/task_accuracy.py [--model smollm2] [--problems 64] [--samples 8] [--max-operand N] [--temperature T]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys

from inflight.serve.config import ServeConfig


async def measure(args) -> dict:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from inflight.models import resolve_model
    from inflight.tasks.arithmetic import ArithmeticTask, reward
    from vllm_patches.engine import EngineConfig, InflightEngine

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    engine = await InflightEngine.start(EngineConfig(model=str(path)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    problems = ArithmeticTask(args.task_seed, max_operand=args.max_operand).take(args.problems)
    try:

        async def group(k, p):
            ids = tok.apply_chat_template([{"role": "user", "content": p.question}], add_generation_prompt=True,
                                          return_dict=False)  # fmt: skip
            done = await asyncio.gather(*(engine.generate(ids, params, f"acc-{k}-{i}") for i in range(args.samples)))
            return [reward(c.text, p.answer) for c in done]

        rewards = await asyncio.gather(*(group(k, p) for k, p in enumerate(problems)))
    finally:
        engine.shutdown()
    flat = [r for g in rewards for r in g]
    acc = sum(flat) / len(flat)
    per_problem = [sum(g) / len(g) for g in rewards]
    spread = math.sqrt(sum((x - acc) ** 2 for x in per_problem) / max(len(per_problem) - 1, 1) / len(per_problem))
    return {"accuracy": acc, "stderr": spread, "signal_groups": sum(0 < x < 1 for x in per_problem) / len(rewards)}


def main() -> int:
    d = ServeConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--samples", type=int, default=d.group_size)
    parser.add_argument("--max-operand", type=int, default=d.max_operand)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--task-seed", type=int, default=1000)  # not serve's training seed: held-out problems
    args = parser.parse_args()
    from inflight.demo import import_vllm_optional_media

    import_vllm_optional_media()  # else a vLLM import-error traceback keeps the engine alive at exit
    result = asyncio.run(measure(args))
    print(f"model {args.model} | arithmetic max_operand {args.max_operand} | T={args.temperature} | "
          f"{args.problems} problems x {args.samples} samples")  # fmt: skip
    print(f"accuracy {result['accuracy']:.3f} ± {result['stderr']:.3f} (standard error over problems); "
          f"groups with signal {result['signal_groups']:.2f}")  # fmt: skip
    ok = 0.05 <= result["accuracy"] <= 0.70
    print("within the 5%–70% band RL needs" if ok else "OUTSIDE the 5%–70% band: tune --max-operand")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
