"""Control messages between the learner and its serves: one schema, one file, msgpack tagged unions, never pickle.

Topology: the learner binds a ZeroMQ ROUTER (the control address); every serve connects a DEALER and introduces itself
with `Hello` (every tensor it serves and its `RunContract`, inflight/wire/contract.py; a serve that differs from the
learner in either is `Refused`), then sends a `Status` heartbeat every second. The learner answers with `JoinGroup`
(form the weights group), `UpdateWeights` (a manifest; the buckets follow over the weights group), and `Progress` (how
many groups it has consumed, which bounds how far generation may run ahead, and which groups it has journaled:
acknowledged groups the serve may forget; it sends the others again when a restarted learner asks it to introduce
itself). A serve reports `Joined` and `UpdateDone`.

Every message carries `schema`; `decode_control` raises `ControlError` naming the problem for anything malformed or of
another schema, and the receiver logs it and keeps running.
"""

from __future__ import annotations

import msgspec

from inflight.wire.contract import RunContract

# 2: Hello carries the serve's RunContract. An older serve's Hello is refused naming both schemas, never read as one
# that agrees with every default.
CONTROL_SCHEMA = 3
MAX_CONTROL_BYTES = 256 << 20  # manifests of large models are a few MiB; anything near this is an attack or a bug


class ControlError(ValueError):
    """A control message is malformed, of an unknown type, or of another schema version."""


class _Message(msgspec.Struct, tag_field="type", frozen=True, forbid_unknown_fields=True):
    schema: int = CONTROL_SCHEMA


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str
    shape: list[int]


# serve -> learner
class Hello(_Message, tag="hello"):
    server_id: str = ""
    model: str = ""
    workers: int = 1  # ranks this serve needs in the weights group (one per engine worker)
    version: int = 0
    mode: str = "never-stop"
    tensors: list[TensorSpec] = []
    contract: RunContract | None = None  # what this serve samples with; a learner refuses a Hello without one


class Status(_Message, tag="status"):
    server_id: str = ""
    version: int = 0
    inflight: int = 0
    outbox: int = 0
    rollouts_sent: int = 0
    groups_admitted: int = 0


class Joined(_Message, tag="joined"):
    server_id: str = ""
    group_name: str = ""
    ok: bool = True
    error: str = ""


class UpdateDone(_Message, tag="update_done"):
    server_id: str = ""
    version: int = 0
    ok: bool = True
    error: str = ""
    total_s: float = 0.0
    stall_s: float = 0.0
    commit_s: float = 0.0
    receive_s: float = 0.0


# learner -> serve
class JoinGroup(_Message, tag="join_group"):
    host: str = "127.0.0.1"
    port: int = 0
    group_name: str = ""
    rank: int = 1
    world_size: int = 2
    backend: str = "gloo"
    timeout_s: float = 60.0


class UpdateWeights(_Message, tag="update_weights"):
    manifest: bytes = b""  # an encoded inflight.wire.weights.UpdateManifest
    groups_consumed: int = 0


class Progress(_Message, tag="progress"):
    version: int = 0
    groups_consumed: int = 0
    acked: list[str] = []  # group ids the learner holds durably (journaled or trained): the serve may forget them
    published: int = 0  # version of the learner's latest published weights (a joining serve waits for them)


class Refused(_Message, tag="refused"):
    """The learner will not send weights to this serve (another model, or another contract): the serve stops, with
    `reason`."""

    reason: str = ""


class Introduce(_Message, tag="introduce"):
    """The learner does not know this serve (e.g. it restarted): send `Hello` again."""


ToLearner = Hello | Status | Joined | UpdateDone
ToServe = JoinGroup | UpdateWeights | Progress | Introduce | Refused

_encoder = msgspec.msgpack.Encoder()
_decoders = {"learner": msgspec.msgpack.Decoder(ToLearner), "serve": msgspec.msgpack.Decoder(ToServe)}


def encode_control(message: _Message) -> bytes:
    return _encoder.encode(message)


def decode_control(data: bytes, to: str):
    """Decode a message addressed to `to` ("learner" or "serve"); raise `ControlError` naming the problem."""
    if len(data) > MAX_CONTROL_BYTES:
        raise ControlError(f"control message is {len(data)} bytes, the limit is {MAX_CONTROL_BYTES}")
    try:
        message = _decoders[to].decode(data)
    except msgspec.DecodeError as exc:
        raise ControlError(f"control message for the {to} could not be decoded: {exc}") from exc
    if message.schema != CONTROL_SCHEMA:
        raise ControlError(
            f"control message {type(message).__name__}.schema is {message.schema}, expected {CONTROL_SCHEMA}: run "
            "the same inflight version on serve and learn"
        )
    return message
