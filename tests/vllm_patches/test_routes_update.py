"""The routing record across a never-stop weight update on the real engine (tiny-moe, float32 as in test_routes.py):
every position keeps the route of the forward that first computed it, so the record is exactly what sampled each
token. With kv="keep" the positions after the commit are routed by the new weights over the old weights' KV; with
kv="recompute" the re-prefill routes the positions before the commit again, and the record keeps their first route;
with abort-resume the resubmission's routes are stitched to the aborted request's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from support import Sender, chat_ids, load_state, perturbed_checkpoint, start_engine, stop_engine
from test_routes import recorded
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import SamplingParams

from learner.routing_replay import moe_routers

pytestmark = pytest.mark.engine
LONG = 240
MIN_GAP = 1e-4  # as test_routes.py: a reference top-k decided by less is not compared (counted, and bounded)


@pytest.fixture(scope="module")
def env(loop, model_dirs, tmp_path_factory):
    a_dir = model_dirs["tiny-moe"]
    b_dir = tmp_path_factory.mktemp("ckpt") / "tiny-moe-B"
    b = {name: t.float() for name, t in perturbed_checkpoint(a_dir, b_dir, seed=5).items()}  # the fp32 engine's
    engine = start_engine(loop, a_dir, routing_replay=True, dtype="float32")
    sender = Sender()
    loop.run_until_complete(sender.connect(engine))
    models = {d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (a_dir, b_dir)}
    yield {
        "engine": engine,
        "sender": sender,
        "a": load_state(a_dir),
        "b": b,
        "A": models[a_dir],
        "B": models[b_dir],
        "prompt": chat_ids(AutoTokenizer.from_pretrained(a_dir), "Tell me a long story."),
    }
    stop_engine(loop, engine)


def routed(model, ids: list[int], past=None):
    """(sorted top-k ids [len(ids), layers, k], smallest k-th vs (k+1)-th logit gap per position, the KV cache)."""
    seen = []
    handles = [r.register_forward_hook(lambda m, a, out: seen.append((out[0], out[2]))) for r in moe_routers(model)]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True)
    for h in handles:
        h.remove()
    k = seen[0][1].shape[-1]
    gaps = torch.stack([z.sort(-1, descending=True).values[:, k - 1 : k + 1].diff(dim=-1).abs()[:, 0] for z, _ in seen])
    return torch.stack([i for _, i in seen], dim=1).sort(dim=-1).values.numpy(), gaps.min(0).values.numpy(), out


def commit_during(env, loop, rid: str, kv: str, mode: str):
    engine, sender = env["engine"], env["sender"]

    async def run():
        # planned before the request starts: the checksums of every tensor took longer than the request on a busy
        # machine (two test workers on two cores), and the commit then landed after it
        planned = await sender.plan(env["b"], engine.version + 1)
        params = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
        task = asyncio.ensure_future(engine.generation.generate(env["prompt"], params, rid))
        await asyncio.sleep(0.5)
        assert not task.done(), "the request finished before the update: make it longer"
        report = await sender.push(engine, env["b"], engine.version + 1, mode=mode, kv=kv, planned=planned)
        done = await task
        await sender.push(engine, {n: t.float() for n, t in env["a"].items()}, engine.version + 1)  # back to A
        return done, report

    return loop.run_until_complete(run())


def commit_inside(env, loop, rid: str, kv: str, mode: str, tries: int = 3):
    """`commit_during` until the commit lands inside the request: on a busy machine (two test workers on two cores)
    the update's staging can outlast the request, and a commit after it tests nothing (a precondition, not the
    behaviour: each try goes back to A)."""
    for attempt in range(tries):
        done, report = commit_during(env, loop, f"{rid}-{attempt}", kv, mode)
        if report.version in done.versions:
            return done, report
    pytest.fail(f"the commit landed after the request ended in {tries} tries: make LONG ({LONG}) longer")


def assert_routes_equal(got: np.ndarray, want: np.ndarray, gap: np.ndarray, what: str) -> None:
    decided = gap > MIN_GAP
    differ = np.flatnonzero(((got != want).any(axis=(1, 2))) & decided)
    assert differ.size == 0, f"{what}: positions {differ.tolist()} differ"
    assert (~decided).sum() <= 2, f"{what}: {(~decided).sum()} near ties: pick another prompt"


# abort-resume: the request is aborted, updated and resubmitted (prompt + partial tokens, another request id): its
# routes are the two requests' stitched (vllm_patches/routes.py:stitch), B's over B's own KV from the resubmission on
@pytest.mark.parametrize(
    ("kv", "mode"), [("keep", "never-stop"), ("recompute", "never-stop"), ("keep", "abort-resume")]
)
def test_each_position_keeps_the_route_that_first_computed_it_across_a_commit(env, loop, kv, mode):
    done, report = commit_inside(env, loop, f"routes-{kv}-{mode}", kv, mode)
    switch = done.versions.index(report.version)  # the first token the new weights sampled
    assert 0 < switch < LONG, f"the commit landed outside the request (token {switch})"
    seq = env["prompt"] + done.token_ids
    cut = len(env["prompt"]) + switch - 1  # that token was sampled at this position: the first one B computed
    got = recorded(done.routes)
    assert got.shape[0] == len(seq) - 1
    before, gap_a, out_a = routed(env["A"], seq[:cut])
    assert_routes_equal(got[:cut], before, gap_a, f"kv={kv}, before the commit (A)")
    if mode == "abort-resume":
        assert done.resubmissions == 1
    if kv == "keep" and mode == "never-stop":  # B over A's KV of the positions before the commit
        after, gap_b, _ = routed(env["B"], seq[cut:-1], past=out_a.past_key_values)
    else:  # recomputed or resubmitted: B over its own KV of the whole sequence
        whole, gaps, _ = routed(env["B"], seq[:-1])
        after, gap_b = whole[cut:], gaps[cut:]
    assert_routes_equal(got[cut:], after, gap_b, f"kv={kv}, from the commit on (B)")
    # and the two references differ where the test could tell a wrong choice: B moved the routers
    assert (before != routed(env["B"], seq[:cut])[0]).any()
