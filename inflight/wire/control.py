"""Control messages between the learner and its serves: one schema, one file, msgpack tagged unions, never pickle.

Topology: the learner binds a ZeroMQ ROUTER (the control address); a serve first asks, before its engine starts, whether
the learner would take its `RunContract` (`Ask`, answered `Agreed` or `Refused`), then connects a DEALER and introduces
itself with `Hello` (every tensor it serves and its `RunContract`, inflight/wire/contract.py; a serve that differs from
the learner in either is `Refused`), then sends a `Status` heartbeat every second. The learner answers with `JoinGroup`
(form the weights group), `UpdateWeights` (a manifest; the buckets follow over the weights group), and `Progress` (how
many groups it has consumed, which bounds how far generation may run ahead, and which groups it has journaled:
acknowledged groups the serve may forget; it sends the others again when a restarted learner asks it to introduce
itself). A serve reports `Joined` and `UpdateDone`.

Every message carries `schema`; `decode_control` raises `ControlError` naming the problem for anything malformed or of
another schema, and the receiver logs it and keeps running.

`ControlServer` is the learner's ROUTER, bound (synchronous); every serve's DEALER (`connect_control_dealer`, asyncio)
connects, and messages to a serve are addressed by its ZeroMQ identity, learned from its `Hello`.
"""

from __future__ import annotations

import logging

import msgspec
import zmq
import zmq.asyncio

from inflight.wire.contract import RunContract
from inflight.wire.secure import CurveKeys, bind_socket, connect_socket, secure_server

log = logging.getLogger("inflight.wire")

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


class Ask(_Message, tag="ask"):
    """Before its engine starts, a serve asks whether the learner would take its run contract, so that a serve the
    learner refuses stops in a second instead of after loading its model. The learner answers `Refused` or `Agreed`;
    the `Hello` after the engine's start is checked in full all the same (the tensors are known only then)."""

    server_id: str = ""
    contract: RunContract | None = None


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
    bytes_kept: int = 0  # what one worker staged: its tensor-parallel slices
    full_tensors: list[str] = msgspec.field(default_factory=list)  # kept whole on a worker: layout not known


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


class Agreed(_Message, tag="agreed"):
    """The learner would take the run contract a serve sent in `Ask`. `full_every`: its --full-every (> 1: it sends
    delta updates, whose decoded tensors the serve's staging plan must count); 0 from a learner that does not say."""

    full_every: int = 0


class Introduce(_Message, tag="introduce"):
    """The learner does not know this serve (e.g. it restarted): send `Hello` again."""


ToLearner = Hello | Ask | Status | Joined | UpdateDone
ToServe = JoinGroup | UpdateWeights | Progress | Introduce | Refused | Agreed

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


class ControlServer:
    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, ctx: zmq.Context | None = None, keys: CurveKeys | None = None
    ):

        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        if keys is not None:
            secure_server(self._sock, keys)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished serve raises instead of vanishing
        self.address = bind_socket(self._sock, host, port)
        self.rejected = 0

    def poll(self, timeout_s: float = 0.0) -> list[tuple[bytes, object]]:
        """(identity, message) for every valid message waiting (waits up to `timeout_s` for the first)."""

        out = []
        wait_ms = int(timeout_s * 1000)
        while self._sock.poll(wait_ms if not out else 0, zmq.POLLIN):
            identity, data = self._sock.recv_multipart()
            try:
                out.append((identity, decode_control(data, to="learner")))
            except ControlError as exc:
                self.rejected += 1
                log.error("rejected control message from %r: %s", identity, exc)
        return out

    def send(self, identity: bytes, message) -> bool:
        """Send to one serve; False if that serve is not connected (it died or has not said Hello)."""

        try:
            self._sock.send_multipart([identity, encode_control(message)])
            return True
        except zmq.ZMQError as exc:
            log.error("control message %s to %r not delivered: %s", type(message).__name__, identity, exc)
            return False

    def send_raw(self, identity: bytes, data: bytes) -> None:
        """Bytes as they are (fault-injection tests send malformed messages with this)."""
        self._sock.send_multipart([identity, data])

    def close(self) -> None:
        self._sock.close(linger=0)


def connect_control_dealer(address: str, keys=None):
    """The serve's end of the control channel: (context, asyncio DEALER) to the learner's `ControlServer` ROUTER,
    which addresses replies by this socket's identity (learned from the serve's `Hello`)."""

    return connect_socket(address, zmq.DEALER, keys, {zmq.LINGER: 1000})
