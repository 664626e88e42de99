"""Schema 3 (inflight/wire/rollouts.py:RoutedRollout): a rollout with the MoE routes its tokens were sampled under."""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
import pytest

from inflight.wire.rollouts import (
    ROUTED_SCHEMA,
    Rollout,
    RolloutError,
    Routes,
    Sampling,
    Times,
    decode_rollout,
    encode_rollout,
    make_rollout,
    routes_of,
)

# sha256 of `record()`'s encoding by inflight/wire/rollouts.py before schema 3 existed (commit 65db07e)
SCHEMA_2_SHA256 = "dc06d25b75f1162970659ad227bd2ad3794c51d419e1aeed30d3dce7b0ad81a1"


def record(routes: Routes | None = None) -> Rollout:
    return make_rollout(prompt_ids=[1, 2, 3], completion_ids=[4, 5], logprobs=[-0.5, -1.25], versions=[3, 4],
                        kv_versions=[3, 3], rollout_id="g-0", group_id="g", group_size=2, index=0, server_id="s",
                        model="tiny-moe", reward=1.0, finish_reason="stop", sampling=Sampling(1.0),
                        times=Times(1.0, 2.0, 3.0), problem_id="p", routes=routes)  # fmt: skip


def routes(positions: int = 4, layers: int = 2, top_k: int = 2, dtype: str = "uint8") -> Routes:
    ids = np.arange(positions * layers * top_k).astype(dtype) % 4
    return Routes(ids.tobytes(), layers, top_k, dtype)


def test_a_rollout_without_routes_is_byte_for_byte_the_schema_2_record():
    data = encode_rollout(record())
    assert hashlib.sha256(data).hexdigest() == SCHEMA_2_SHA256
    assert routes_of(decode_rollout(data)) is None


def test_a_routed_rollout_round_trips_as_schema_3_with_its_routes():
    sent = routes()
    got = decode_rollout(encode_rollout(record(sent)))
    assert got.schema == ROUTED_SCHEMA and routes_of(got) == sent
    assert got.prompt.tolist() == [1, 2, 3] and got.completion.tolist() == [4, 5]
    assert routes_of(got).array().shape == (4, 2, 2)  # prompt + completion − 1 positions


def test_a_reader_of_schema_2_refuses_a_routed_rollout_by_name():
    data = encode_rollout(record(routes()))
    assert msgspec.msgpack.decode(data)["schema"] == 3  # what a schema-2 reader checks first, and refuses
    with pytest.raises(msgspec.ValidationError, match="routes"):  # the schema-2 struct, were the check skipped
        msgspec.msgpack.decode(data, type=Rollout)


def test_routes_of_another_length_or_type_are_refused_naming_the_field():
    with pytest.raises(RolloutError, match=r"routes.ids has .* at most 4 positions"):
        decode_rollout(encode_rollout(record(routes(positions=5))))
    with pytest.raises(RolloutError, match="routes is dtype 'int8'"):
        decode_rollout(encode_rollout(record(Routes(b"\0" * 16, 2, 2, "int8"))))
    bad = msgspec.structs.replace(record(routes()), schema=2)  # routes under the schema that has none
    with pytest.raises(RolloutError, match="unknown field `routes`"):
        decode_rollout(encode_rollout(bad))


def test_uint16_routes_for_models_of_more_than_256_experts_round_trip():
    sent = Routes((np.arange(16, dtype="<u2") * 40).tobytes(), 2, 2, "uint16")
    assert routes_of(decode_rollout(encode_rollout(record(sent)))).array().max() == 600


def test_a_serve_and_a_learner_that_disagree_on_routing_replay_are_refused_naming_the_flag():
    from inflight.wire.contract import RunContract

    serve, learner = RunContract(dtype="bfloat16"), RunContract(dtype="bfloat16", routing_replay="on")
    assert "--routing-replay" in serve.mismatch(learner, "s") and learner.mismatch(learner, "s") == ""
