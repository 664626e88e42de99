"""The fresh two-worker engine the tensor-parallel tests compare against (conftest.py:fresh_tp2): what it was asked,
and what it said."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

TP = 2
SEED = 7  # checkpoint B of every tensor-parallel comparison: the same B, so one fresh engine answers for all of them
UNKNOWN = ("model.layers.0.mlp.mystery_proj.weight", [128, 128])  # no live parameter: resolved to "full"
WRONG = ("model.layers.0.self_attn.q_proj.weight", [96, 128])  # contradicts the live parameter: refused by name


@dataclass
class Answer:
    token_ids: list[int]
    logprobs: list[float]


@dataclass
class FreshTP2:
    """What a fresh two-worker engine started from a model's checkpoint B (`b_dir`) said: its greedy answers to
    support.PROMPTS, and each rank's placements of B's tensors plus `UNKNOWN` and its answer to `WRONG`."""

    b_dir: Path
    answers: list[Answer]
    placements: list[list]  # per rank, as the RPC returned them (tests convert them to Placements)
    refused: list


def ask_a_fresh_engine(loop, a_dir: Path, here: Path) -> None:
    from support import greedy, perturbed_checkpoint, start_engine, stop_engine
    from transformers import AutoTokenizer

    perturbed_checkpoint(a_dir, here / "B", seed=SEED)
    engine = start_engine(loop, here / "B", tensor_parallel_size=TP)
    try:
        answers = loop.run_until_complete(greedy(engine, AutoTokenizer.from_pretrained(a_dir), tag="fresh"))
        placements = loop.run_until_complete(engine.llm.collective_rpc("inflight_placements", args=([UNKNOWN],)))
        refused = loop.run_until_complete(engine.llm.collective_rpc("inflight_placements", args=([WRONG],)))
    finally:
        stop_engine(loop, engine)
    said = {"answers": [{"token_ids": a.token_ids, "logprobs": a.logprobs} for a in answers],
            "placements": placements, "refused": refused}  # fmt: skip
    # whole or not at all (a worker killed mid-write must not leave half a record for the next to read); floats
    # round-trip exactly (shortest repr)
    (here / "said.json.part").write_bytes(msgspec.json.encode(said))
    (here / "said.json.part").replace(here / "said.json")
