"""Measure the served model's reward on any task, with any rewards, at serve's sampling settings: a base-model signal
check before a run.

RL needs signal: if the base model is never right (or always right) group advantages are all zero. This script
samples `--problems` × `--samples` completions with the settings `python -m inflight.serve` uses (the task, reward and
sampling flags are ServeConfig's own fields, so they cannot drift apart), scores each group with the serve's rewards,
and prints the mean reward and the accuracy (completions with a reward > 0) with standard errors, each reward's mean,
and the fraction of groups that carry signal (rewards not all equal).

    python scripts/task_accuracy.py [--model smollm2] [--task arithmetic] [--reward module:function] [--problems 64]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys

from inflight.serve.config import ServeConfig

# The serve's own flags this script takes (same names, defaults and help).
SERVE_FLAGS = ("model", "task", "prompt_key", "answer_key", "system_prompt", "max_operand", "reward",
               "reward_weights", "reward_convention", "temperature", "top_p", "top_k", "min_p",
               "max_tokens", "task_args", "dtype", "head_dtype", "max_model_len")  # fmt: skip


async def measure(args) -> dict:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from inflight.models import resolve_model
    from inflight.serve.app import standalone_engine_config
    from inflight.serve.driver import prompt_token_ids
    from inflight.tasks.loading import load_task
    from inflight.tasks.rewards import RewardMeans, load_rewards, score_group
    from vllm_patches.engine import InflightEngine

    path = resolve_model(args.model)
    task, default_reward = load_task(args.task, args.task_seed, args.max_operand, args.prompt_key, args.answer_key,
                                     args.system_prompt, task_args=args.task_args)  # fmt: skip
    rewards = load_rewards(args.reward or default_reward, args.reward_weights, args.reward_convention)
    problems = [p for _, p in zip(range(args.problems), task, strict=False)]
    tok = AutoTokenizer.from_pretrained(path)
    serve_flags = ServeConfig(**{name: getattr(args, name) for name in SERVE_FLAGS})
    engine = await InflightEngine.start(standalone_engine_config(serve_flags, path))  # the engine a serve would run
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p)  # fmt: skip
    means = RewardMeans()
    try:

        async def group(k, p):
            ids = prompt_token_ids(tok, p)
            done = await asyncio.gather(
                *(engine.generation.generate(ids, params, f"acc-{k}-{i}") for i in range(args.samples))
            )
            scores = await score_group(rewards, p, [c.text for c in done], [c.token_ids for c in done])
            means.add(scores)
            return scores.total

        totals = await asyncio.gather(*(group(k, p) for k, p in enumerate(problems)))
    finally:
        engine.shutdown()
    return summarize(totals) | {"each": means.means()}


def summarize(totals: list[list[float]]) -> dict:
    """Mean reward and accuracy (reward > 0) with standard errors over problems; the share of groups with signal."""

    def mean_se(per_problem: list[float]) -> tuple[float, float]:
        m = sum(per_problem) / len(per_problem)
        var = sum((x - m) ** 2 for x in per_problem) / max(len(per_problem) - 1, 1)
        return m, math.sqrt(var / len(per_problem))

    reward, reward_se = mean_se([sum(g) / len(g) for g in totals])
    acc, acc_se = mean_se([sum(r > 0 for r in g) / len(g) for g in totals])
    signal = sum(len(set(g)) > 1 for g in totals) / len(totals)
    return {"reward": reward, "reward_se": reward_se, "accuracy": acc, "stderr": acc_se, "signal_groups": signal}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    d = ServeConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(ServeConfig):
        if f.name in SERVE_FLAGS:
            default = getattr(d, f.name)
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default,
                                choices=f.metadata.get("choices"), help=f.metadata.get("help"))  # fmt: skip
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--samples", type=int, default=d.group_size)
    parser.add_argument("--task-seed", type=int, default=1000)  # not serve's training seed: held-out problems
    return parser.parse_args(argv)


def main() -> int:
    args = parse()
    from inflight.demo import import_vllm_optional_media

    import_vllm_optional_media()  # else a vLLM import-error traceback keeps the engine alive at exit
    r = asyncio.run(measure(args))
    print(f"model {args.model} | task {args.task} | T={args.temperature} | {args.problems} problems x "
          f"{args.samples} samples")  # fmt: skip
    each = ", ".join(f"{k} {v:.3f}" for k, v in r["each"].items())
    print(f"reward {r['reward']:.3f} ± {r['reward_se']:.3f} ({each}); accuracy (reward > 0) {r['accuracy']:.3f} ± "
          f"{r['stderr']:.3f} (standard errors over problems); groups with signal "
          f"{r['signal_groups']:.2f}")  # fmt: skip
    ok = 0.05 <= r["accuracy"] <= 0.70
    print("within the 5%–70% band RL needs" if ok else "OUTSIDE the 5%–70% band: make the task easier or harder "
          "(e.g. --max-operand), or check the reward (one that never fires is often a parsing mismatch)")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
