"""The embedded demo: SmolLM2 answers seeded arithmetic problems through `InflightEngine`, scored by the task reward.

No training and no weight update: it shows that a fresh machine can serve the model, sample groups and score them,
and what that costs (tokens/s) before anything asynchronous is added. Every token is tagged with its weight version
(all v0 here). `make demo` runs it with the defaults.

    python -m inflight.demo [--model smollm2] [--problems 16] [--group-size 4] [--max-tokens 24] [--temperature 0.7]
                            [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from inflight.models import MODEL_NAMES, PrepareError
from inflight.tasks.arithmetic import ArithmeticTask, reward
from inflight.tasks.base import Problem

if TYPE_CHECKING:
    from vllm_patches.engine import InflightEngine
    from vllm_patches.generation import Completion


@dataclass
class DemoConfig:
    """What one demo run does; the defaults take about a minute on two CPU cores."""

    model: str = field(default="smollm2", metadata={"help": "prepared model to serve", "choices": MODEL_NAMES})
    problems: int = field(default=16, metadata={"help": "arithmetic problems to ask"})
    group_size: int = field(default=4, metadata={"help": "samples per problem (one request each)"})
    max_tokens: int = field(default=24, metadata={"help": "completion budget per sample"})
    temperature: float = field(default=0.7, metadata={"help": "sampling temperature"})
    seed: int = field(default=0, metadata={"help": "task seed: which problems are asked"})


@dataclass
class GroupResult:
    """One problem, its group of sampled completions and their rewards, in the same order."""

    problem: Problem
    completions: list[Completion]
    rewards: list[float]


def parse_config(argv: list[str] | None = None) -> DemoConfig:
    """One `--flag` per `DemoConfig` field, with the field's default and help."""
    parser = argparse.ArgumentParser(prog="python -m inflight.demo", description=__doc__.split("\n\n")[0])
    for f in fields(DemoConfig):
        flag, help_text = f"--{f.name.replace('_', '-')}", f"{f.metadata['help']} (default {f.default})"
        parser.add_argument(
            flag, type=type(f.default), default=f.default, choices=f.metadata.get("choices"), help=help_text
        )
    cfg = DemoConfig(**vars(parser.parse_args(argv)))
    for name in ("problems", "group_size", "max_tokens"):
        if getattr(cfg, name) < 1:
            parser.error(f"--{name.replace('_', '-')} is {getattr(cfg, name)}, expected >= 1")
    return cfg


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """The question as one user turn in the model's chat template, ready for the assistant's reply."""
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


async def sample_groups(
    engine: InflightEngine, tokenizer, problems: list[Problem], cfg: DemoConfig
) -> list[GroupResult]:
    """`group_size` independent requests per problem, all in flight at once, each scored by the task reward."""
    from vllm import SamplingParams

    # No per-request seed: it forces a per-request generator, which the CPU engine does not survive.
    params = SamplingParams(n=1, temperature=cfg.temperature, max_tokens=cfg.max_tokens)
    prompts = [chat_prompt_ids(tokenizer, p.question) for p in problems]
    requests = [
        engine.generation.generate(ids, params, f"{p.id}/{k}")
        for p, ids in zip(problems, prompts, strict=True)
        for k in range(cfg.group_size)
    ]
    completions = await asyncio.gather(*requests)
    groups = []
    for i, problem in enumerate(problems):
        group = completions[i * cfg.group_size : (i + 1) * cfg.group_size]
        groups.append(GroupResult(problem, group, [reward(c.text, problem.answer) for c in group]))
    return groups


def import_vllm_optional_media() -> None:
    """Import vLLM's audio module while no frame on the stack holds an engine; call it before `asyncio.run`.

    vLLM keeps the ImportError of its optional torchcodec import in a module global, traceback and all, so every frame
    on the stack at the first import stays alive until interpreter exit. Imported lazily inside `InflightEngine.start`,
    that pins the AsyncLLM past the module teardown, and its `__del__` then fails noisily at exit.
    """
    import vllm.multimodal.media.audio  # noqa: F401


async def run(cfg: DemoConfig) -> tuple[list[GroupResult], dict[str, float]]:
    """Start the engine, sample every group, shut the engine down; return the groups and the timings."""
    from transformers import AutoTokenizer

    from inflight.models import prepare
    from inflight.serve.app import standalone_engine_config
    from inflight.serve.config import ServeConfig
    from vllm_patches.engine import InflightEngine

    model_dir = prepare(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = ArithmeticTask(seed=cfg.seed).take(cfg.problems)
    start = time.perf_counter()
    engine = await InflightEngine.start(standalone_engine_config(ServeConfig(max_model_len=512), model_dir))
    try:
        started = time.perf_counter()
        groups = await sample_groups(engine, tokenizer, problems, cfg)
        finished = time.perf_counter()
    finally:
        engine.shutdown()
    return groups, {"engine_start_s": started - start, "generate_s": finished - started}


def one_line(text: str, width: int) -> str:
    """`text` with its whitespace collapsed, cut to `width` characters, quoted."""
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[: width - 1] + "…")


def print_report(groups: list[GroupResult], timings: dict[str, float]) -> float:
    """The per-problem table and the totals; returns the accuracy (mean reward over all samples)."""
    print(f"{'id':<12} {'question':<44} {'answer':>6}  {'rewards':<10} sample 0")
    for g in groups:
        rewards = " ".join(f"{r:.0f}" for r in g.rewards)
        sample = one_line(g.completions[0].text, 40)
        print(f"{g.problem.id:<12} {g.problem.question:<44} {g.problem.answer:>6}  {rewards:<10} {sample}")
    rewards = [r for g in groups for r in g.rewards]
    correct, accuracy = sum(rewards), sum(rewards) / len(rewards)
    solved = sum(any(g.rewards) for g in groups)
    tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
    versions = Counter(v for g in groups for c in g.completions for v in c.versions)
    print()
    print(f"accuracy          {accuracy:.3f}  ({correct:.0f}/{len(rewards)} samples correct)")
    print(f"problems solved   {solved}/{len(groups)}  (at least one correct sample in the group)")
    seconds = timings["generate_s"]
    print(f"tokens generated  {tokens}  in {seconds:.1f} s  = {tokens / seconds:.1f} tokens/s")
    print(f"engine start      {timings['engine_start_s']:.1f} s")
    print(f"weight versions   {', '.join(f'v{v}: {n} tokens' for v, n in sorted(versions.items()))}")
    return accuracy


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    import_vllm_optional_media()
    try:
        groups, timings = asyncio.run(run(cfg))
    except PrepareError as exc:
        print(f"inflight.demo: error: {exc}", file=sys.stderr)
        return 2
    print_report(groups, timings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
