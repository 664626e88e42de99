"""The ports the run hands its sides (inflight/run/launch.py:free_ports): drawn below the kernel's ephemeral range,
where no bind(0) and no outgoing connection takes them again between the draw and the side's own bind."""

from __future__ import annotations

import socket

import pytest

from inflight.run import launch


def test_free_ports_are_distinct_bindable_and_below_the_kernels_ephemeral_range():
    low = launch.ephemeral_range_low()
    if low - launch.LOWEST_FREE_PORT < 1000:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: free_ports takes bind(0)'s ports here")
    ports = launch.free_ports(20, "127.0.0.1")
    assert len(set(ports)) == 20 and all(launch.LOWEST_FREE_PORT <= p < low for p in ports), ports
    for port in ports:  # free when handed out: the side binds each
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(launch, "ephemeral_range_low", lambda: port + 1)  # a pool of 1000 ports, one taken
        monkeypatch.setattr(launch, "LOWEST_FREE_PORT", port - 999)
        drawn = {p for _ in range(40) for p in launch.free_ports(5, "127.0.0.1")}
    assert port not in drawn and len(drawn) > 50


def test_a_kernel_whose_ephemeral_range_leaves_no_room_below_gets_bind0s_ports(monkeypatch):
    monkeypatch.setattr(launch, "ephemeral_range_low", lambda: launch.LOWEST_FREE_PORT + 10)
    ports = launch.free_ports(3, "127.0.0.1")
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)
