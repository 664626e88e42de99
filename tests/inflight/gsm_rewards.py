"""Rewards a user would write for a GSM8K-style file, in TRL's convention (loaded by name in the tests)."""

import re

FINAL = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def final_number(text: str) -> str | None:
    found = FINAL.findall(text)
    return found[-1].replace(",", "") if found else None


def gsm_correct(prompts, completions, answer, **kwargs):
    """1.0 when the completion's `#### n` equals the reference's; the reference is a rationale ending in `#### n`."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 if final_number(t) is not None and final_number(t) == final_number(a) else 0.0
            for t, a in zip(texts, answer, strict=True)]  # fmt: skip


def has_final_line(prompts, completions, **kwargs):
    """A format reward: 1.0 with a `####` line; None (not applicable) when the row is marked `skip_format`."""
    skip = kwargs.get("skip_format") or [False] * len(completions)
    return [None if s else float("####" in c) for c, s in zip(completions, skip, strict=True)]
