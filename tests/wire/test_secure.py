"""ZeroMQ CURVE with a shared secret on the learner's real sockets: same secret gets through, anything else does not."""

from __future__ import annotations

import contextlib
import time

import pytest
import zmq

from inflight.wire.control import ControlServer, Hello, Progress, decode_control, encode_control
from inflight.wire.rollouts import RolloutReceiver, Sampling, Times, encode_rollout, make_rollout
from inflight.wire.secure import derive_keys, read_secret, secure_client

SECRET = b"correct horse battery staple 42"


def record(i: int) -> bytes:
    return encode_rollout(make_rollout(
        prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.5], versions=[0], rollout_id=f"r{i}", group_id="g",
        group_size=1, index=0, server_id="s", model="m", reward=1.0, finish_reason="stop", sampling=Sampling(1.0),
        times=Times(0.0, 0.0, 0.0)))  # fmt: skip


def push(address: str, keys=None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_client(sock, keys)
    sock.connect(address)
    return sock


def test_only_a_serve_with_the_same_secret_delivers_rollouts():
    ctx = zmq.Context()  # a context of its own: its ZAP handler admits exactly one client key
    rx = RolloutReceiver(ctx=ctx, keys=derive_keys(SECRET))
    senders = {
        "same secret": push(rx.address, derive_keys(SECRET)),
        "other secret": push(rx.address, derive_keys(b"another secret, also 16+ bytes")),
        "plain": push(rx.address),
    }
    try:
        senders["same secret"].send(record(0))
        for i, name in ((1, "other secret"), (2, "plain")):
            with contextlib.suppress(zmq.Again):  # no handshake ever completes: the record may not even queue
                senders[name].send(record(i), zmq.NOBLOCK)
        got, deadline = [], time.monotonic() + 5
        while time.monotonic() < deadline:
            got += rx.receive(timeout_s=0.2)
        assert [r.rollout_id for r in got] == ["r0"]
        assert rx.rejected == {}  # refused at the handshake: nothing reached the decoder
    finally:
        for sock in senders.values():
            sock.close(linger=0)
        rx.close()
        ctx.destroy(linger=0)


def test_control_messages_flow_both_ways_under_curve():
    ctx = zmq.Context()
    keys = derive_keys(SECRET)
    server = ControlServer(ctx=ctx, keys=keys)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    secure_client(dealer, keys)
    dealer.connect(server.address)
    try:
        dealer.send(encode_control(Hello(server_id="s1")))
        deadline, seen = time.monotonic() + 5, []
        while not seen and time.monotonic() < deadline:
            seen = server.poll(0.2)
        identity, message = seen[0]
        assert isinstance(message, Hello) and message.server_id == "s1"
        assert server.send(identity, Progress(groups_consumed=3, acked=["g1"]))
        assert dealer.poll(5000)
        reply = decode_control(dealer.recv(), to="serve")
        assert reply.groups_consumed == 3 and reply.acked == ["g1"]
    finally:
        dealer.close(linger=0)
        ctx.destroy(linger=0)


def test_bad_secret_files_are_refused_naming_the_flag(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"tiny\n")
    with pytest.raises(ValueError, match="--secret-file .* holds 4 bytes, expected at least 16"):
        read_secret(str(short))
    with pytest.raises(ValueError, match="cannot be read"):
        read_secret(str(tmp_path / "missing"))
    good = tmp_path / "good"
    good.write_bytes(SECRET + b"\n")
    assert read_secret(str(good)) == SECRET
    a, b = derive_keys(SECRET), derive_keys(SECRET)
    assert a == b and a.server_public != a.client_public and derive_keys(SECRET + b"x") != a


def test_a_socket_secret_gives_curve_keys_without_weight_tags_and_a_secret_file_gives_both(tmp_path):
    from inflight.wire.contract import SecretKnob

    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert SecretKnob(secret_file=str(path)).secrets() == (SECRET, SECRET)
    assert SecretKnob(socket_secret_file=str(path)).secrets() == (SECRET, None)  # checksums, not keyed tags
    assert SecretKnob(secret_file=str(path), socket_secret_file=str(tmp_path / "other")).secrets() == (SECRET, SECRET)
    assert SecretKnob().secrets() == (None, None)
    (tmp_path / "short").write_bytes(b"tiny")
    with pytest.raises(ValueError, match="--socket-secret-file .* holds 4 bytes"):
        SecretKnob(socket_secret_file=str(tmp_path / "short")).validate_secret()
