"""How both channels' ZeroMQ sockets bind (the learner) and connect (the serves), and their optional shared secret.

The learner binds 127.0.0.1 unless told otherwise (`bind_socket`; port 0 picks a free port, read back from the
address it returns); a serve connects out (`connect_socket`, asyncio), so nothing needs to reach a serve. With a
secret, every socket on both sides speaks ZeroMQ CURVE:

Both sides read the same secret file (`--secret-file`, at least 16 bytes, e.g. `head -c 32 /dev/urandom > secret`).
From it each derives two CURVE keypairs with BLAKE2b under distinct personalisations: the learner's (server) and the
serves' (client). The learner's sockets are CURVE servers and a ZAP handler admits only the client key derived from
the same secret, so a peer without the secret can neither read the traffic nor get a single message delivered (its
handshake fails; nothing reaches the decoder). Without a secret file the sockets are plain TCP, bound to 127.0.0.1 by
default.

Not covered: the weights group (gloo or NCCL over its own TCP connections) carries raw weight bytes unencrypted; across
untrusted networks run it on a private network or VPN. Its messages are still never unpickled.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

MIN_SECRET_BYTES = 16


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on this machine only: `localhost` or a loopback address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def read_secret(path: str, flag: str = "--secret-file") -> bytes:
    """The secret in `path` (surrounding whitespace stripped); a ValueError names the flag and the fix."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"{flag} {path!r} cannot be read ({exc.strerror}): give a readable file") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{flag} {path!r} holds {len(secret)} bytes, expected at least {MIN_SECRET_BYTES} "
            "(e.g. head -c 32 /dev/urandom > secret)"
        )
    return secret


def derive_keys(secret: bytes) -> CurveKeys:

    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support: install pyzmq wheels (they bundle libsodium)")
    pairs = []
    for role in (b"inflight-server", b"inflight-client"):
        raw = hashlib.blake2b(secret, digest_size=32, person=role.ljust(16, b"\0")[:16]).digest()
        private = z85.encode(raw)
        pairs.append((zmq.curve_public(private), private))
    (server_public, server_secret), (client_public, client_secret) = pairs
    return CurveKeys(server_public, server_secret, client_public, client_secret)


_authenticators: dict[int, object] = {}


def secure_server(sock, keys: CurveKeys) -> None:
    """Make `sock` a CURVE server that admits only the client key of `keys` (call before bind)."""

    ctx = sock.context
    if id(ctx) not in _authenticators:  # one ZAP handler per context
        auth = ThreadAuthenticator(ctx)
        auth.start()

        class _OnlyOurClient:
            def callback(self, domain: str, key: bytes) -> bool:
                return key == keys.client_public

        auth.configure_curve_callback(domain="inflight", credentials_provider=_OnlyOurClient())
        _authenticators[id(ctx)] = auth
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"inflight")


def secure_client(sock, keys: CurveKeys) -> None:
    """Make `sock` a CURVE client of a learner with the same secret (call before connect)."""

    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


def weights_key(secret: bytes) -> bytes:
    """The key the weight updates' tags derive from (inflight/wire/weights.py:update_key): the same secret gives
    learner and serve the same key, and it is independent of the CURVE keys."""
    return hashlib.blake2b(secret, digest_size=32, person=b"inflight-weights").digest()


def bind_socket(sock: zmq.Socket, host: str, port: int) -> str:
    """Bind `sock` on `host` (port 0: a free one) and return the address it got, to read back and hand to serves."""
    sock.bind(f"tcp://{host}:{port or '*'}")
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def connect_socket(address: str, kind: int, keys: CurveKeys | None, options: dict[int, int]):
    """(asyncio context, socket of `kind` connected to `address`) with `options` set before connecting."""

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(kind)
    for option, value in options.items():
        sock.setsockopt(option, value)
    if keys is not None:
        secure_client(sock, keys)
    sock.connect(address)
    return ctx, sock
