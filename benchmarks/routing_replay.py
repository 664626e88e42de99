"""MoE routing replay (issue 32): the lag-0 logprob mismatch with and without replay, the routing agreement and the
record's extra bytes per token, for a tiny MoE of each family the learner replays.

    python -m benchmarks.routing_replay [--families qwen3_moe,qwen2_moe,mixtral] [--prompts 8] [--max-tokens 32]

Per family: a real vLLM engine with `routing_replay` in bfloat16 with an fp32 LM head (what `inflight.run` serves on a
CPU with avx512_bf16; `--dtype`), `--prompts` prompts sampled at temperature 1 (seeded); then the learner's own
forward (learner/model.py:PolicyModel, fp32 weights under bf16 autocast, as `inflight.learn --autocast bfloat16`)
over every sample twice: routed by its own router, and replaying the recorded routes (learner/routing_replay.py).
mismatch = mean |logπθ − logμ| over the completion tokens (lag 0: no update between sampling and the forward).
agreement = fraction of token×MoE-layer pairs where the learner's own top-k set equals the recorded one. bytes/token =
(encoded routed record − the same record without routes) / (prompt + completion tokens). Written to `--out` (JSON)
and printed as a markdown table. Qwen3-MoE is the prepared tiny-moe; Qwen2-MoE and Mixtral are built like it
(tests/moe_models.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks import RESULTS

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
QUESTIONS = ["What is {a} + {b}?", "Name {a} colours.", "Count from {a} to {b}.", "Write {a} words about rain."]


def family_dir(family: str, root: Path) -> Path:
    from inflight.models import prepare

    if family == "qwen3_moe":
        return prepare("tiny-moe")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from moe_models import save_tiny_moe

    return save_tiny_moe(family, root / family, prepare("smollm2"))


def sample(model_dir: Path, args) -> list:
    """Completions of `args.prompts` chat prompts at temperature 1 from an engine that records routes."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from inflight.serve.app import standalone_engine_config
    from inflight.serve.config import ServeConfig
    from vllm_patches.engine import InflightEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = np.random.default_rng(0)
    prompts = []
    for i in range(args.prompts):
        text = QUESTIONS[i % len(QUESTIONS)].format(a=int(rng.integers(2, 20)), b=int(rng.integers(20, 60)))
        chat = [{"role": "user", "content": text}]
        prompts.append(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    flags = ServeConfig(dtype=args.dtype, head_dtype="float32", kv_cache_gib=0.25, routing_replay="on")
    cfg = standalone_engine_config(flags, model_dir)

    async def run():
        engine = await InflightEngine.start(cfg)
        try:
            jobs = (engine.generation.generate(list(p), params, f"rr-{i}") for i, p in enumerate(prompts))
            return await asyncio.gather(*jobs)
        finally:
            engine.shutdown()

    return asyncio.run(run())


def measure(model_dir: Path, done: list, args, behind: float = 0.0) -> dict:
    """The learner's mismatch with and without replay, its agreement, and the record's extra bytes per token.
    `behind` > 0: the learner's weights are the sampler's moved by N(0, (behind · std)^2) per tensor — a serve one
    update ahead of the learner, as in an asynchronous run."""
    from learner.model import load_policy
    from learner.routing_replay import RoutingReplay

    model = load_policy(model_dir)
    if behind:
        _move(model, behind)
    replay = RoutingReplay(model.hf)
    autocast = torch.bfloat16 if args.dtype == "bfloat16" else None
    gaps = {"own": [], "replayed": []}
    for c in done:
        seq = c.prompt_ids + c.token_ids
        ids, targets = torch.tensor([seq[:-1]]), torch.tensor([seq[1:]])
        routes = torch.from_numpy(_routes(c.routes).astype(np.int64))[None]
        behaviour = torch.tensor(c.logprobs)
        with torch.no_grad():
            for kind in gaps:
                with replay.replaying(routes if kind == "replayed" else None):
                    logp = model(ids, targets, 1.0, autocast=autocast).logp[0, len(c.prompt_ids) - 1 :]
                gaps[kind].append((logp - behaviour).abs())
    agreement = replay.take_agreement()
    return {
        "mismatch_lag0": float(torch.cat(gaps["replayed"]).mean()),
        "mismatch_lag0_unreplayed": float(torch.cat(gaps["own"]).mean()),
        "routing_agreement": agreement.fraction,
        "route_bytes_per_token": record_overhead(done, model_dir.name),
        "tokens": sum(len(c.token_ids) for c in done),
        "layers": replay.layers,
        "top_k": replay.top_k,
        "experts": replay.num_experts,
    }


def _move(model: torch.nn.Module, scale: float) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * p.std() * scale)


def _routes(r) -> np.ndarray:
    return np.frombuffer(r.ids, dtype=r.dtype).reshape(r.positions, r.layers, r.top_k)


def record_overhead(done: list, model: str) -> float:
    """(routed record − the same record without routes) / (prompt + completion tokens), over all samples."""
    from inflight.wire.rollouts import Routes, Sampling, Times, encode_rollout, make_rollout

    extra = tokens = 0
    for c in done:
        fields = dict(prompt_ids=c.prompt_ids, completion_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions,
                      rollout_id="r", group_id="g", group_size=1, index=0, server_id="s", model=model, reward=0.0,
                      finish_reason="length", sampling=Sampling(1.0), times=Times(0.0, 0.0, 0.0))  # fmt: skip
        routes = Routes(c.routes.ids, c.routes.layers, c.routes.top_k, c.routes.dtype)
        routed, plain = make_rollout(routes=routes, **fields), make_rollout(**fields)
        extra += len(encode_rollout(routed)) - len(encode_rollout(plain))
        tokens += len(c.prompt_ids) + len(c.token_ids)
    return extra / tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--out", default=str(RESULTS / "routing_replay.json"))
    behind_help = "the one-version-behind learner's weights: the sampler's + N(0, (this · std)^2); 0 = skip that part"
    parser.add_argument("--behind", type=float, default=0.02, help=behind_help)
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for family in args.families.split(","):
            model_dir = family_dir(family, Path(root))
            done = sample(model_dir, args)
            results[family] = measure(model_dir, done, args)
            if args.behind:
                results[family]["behind"] = measure(model_dir, done, args, args.behind)
    Path(args.out).write_text(json.dumps({"args": vars(args), "families": results}, indent=1) + "\n")
    print("| family | MoE layers × top-k / experts | mismatch lag0, replay | without | agreement | bytes/token |")
    print("|---|---|---|---|---|---|")
    for family, r in results.items():
        shape = f"{r['layers']} × {r['top_k']} / {r['experts']}"
        print(f"| {family} | {shape} | {r['mismatch_lag0']:.2e} | {r['mismatch_lag0_unreplayed']:.2e} | "
              f"{r['routing_agreement']:.4f} | {r['route_bytes_per_token']:.2f} |")  # fmt: skip
    if args.behind:
        print(f"\nThe serve one version ahead (learner = sampler + N(0, ({args.behind} std)^2) per tensor):")
        print("| family | agreement, lag 0 | agreement, one behind | mismatch, replay | without |")
        print("|---|---|---|---|---|")
        for family, r in results.items():
            b = r["behind"]
            print(f"| {family} | {r['routing_agreement']:.4f} | {b['routing_agreement']:.4f} | "
                  f"{b['mismatch_lag0']:.2e} | {b['mismatch_lag0_unreplayed']:.2e} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
