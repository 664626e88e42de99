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
