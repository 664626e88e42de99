"""Rollout records and control messages: round trips, and every malformed input refused with the field named."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from inflight.wire.control import ControlError, Hello, Progress, TensorSpec, decode_control, encode_control
from inflight.wire.rollouts import (
    ROLLOUT_SCHEMA,
    ROUTED_SCHEMA,
    RolloutError,
    Sampling,
    Times,
    decode_rollout,
    encode_rollout,
    make_rollout,
)


def record(**over):
    fields = dict(prompt_ids=[1, 2, 3], completion_ids=[4, 5], logprobs=[-0.5, -1.5], versions=[3, 4],
                  rollout_id="r", group_id="g", group_size=2, index=0, server_id="s", model="m", reward=1.0,
                  finish_reason="stop", sampling=Sampling(1.0), times=Times(1.0, 2.0, 3.0))  # fmt: skip
    fields.update(over)
    return make_rollout(**fields)


def test_rollout_round_trip_keeps_arrays_exact():
    r = decode_rollout(encode_rollout(record()))
    assert r.prompt.tolist() == [1, 2, 3] and r.completion.tolist() == [4, 5]
    assert r.logprobs.tolist() == [-0.5, -1.5] and r.versions.tolist() == [3, 4]


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"logprobs": [-0.5]}, "behaviour_logprobs"),
        ({"versions": [1, 2, 3]}, "token_versions"),
        ({"index": 2}, "index"),
        ({"reward": float("nan")}, "reward"),
        ({"logprobs": [0.5, -1.0]}, "behaviour_logprobs"),
        ({"prompt_ids": []}, "prompt_ids"),
    ],
)
def test_inconsistent_rollouts_are_refused_naming_the_field(over, field):
    with pytest.raises(RolloutError, match=field):
        decode_rollout(encode_rollout(record(**over)))


def test_unknown_schema_pickle_and_garbage_rollouts_are_refused():
    raw = msgspec.msgpack.decode(encode_rollout(record()))
    newer = ROUTED_SCHEMA + 1  # a rollout from a newer inflight than this learner
    with pytest.raises(RolloutError, match=f"schema is {newer}"):
        decode_rollout(msgspec.msgpack.encode({**raw, "schema": newer}))
    for data in (pickle.dumps({"schema": ROLLOUT_SCHEMA}), b"\xff\x00garbage", msgspec.msgpack.encode([1, 2])):
        with pytest.raises(RolloutError):
            decode_rollout(data)


def test_control_round_trip_and_refusals():
    hello = Hello(server_id="s", tensors=[TensorSpec("w", "float32", [2, 3])])
    assert decode_control(encode_control(hello), to="learner") == hello
    assert decode_control(encode_control(Progress(groups_consumed=4)), to="serve").groups_consumed == 4
    with pytest.raises(ControlError, match="schema is 7"):
        decode_control(encode_control(Progress(schema=7)), to="serve")
    with pytest.raises(ControlError):
        decode_control(encode_control(hello), to="serve")  # a serve never receives Hello
    with pytest.raises(ControlError):
        decode_control(pickle.dumps(Progress()), to="serve")
