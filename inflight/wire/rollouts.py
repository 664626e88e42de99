"""The rollout channel: one record per finished sample, from a serve's RolloutDriver to the learner's buffer.

- The record (`Rollout`, `make_rollout`, `encode_rollout`, `decode_rollout`), below.
- `RolloutStream`: the serve's PUSH (`connect_rollout_push`), with its outbox and the records it keeps until the
  learner acknowledges them.
- `RolloutReceiver`: the learner's PULL (synchronous: the training loop is not asyncio); every serve's PUSH connects.
  `receive()` returns decoded, validated `Rollout`s; a bad message is counted in `rejected` (by reason) and logged,
  never raised into the training loop.

A `Rollout` is a msgspec Struct encoded as msgpack; its arrays travel as raw little-endian bytes (int32 token ids,
float32 behaviour logprobs, int32 per-token policy versions) so a record is a few copies from numpy/torch and never
pickle. `decode_rollout` validates everything a learner relies on and raises `RolloutError` naming the field; the
learner counts and logs rejections instead of dropping them silently.

Behaviour logprobs are vLLM's processed logprobs: log-softmax of the logits after temperature (and top-k/top-p), i.e.
the exact distribution each token was sampled from. `token_versions[i]` is the weight version that produced token i;
`kv_versions[i]` the version that computed the oldest KV token i attended to (vllm_patches/kv_age.py): older than
`token_versions[i]` only when a commit with kv="keep" let the sequence go on over KV of older weights.

A multi-turn episode (inflight/serve/episodes.py) is one record: `prompt_ids` is its first prompt, `completion_ids`
every later token in order, the policy's turns and the environment's messages between them. `token_roles[i]` is 1 for
an environment token (tool output, user turn, chat scaffolding): it carries version −1, KV version −1 and logprob 0.0,
is context for the learner and never a loss term. Schema 2 added `token_roles` and `turns`.

Schema 3 (`RoutedRollout`, issue 32: Rollout Routing Replay) is a schema-2 record plus `routes`: the top-k experts
every fed position (prompt + completion − 1: the last token is never fed) was routed to in every MoE layer of the
serve's forward pass, for the learner to replay (learner/routing_replay.py). Only a serve with `--routing-replay on`
writes it; a record without routes is still schema 2, byte for byte what it was, and a reader that predates schema 3
refuses a routed record by its `schema` field instead of training on it without the routes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time

import msgspec
import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from inflight.wire.secure import CurveKeys, bind_socket, connect_socket, secure_server

log = logging.getLogger("inflight.wire")

ROLLOUT_SCHEMA = 2
ROUTED_SCHEMA = 3  # a RoutedRollout: a schema-2 record plus `routes`
ROUTE_DTYPES = ("uint8", "uint16")  # expert ids in the smallest unsigned type that holds them (LE)
POLICY, ENVIRONMENT = 0, 1  # token_roles values
MAX_ROLLOUT_BYTES = 64 << 20  # a record larger than this is refused before decoding


class RolloutError(ValueError):
    """A rollout record is malformed, of an unknown schema, or inconsistent with itself."""


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 0
    min_p: float = 0.0


class Times(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Wall-clock seconds (time.time()) on the serve host."""

    submitted: float
    first_token: float
    finished: float


class Rollout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    schema: int
    rollout_id: str
    group_id: str
    group_size: int
    index: int  # position of this sample in its group, 0..group_size-1
    server_id: str
    model: str
    prompt_ids: bytes  # int32 LE
    completion_ids: bytes  # int32 LE
    behaviour_logprobs: bytes  # float32 LE
    token_versions: bytes  # int32 LE
    reward: float
    finish_reason: str
    sampling: Sampling
    times: Times
    problem_id: str = ""
    resubmissions: int = 0
    kv_versions: bytes = b""  # int32 LE, one per completion token (-1: not recorded); empty = not recorded at all
    token_roles: bytes = b""  # uint8, one per completion token: 0 policy, 1 environment; empty = all policy
    turns: int = 1  # policy turns in the episode (0: its environment failed before the first)

    @property
    def prompt(self) -> np.ndarray:
        return np.frombuffer(self.prompt_ids, dtype="<i4")

    @property
    def completion(self) -> np.ndarray:
        return np.frombuffer(self.completion_ids, dtype="<i4")

    @property
    def logprobs(self) -> np.ndarray:
        return np.frombuffer(self.behaviour_logprobs, dtype="<f4")

    @property
    def versions(self) -> np.ndarray:
        return np.frombuffer(self.token_versions, dtype="<i4")

    @property
    def policy_mask(self) -> np.ndarray:
        """Per completion token, True where the policy sampled it (False: an environment token, never trained)."""
        if not self.token_roles:
            return np.ones(len(self.completion_ids) // 4, dtype=bool)
        return np.frombuffer(self.token_roles, dtype=np.uint8) == POLICY

    @property
    def kv_ages(self) -> np.ndarray:
        """Per token, the version of the oldest KV it attended to; where unrecorded, its own version (the best bound
        a serve that did not record it allows: a token never attends to KV newer than its weights)."""
        if not self.kv_versions:
            return self.versions
        kv = np.frombuffer(self.kv_versions, dtype="<i4")
        return np.where(kv < 0, self.versions, kv)


class Routes(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Routed experts: `ids` [positions, layers, top_k] in C order, as `dtype` (one of ROUTE_DTYPES, little-endian).
    Row t is input token t of prompt + completion; `layers` counts the MoE layers, in layer order. The rows cover
    every fed position, prompt + completion − 1, except after an episode that ended on environment tokens."""

    ids: bytes
    layers: int
    top_k: int
    dtype: str

    def array(self) -> np.ndarray:
        return np.frombuffer(self.ids, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(
            -1, self.layers, self.top_k
        )


class RoutedRollout(Rollout, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A rollout with the routes its tokens were sampled under (schema 3, `--routing-replay on`)."""

    routes: Routes


def routes_of(rollout: Rollout) -> Routes | None:
    """The record's routes, None for a record without them (schema 2)."""
    return getattr(rollout, "routes", None)


def make_rollout(
    *, prompt_ids, completion_ids, logprobs, versions, kv_versions=(), roles=(), routes: Routes | None = None, **fields
) -> Rollout:
    """Build a record from Python/numpy sequences; arrays are converted to the wire dtypes. `roles`: per completion
    token, truthy for an environment token; all-policy roles are sent as empty. `routes`: a schema-3 RoutedRollout."""
    env = np.asarray(roles, dtype=bool)
    kind, extra = (Rollout, {}) if routes is None else (RoutedRollout, {"routes": routes})
    return kind(
        token_roles=env.astype(np.uint8).tobytes() if env.any() else b"",
        kv_versions=np.asarray(kv_versions, dtype="<i4").tobytes(),
        schema=ROLLOUT_SCHEMA if routes is None else ROUTED_SCHEMA,
        prompt_ids=np.asarray(prompt_ids, dtype="<i4").tobytes(),
        completion_ids=np.asarray(completion_ids, dtype="<i4").tobytes(),
        behaviour_logprobs=np.asarray(logprobs, dtype="<f4").tobytes(),
        token_versions=np.asarray(versions, dtype="<i4").tobytes(),
        **extra,
        **fields,
    )


_encoder = msgspec.msgpack.Encoder()
_decoders = {ROLLOUT_SCHEMA: msgspec.msgpack.Decoder(Rollout), ROUTED_SCHEMA: msgspec.msgpack.Decoder(RoutedRollout)}


def encode_rollout(rollout: Rollout) -> bytes:
    return _encoder.encode(rollout)


def decode_rollout(data: bytes) -> Rollout:
    """Decode and validate one record; raise `RolloutError` naming the offending field."""
    if len(data) > MAX_ROLLOUT_BYTES:
        raise RolloutError(f"rollout message is {len(data)} bytes, the limit is {MAX_ROLLOUT_BYTES}: refused unread")
    schema = _peek_schema(data)
    if schema not in _decoders:
        raise RolloutError(
            f"rollout.schema is {schema!r}, expected {ROLLOUT_SCHEMA} or {ROUTED_SCHEMA} (with routes): run the "
            "same inflight version on serve and learn"
        )
    try:
        rollout = _decoders[schema].decode(data)
    except msgspec.DecodeError as exc:
        raise RolloutError(f"rollout could not be decoded: {exc}") from exc
    validate_rollout(rollout)
    return rollout


class _SchemaOnly(msgspec.Struct):
    schema: int | None = None


_schema_decoder = msgspec.msgpack.Decoder(_SchemaOnly)


def _peek_schema(data: bytes) -> int | None:
    try:
        return _schema_decoder.decode(data).schema
    except msgspec.DecodeError as exc:
        raise RolloutError(f"rollout is not a msgpack map with an integer 'schema' field: {exc}") from exc


def validate_rollout(r: Rollout) -> None:
    for name in ("prompt_ids", "completion_ids", "behaviour_logprobs", "token_versions", "kv_versions"):
        if len(getattr(r, name)) % 4:
            raise RolloutError(f"rollout.{name} has {len(getattr(r, name))} bytes, not a multiple of 4")
    n = len(r.completion_ids) // 4
    for name in ("behaviour_logprobs", "token_versions", "kv_versions"):
        if len(getattr(r, name)) // 4 != n and not (name == "kv_versions" and not r.kv_versions):
            raise RolloutError(f"rollout.{name} has {len(getattr(r, name)) // 4} entries, completion_ids has {n}")
    _validate_roles(r, n)
    policy = r.policy_mask
    if r.kv_versions and bool((r.kv_ages > r.versions)[policy].any()):
        raise RolloutError(
            "rollout.kv_versions has a version newer than its token's: a token attends only to KV its "
            "own or older weights computed"
        )
    if not r.prompt_ids:
        raise RolloutError("rollout.prompt_ids is empty; every sample needs its prompt")
    if not 0 <= r.index < r.group_size:
        raise RolloutError(f"rollout.index is {r.index}, expected 0 <= index < group_size ({r.group_size})")
    if not math.isfinite(r.reward):
        raise RolloutError(f"rollout.reward is {r.reward}, expected a finite number")
    lp = r.logprobs
    if n and (not np.all(np.isfinite(lp)) or np.any(lp > 1e-4)):
        raise RolloutError("rollout.behaviour_logprobs has values that are not finite log-probabilities (<= 0)")
    if n and np.any(r.versions[policy] < 0):
        raise RolloutError("rollout.token_versions has negative versions on policy tokens")
    if r.turns < 0:  # 0: an environment that failed at reset ended the episode before its first turn
        raise RolloutError(f"rollout.turns is {r.turns}, expected >= 0")
    _validate_routes(r, len(r.prompt_ids) // 4 + n - 1)


def _validate_routes(r: Rollout, positions: int) -> None:
    """Routes, when sent, are whole rows of ids of a declared type for at most every fed position (prompt +
    completion − 1); the schema says whether a record has them. Fewer rows: the episode's last environment tokens,
    never fed (it ended on them), have none; nothing trained comes after them, so no replay needs them."""
    routes = routes_of(r)
    if (routes is not None) != (r.schema == ROUTED_SCHEMA):
        raise RolloutError(f"rollout.schema is {r.schema} and routes are {'' if routes else 'not '}sent: a record "
                           f"has routes exactly when its schema is {ROUTED_SCHEMA}")  # fmt: skip
    if routes is None:
        return
    if routes.dtype not in ROUTE_DTYPES or routes.layers < 1 or routes.top_k < 1:
        raise RolloutError(
            f"rollout.routes is dtype {routes.dtype!r}, {routes.layers} layers, top-k {routes.top_k}: expected one "
            f"of {list(ROUTE_DTYPES)}, >= 1 layer, top-k >= 1"
        )
    row = routes.layers * routes.top_k * np.dtype(routes.dtype).itemsize
    if len(routes.ids) % row or len(routes.ids) // row > positions:
        raise RolloutError(
            f"rollout.routes.ids has {len(routes.ids)} bytes, expected whole rows of {row} bytes ({routes.layers} "
            f"layers × top-k {routes.top_k} × {routes.dtype}) for at most {positions} positions (prompt + completion "
            "− 1)"
        )


def _validate_roles(r: Rollout, n: int) -> None:
    """Roles, when sent, name every completion token; an environment token carries version −1 and logprob 0.0."""
    if not r.token_roles:
        return
    if len(r.token_roles) != n:
        raise RolloutError(f"rollout.token_roles has {len(r.token_roles)} entries, completion_ids has {n}")
    roles = np.frombuffer(r.token_roles, dtype=np.uint8)
    if np.any(roles > ENVIRONMENT):
        raise RolloutError(
            f"rollout.token_roles has values other than {POLICY} (policy) and {ENVIRONMENT} (environment)"
        )
    env = roles == ENVIRONMENT
    if np.any(r.versions[env] != -1) or np.any(r.logprobs[env] != 0.0):
        raise RolloutError(
            "rollout has environment tokens with a version other than -1 or a logprob other than 0.0: "
            "no policy sampled them"
        )


class RolloutStream:
    """The serve's end of the rollouts: finished rollouts leave through one PUSH socket connected to the learner's PULL
    (`RolloutReceiver`).

    No finished rollout is ever dropped: ZeroMQ PUSH never drops on a live connection, it blocks when the peer's queue
    is full (high-water mark). Rather than block the event loop, finished records wait in `outbox`, which the driver
    counts as outstanding work and stops admitting prompts when it is full — so a learner that stops reading stops
    generation after at most `max_outstanding` rollouts, and every one of them is delivered, once, when it reads again.

    A sent record is not forgotten either: it stays in `retained` (by group) until the learner acknowledges its group
    (`Progress.acked`: the learner has fsynced it to its journal). A learner killed with records in its socket queue or
    in memory loses nothing it acknowledged, and when the restarted learner asks this serve to introduce itself,
    `resend()` puts every unacknowledged record back into the outbox. Retained records count as outstanding work too, so
    memory stays bounded while the learner is away.
    """

    def __init__(self, address: str, hwm: int = 4, keys: CurveKeys | None = None):
        self.address = address
        self._ctx, self._sock = connect_rollout_push(address, hwm, keys)
        self.outbox: collections.deque[tuple[bytes, str]] = collections.deque()  # (record, group id)
        self.retained: dict[str, list[bytes]] = {}  # group id -> sent records not yet acknowledged
        self.retained_records = 0
        self.resent = 0
        self.sent = 0
        self.bytes_sent = 0
        self._wake = asyncio.Event()
        self.drained = asyncio.Event()  # set whenever the outbox becomes empty
        self.drained.set()
        self.connected = False  # a learner is connected now (`watch`)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)

    def offer(self, record: bytes, group_id: str) -> None:
        self.outbox.append((record, group_id))
        self.drained.clear()
        self._wake.set()

    def ack(self, group_ids) -> None:
        """The learner holds these groups durably: forget their records."""
        for group_id in group_ids:
            self.retained_records -= len(self.retained.pop(group_id, ()))

    def resend(self) -> int:
        """Queue every unacknowledged record again (a restarted learner lost what it had not acknowledged)."""
        records = [(r, g) for g, rs in self.retained.items() for r in rs]
        self.retained.clear()
        self.retained_records = 0
        self.outbox.extendleft(reversed(records))
        self.resent += len(records)
        if records:
            self.drained.clear()
            self._wake.set()
        return len(records)

    async def pump(self, on_sent=None) -> None:
        """Send outbox records in order, forever; a full peer queue suspends this coroutine, nothing else."""
        while True:
            if not self.outbox:
                self.drained.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            record, group_id = self.outbox[0]
            await self._sock.send(record, copy=False)
            self.outbox.popleft()
            self.retained.setdefault(group_id, []).append(record)
            self.retained_records += 1
            self.sent += 1
            self.bytes_sent += len(record)
            if on_sent is not None:
                on_sent()

    async def watch(self) -> None:
        """Keeps `connected` current, forever, from ZeroMQ's socket monitor: a learner that exits or dies closes its
        TCP connection, and the DISCONNECTED event arrives at once (a cut link is seen only when TCP gives up)."""
        while True:
            self._on_event(await self._monitor.recv_multipart())

    def _on_event(self, frames: list[bytes]) -> None:
        self.connected = parse_monitor_message(frames)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED

    async def flush(self, timeout_s: float = 10.0, poll_s: float = 0.05) -> None:
        """A stopping serve's last sends: the outbox, for at most `timeout_s`, and only while a learner is connected.
        The launchers stop the learner before the serves, so the usual learner is already gone; waiting for it
        would only delay the stop (by `timeout_s`, then the socket's linger)."""
        while await self._monitor.poll(0):  # what happened since `watch` last ran
            self._on_event(await self._monitor.recv_multipart())
        tasks = [asyncio.create_task(self.watch()), asyncio.create_task(self.pump())]
        deadline = time.monotonic() + timeout_s
        try:
            while self.outbox and self.connected and time.monotonic() < deadline:
                await asyncio.sleep(poll_s)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def close(self, linger_s: float = 5.0) -> None:
        """Records ZeroMQ still holds get `linger_s` to reach a connected learner; none when no learner is."""
        self._monitor.close(linger=0)
        self._sock.close(linger=int(linger_s * 1000) if self.connected else 0)
        self._ctx.term()


def connect_rollout_push(address: str, hwm: int = 4, keys=None):
    """The serve's end of the rollout channel: (context, asyncio PUSH) to the learner's `RolloutReceiver`.

    A small send high-water mark keeps records in the serve's own outbox (counted, retained until acknowledged)
    rather than in ZeroMQ's queue; a 10-s linger lets a stopping serve deliver what it already handed over."""

    return connect_socket(address, zmq.PUSH, keys, {zmq.SNDHWM: hwm, zmq.LINGER: 10_000})


class RolloutReceiver:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        hwm: int = 64,
        ctx: zmq.Context | None = None,
        keys: CurveKeys | None = None,
    ):

        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        if keys is not None:  # inflight.wire.secure.CurveKeys: only serves with the same secret get through
            secure_server(self._sock, keys)
        self._sock.setsockopt(zmq.RCVHWM, hwm)  # bounds what piles up here when training is slow
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address = bind_socket(self._sock, host, port)
        self.received = 0
        self.rejected: collections.Counter[str] = collections.Counter()

    def receive(self, timeout_s: float | None = None, max_items: int = 1 << 30) -> list[Rollout]:
        """Everything that arrives within `timeout_s` (at least one record unless it times out), up to `max_items`."""
        return [rollout for rollout, _ in self.receive_raw(timeout_s, max_items)]

    def receive_raw(self, timeout_s: float | None = None, max_items: int = 1 << 30) -> list[tuple[Rollout, bytes]]:
        """Like `receive`, each valid rollout with the exact bytes it arrived as (what the learner journals)."""

        out: list[tuple[Rollout, bytes]] = []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(out) < max_items:
            wait_ms = 0 if out else (-1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000)))
            if not self._sock.poll(wait_ms, zmq.POLLIN):
                break
            data = self._sock.recv(copy=True)
            try:
                out.append((decode_rollout(data), data))
                self.received += 1
            except RolloutError as exc:
                reason = str(exc).split(":")[0][:80]
                self.rejected[reason] += 1
                log.error("rejected rollout #%d (%d bytes): %s", sum(self.rejected.values()), len(data), exc)
        return out

    def close(self) -> None:
        self._sock.close(linger=0)
