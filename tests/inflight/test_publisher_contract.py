"""The learner's publisher refuses, at Hello, a serve whose run contract differs from its own
(inflight/learn/admission.py, inflight/wire/contract.py): real ZeroMQ sockets, a plain DEALER as the serve; and it
answers a serve that asks before its engine starts (inflight/serve/control.py:ask_learner). Real serves are refused end
to end in tests/inflight/test_contract_refusal.py."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch
import zmq

from inflight.learn.publisher import WeightPublisher, open_publisher
from inflight.serve.control import RefusedError, ask_learner
from inflight.wire.contract import RunContract
from inflight.wire.control import (
    Agreed,
    Ask,
    ControlServer,
    Hello,
    Progress,
    Refused,
    TensorSpec,
    decode_control,
    encode_control,
)

STATE = {"w": torch.zeros(3, 4)}
SPECS = [TensorSpec("w", "float32", [3, 4])]
LEARNER = RunContract(group_size=8, temperature=1.0, dtype="float32")


@pytest.fixture
def publisher():
    pub = open_publisher(ControlServer(), timeout_s=5.0)
    pub.check.set_model(STATE, LEARNER)
    yield pub
    pub.close()
    pub.plane.control.close()


def say_hello(publisher: WeightPublisher, contract: RunContract | None, server_id: str = "infer3@1"):
    """What the learner answers a serve that says Hello with `contract`: the first reply, or None."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(publisher.plane.control.address)
    try:
        sock.send(encode_control(Hello(server_id=server_id, model="m", tensors=SPECS, contract=contract)))
        publisher.plane.pump(2.0)
        publisher.plane.send_progress({}, 0, 0)  # what an accepted serve would get next
        return decode_control(sock.recv(), to="serve") if sock.poll(2000) else None
    finally:
        sock.close()


# a serve's contract that differs in one field -> the start of the learner's reason
DIFFERING = {
    "dtype": (RunContract(group_size=8, temperature=1.0, dtype="bfloat16"),
              "dtype bfloat16, but this learner computes in float32"),
    "group_size": (RunContract(group_size=2, temperature=1.0, dtype="float32"),
                   "group_size 2, but this learner trains groups of 8"),
    "temperature": (RunContract(group_size=8, temperature=0.5, dtype="float32"),
                    "temperature 0.5, but this learner computes logprobs at temperature 1.0"),
}  # fmt: skip


@pytest.mark.parametrize("field", DIFFERING)
def test_a_serve_of_another_dtype_group_size_or_temperature_is_refused_at_hello_naming_it_and_is_not_a_member(
    publisher, field
):
    contract, named = DIFFERING[field]
    reply = say_hello(publisher, contract)
    assert isinstance(reply, Refused), reply
    assert reply.reason.startswith(f"serve infer3@1: {named}"), reply.reason
    assert publisher.plane.serves == {} and named in publisher.plane.membership.refused["infer3@1"]


def test_a_serve_without_a_contract_is_refused_when_the_learner_has_one(publisher):
    reply = say_hello(publisher, None)
    assert isinstance(reply, Refused) and "announced no run contract" in reply.reason
    assert publisher.plane.serves == {}


def test_a_serve_with_the_learners_contract_is_accepted(publisher):
    reply = say_hello(publisher, LEARNER)
    assert isinstance(reply, Progress), reply
    assert [s.server_id for s in publisher.plane.serves.values()] == ["infer3@1"]
    assert publisher.plane.membership.refused == {}


def ask(publisher: WeightPublisher, contract: RunContract) -> Agreed | None:
    """`ask_learner` against the learner's real control socket, the learner pumping it meanwhile (as it does while it
    waits for rollouts)."""

    async def both() -> Agreed | None:
        pumping = asyncio.get_running_loop().run_in_executor(None, publisher.plane.pump, 3.0)
        try:
            return await ask_learner(publisher.plane.control.address, Ask(server_id="infer3", contract=contract))
        finally:
            await pumping

    return asyncio.run(both())


@pytest.mark.parametrize("field", DIFFERING)
def test_a_serve_that_asks_before_its_engine_starts_is_refused_naming_the_differing_field_and_is_not_recorded(
    publisher, field
):
    contract, named = DIFFERING[field]
    with pytest.raises(RefusedError, match=f"the learner refused this serve: serve infer3: {named}"):
        ask(publisher, contract)
    assert publisher.plane.serves == {} and named in publisher.plane.membership.refused["infer3"]


def test_a_serve_that_asks_with_the_learners_contract_is_told_agreed_and_is_a_serve_only_after_its_hello(publisher):
    assert ask(publisher, LEARNER) == Agreed(full_every=1)  # the publisher's --full-every: no deltas
    assert publisher.plane.serves == {} and publisher.plane.membership.refused == {}
    assert isinstance(say_hello(publisher, LEARNER), Progress)


def test_a_learner_sending_deltas_says_so_to_a_serve_that_asks():
    pub = open_publisher(ControlServer(), timeout_s=5.0, full_every=4)
    pub.check.set_model(STATE, LEARNER)
    try:
        assert ask(pub, LEARNER) == Agreed(full_every=4)  # the serve's staging plan then counts decoded tensors
    finally:
        pub.close()
        pub.plane.control.close()


def test_a_serve_that_asks_with_no_learner_listening_goes_on_after_its_wait():
    nobody = ControlServer()
    address = nobody.address
    nobody.close()  # the port a learner was bound to, now closed: the Ask waits, unanswered
    assert asyncio.run(ask_learner(address, Ask(server_id="infer3", contract=LEARNER), wait_s=0.3)) is None


ADAPTER = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 4),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(4, 8),
}
LORA_LEARNER = RunContract(dtype="float32", lora_rank=8, lora_alpha=8.0, base_model="f00d")


@pytest.mark.parametrize(
    ("serve", "tensors", "named"),
    [
        (dict(lora_rank=16, lora_alpha=16.0), ADAPTER, "lora_rank 16, but this learner trains adapters of rank 8: "
         "start both with the same --lora-rank"),
        (dict(lora_rank=0, lora_alpha=0.0, base_model=""), STATE, "lora_rank 0, but this learner trains adapters of "
         "rank 8"),
        (dict(base_model="beef"), ADAPTER, "trains its adapter on another base model (checkpoint fingerprint f00d): "
         "give both the same --model"),
        (dict(), {"base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight": torch.zeros(8, 4)},
         "is not served by infer3@1 (another --lora-targets?)"),
    ],
    ids=["rank", "no-adapter", "base-model", "targets"],
)  # fmt: skip
def test_a_serve_of_another_adapter_or_base_model_is_refused_at_hello_naming_the_flag(serve, tensors, named):
    """Checked before the tensors: a serve of another rank names --lora-rank, not the first adapter tensor's shape."""
    pub = open_publisher(ControlServer(), timeout_s=5.0)
    pub.check.set_model(ADAPTER, LORA_LEARNER)
    specs = [TensorSpec(n, "float32", list(t.shape)) for n, t in tensors.items()]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pub.plane.control.address)
    try:
        contract = msgspec.structs.replace(LORA_LEARNER, **serve)
        sock.send(encode_control(Hello(server_id="infer3@1", model="m", tensors=specs, contract=contract)))
        pub.plane.pump(2.0)
        reply = decode_control(sock.recv(), to="serve") if sock.poll(2000) else None
    finally:
        sock.close()
        pub.close()
        pub.plane.control.close()
    assert isinstance(reply, Refused) and named in reply.reason, reply
