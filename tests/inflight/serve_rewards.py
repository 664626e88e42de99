"""Reward functions loaded by the serve subprocess in tests (`--reward serve_rewards:...`)."""

import asyncio


async def answer_tenth(text, problem):
    """Async, depends only on the problem: a test can check each record's reward against its problem_id."""
    await asyncio.sleep(0)
    return float(problem.answer) / 10


def always_fails(text, problem):
    raise RuntimeError("this reward is broken on purpose")


def text_length(text, problem):
    """Varies between samples of one group even for a random tiny model, so advantages (and gradients) are non-zero."""
    return (len(text) % 7) / 6


def share_if_odd_answer(prompts, completions, completion_ids, answer, **columns):
    """TRL's convention: completion tokens / 8 where the problem's answer is odd, None (not applicable) otherwise."""
    return [len(ids) / 8 if a % 2 else None for ids, a in zip(completion_ids, answer, strict=True)]
