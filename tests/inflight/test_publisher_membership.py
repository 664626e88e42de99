"""The control plane's membership under repeated Hellos and heartbeat bursts (inflight/learn/control.py).

Real ZeroMQ sockets and a real gloo weights group; the serve's end is a thread speaking the control protocol with a
plain DEALER (the real serve is exercised end to end by test_two_hosts.py, where this went wrong: after a cut link
healed, a dozen queued heartbeats each drew an Introduce, each Introduce a Hello, and a Hello that arrived while the
group was forming replaced the serve's record, so the formed group had no members and `publish` raised IndexError).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from inflight.learn.publisher import open_publisher
from inflight.wire.control import (
    ControlServer,
    Hello,
    Introduce,
    Joined,
    JoinGroup,
    Status,
    TensorSpec,
    UpdateDone,
    UpdateWeights,
    decode_control,
    encode_control,
)
from inflight.wire.group import GroupAddress, WeightsGroup
from inflight.wire.transfer import receive_update
from inflight.wire.weights import UpdateManifest, unpack_buckets

STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
SPECS = [TensorSpec(name, "float32", list(t.shape)) for name, t in STATE.items()]


def hello(server_id: str = "serve@00c0ffee") -> Hello:
    return Hello(server_id=server_id, model="m", workers=1, version=0, tensors=SPECS)


def dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def receive(sock: zmq.Socket, timeout_s: float = 5.0):
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return decode_control(sock.recv(), to="serve")


@pytest.fixture
def publisher():
    control = ControlServer()
    pub = open_publisher(control, timeout_s=20.0, quiet_after_s=0.5)
    pub.check.set_model(STATE)
    yield pub
    pub.close()


def test_a_burst_of_heartbeats_from_an_unknown_serve_draws_one_introduce(publisher):
    sock = dealer(publisher.plane.control.address)
    for i in range(12):  # what a healed link delivers at once: the heartbeats queued while it was down
        sock.send(encode_control(Status(server_id="serve@00c0ffee", version=i)))
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        publisher.plane.pump(0.05)
    introduced = []
    while (message := receive(sock, 0.2)) is not None:
        introduced.append(message)
    assert len(introduced) == 1 and isinstance(introduced[0], Introduce)
    time.sleep(1.0)  # a serve that is still unknown a second later is asked again: a lost Introduce is not fatal
    sock.send(encode_control(Status(server_id="serve@00c0ffee")))
    publisher.plane.pump(1.0)
    assert isinstance(receive(sock, 2.0), Introduce)
    sock.close()


def test_a_hello_repeated_while_the_group_forms_keeps_the_member_and_the_update_arrives(publisher):
    """The serve answers JoinGroup with another Hello first (as if an old Introduce reached it only now)."""
    sock = dealer(publisher.plane.control.address)
    sock.send(encode_control(hello()))
    got: dict = {}

    def serve_end() -> None:
        group = None
        while "tensors" not in got:
            message = receive(sock, 30.0)
            if isinstance(message, JoinGroup):
                sock.send(encode_control(hello()))  # the duplicate, before joining: it arrives while the group forms
                address = GroupAddress(message.host, message.port, message.world_size, message.group_name,
                                       message.backend, message.timeout_s)  # fmt: skip
                group = WeightsGroup(address, message.rank)
                sock.send(encode_control(Joined(server_id="serve@00c0ffee", group_name=message.group_name)))
            elif isinstance(message, UpdateWeights):
                manifest = UpdateManifest.decode(message.manifest)
                got["tensors"] = unpack_buckets(manifest, receive_update(group, manifest), verify=True)
                sock.send(encode_control(UpdateDone(server_id="serve@00c0ffee", version=manifest.version)))
            elif message is None:
                got["error"] = "no message for 30 s"
                break
        if group is not None:
            group.close()

    thread = threading.Thread(target=serve_end, daemon=True)
    thread.start()
    publisher.plane.pump(2.0)
    assert len(publisher.plane.serves) == 1
    report = publisher.publish(STATE, 1)
    thread.join(30.0)
    assert report.serves == 1 and report.failed == [], report
    assert "error" not in got
    assert all(torch.equal(got["tensors"][name], t) for name, t in STATE.items())
    assert len(publisher.plane.serves) == 1 and next(iter(publisher.plane.serves.values())).member
    sock.close()


def test_the_same_serve_reconnected_under_a_new_identity_replaces_its_old_record(publisher):
    first, second = dealer(publisher.plane.control.address), dealer(publisher.plane.control.address)
    first.send(encode_control(hello()))
    publisher.plane.pump(2.0)
    second.send(encode_control(hello()))  # the same process after a reconnect: a new ZeroMQ identity
    publisher.plane.pump(2.0)
    assert [s.server_id for s in publisher.plane.serves.values()] == ["serve@00c0ffee"]
    third = dealer(publisher.plane.control.address)
    third.send(encode_control(hello("serve@0badf00d")))  # another process (another nonce) is another serve
    publisher.plane.pump(2.0)
    assert sorted(s.server_id for s in publisher.plane.serves.values()) == ["serve@00c0ffee", "serve@0badf00d"]
    for sock in (first, second, third):
        sock.close()
